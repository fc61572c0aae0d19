"""The memory plan: rows and row length from the memory there is; requests that can never fit are
refused at submit, and the output does not depend on what the plan decides."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import step_rows, tiny_loaded
from transformers import LlamaConfig

from flashspec_core import memory_plan
from flashspec_core.arms import Arm
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.memory_plan import kv_bytes_per_token, plan_memory, step_bytes
from flashspec_core.prompts import ContextLengthError
from flashspec_core.routing.fixed import FixedRouter

pytestmark = pytest.mark.usefixtures("torch_one_thread")

LONG_RUN = [6, 6, 6, 6, 1]  # a prompt whose greedy continuation (tiny_target) never meets eos: checked below


# ------------------------------------------------------------------ the plan, in numbers

def test_bytes_per_token_count_keys_and_values_of_every_kv_head_in_every_layer():
    smol = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    assert kv_bytes_per_token(smol, torch.float32) == 30 * 2 * 3 * 64 * 4  # head_dim = 576 / 9
    assert kv_bytes_per_token(smol, torch.bfloat16) == 30 * 2 * 3 * 64 * 2
    wide_heads = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             num_hidden_layers=3)
    assert kv_bytes_per_token(wide_heads, torch.float16) == 3 * 2 * 2 * 32 * 2  # head_dim given, not 64 / 4
    no_gqa = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    assert kv_bytes_per_token(no_gqa, torch.float32) == 2 * 2 * 4 * 16 * 4  # every head has its own K and V
    no_heads = SimpleNamespace(hidden_size=64, num_hidden_layers=2)
    assert kv_bytes_per_token(no_heads, torch.float32) == 2 * 2 * 64 * 4
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_bytes_per_token(SimpleNamespace(d_model=64), torch.float32)


def test_step_bytes_are_the_widest_feed_eagerly_and_every_captured_width_with_graphs():
    assert step_bytes([1, 3, 5], 100, torch.bfloat16, graphs=False) == 5 * 100 * 4  # fp32 probabilities
    assert step_bytes([1, 3, 5], 100, torch.bfloat16, graphs=True) == 2 * 9 * 100 * 2


def test_rows_are_what_the_budget_holds_at_the_full_context():
    per_token, context, slack, row_bytes = 1000, 4096, 64, 5000
    row = (context + slack) * per_token + row_bytes
    for fits in (1, 3, 7):
        free = 2 * fits * row  # a fraction of 0.5 leaves exactly `fits` rows
        plan = plan_memory(per_token, free, 0.5, 8, context, slack, row_bytes)
        assert (plan.rows, plan.row_tokens) == (fits, context)
        one_short = plan_memory(per_token, free - 2, 0.5, 8, context, slack, row_bytes)
        if fits > 1:
            assert (one_short.rows, one_short.row_tokens) == (fits - 1, context)
        else:  # one row, a token shorter than the context
            assert (one_short.rows, one_short.row_tokens) == (1, context - 1)
    roomy = plan_memory(per_token, 1 << 40, 0.9, 8, context, slack, row_bytes)
    assert (roomy.rows, roomy.row_tokens, roomy.requested_rows) == (8, context, 8)  # never more than asked


def test_one_row_holds_what_the_budget_gives_when_not_even_one_full_row_fits():
    per_token, context, slack, row_bytes = 1000, 4096, 64, 5000
    plan = plan_memory(per_token, 2_000_000, 1.0, 8, context, slack, row_bytes)
    assert plan.rows == 1
    assert plan.row_tokens == (2_000_000 - row_bytes) // per_token - slack  # 1931
    assert plan.row_cost(plan.row_tokens) <= plan.budget < plan.row_cost(plan.row_tokens + 1)
    assert "memory_fraction" in plan.limit() and str(plan.row_tokens) in plan.limit()
    assert "memory_fraction" not in plan_memory(per_token, 1 << 40, 0.9, 8, context).limit()


@pytest.mark.parametrize("free, fraction", [(64_000, 1.0), (10**9, 0.0), (10**9, 1.5), (10**9, True)])
def test_a_budget_that_holds_no_row_or_a_bad_fraction_names_memory_fraction(free, fraction):
    with pytest.raises(ValueError, match="memory_fraction"):
        plan_memory(1000, free, fraction, 8, 4096, slack=64)


# ------------------------------------------------------------------ the engine

def engine_over(loaded, **kwargs) -> SpecEngine:
    return SpecEngine(loaded, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 4)),
                      verify_backend="torch", calibrate=False, **kwargs)


@torch.no_grad()
def hf(loaded, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                pad_token_id=loaded.tokenizer.pad_token_id)
    return out[0, len(prompt):].tolist()


def fake_free(monkeypatch, free: int) -> None:
    """The engine reads `free` bytes free instead of the machine's (nothing is allocated)."""
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: free)


def row_bytes_of(engine: SpecEngine) -> int:
    return engine.memory.row_cost(engine.memory.context)


def test_a_request_past_the_context_window_is_refused_at_submit_and_one_at_it_is_served(tiny_target):
    engine = engine_over(tiny_target)
    window = tiny_target.model.config.max_position_embeddings
    assert engine.context_window == window  # this machine's memory holds 8 rows of this tiny model
    start = time.monotonic()
    with pytest.raises(ContextLengthError, match=rf"max_new_tokens: the prompt has 5 tokens.*{window - 5}.*{window}"):
        engine.submit([LONG_RUN], max_new_tokens=window - 5 + 1)
    with pytest.raises(ContextLengthError, match="prompt: 256 tokens"):
        engine.submit([[1] * window], max_new_tokens=1)
    assert time.monotonic() - start < 1.0
    assert (engine.running, engine.queued) == (0, 0)  # nothing queued, no slot held
    expected = hf(tiny_target, LONG_RUN, window - 5)
    assert len(expected) == window - 5  # no eos on the way: the row really fills the window
    result = engine.generate(LONG_RUN, max_new_tokens=window - 5)
    assert result.token_ids == expected


def test_a_small_free_memory_caps_the_rows_and_the_output_is_unchanged(tiny_target, monkeypatch, caplog):
    roomy = engine_over(tiny_target)
    fake_free(monkeypatch, int(3.5 * row_bytes_of(roomy) / 0.9))  # 3 full rows and a half
    with caplog.at_level(logging.WARNING, logger=memory_plan.__name__):
        engine = engine_over(tiny_target, max_batch=8)
    assert (engine.memory.rows, engine.context_window) == (3, roomy.context_window)
    assert engine._scheduler.max_rows == 3
    (line,) = [r.getMessage() for r in caplog.records if r.name == memory_plan.__name__]
    assert line.startswith("max_batch 8 -> 3 rows") and "memory_fraction=0.9" in line
    prompts = [LONG_RUN, [3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [6, 6, 6, 6, 1, 2], [5, 3, 5]]
    seen = step_rows(monkeypatch, engine)  # recorded by the scheduler's own thread: no polling race
    results = engine.generate(prompts, max_new_tokens=40)
    assert max(seen) == 3
    assert [r.token_ids for r in results] == [hf(tiny_target, p, 40) for p in prompts]


def test_when_not_even_one_row_fits_the_window_shrinks_and_names_memory_fraction(tiny_target, monkeypatch):
    roomy = engine_over(tiny_target)
    plan = roomy.memory
    free = int(plan.row_cost(100) / 0.9) + 1  # one row of 100 tokens
    fake_free(monkeypatch, free)
    engine = engine_over(tiny_target, max_batch=4)
    assert (engine.memory.rows, engine.context_window) == (1, 100)
    with pytest.raises(ContextLengthError,
                       match=r"max_new_tokens: .* 95 new tokens fit the 100 tokens .*memory_fraction"):
        engine.submit([LONG_RUN], max_new_tokens=96)
    assert (engine.running, engine.queued) == (0, 0)
    result = engine.generate(LONG_RUN, max_new_tokens=95)
    assert result.token_ids == hf(tiny_target, LONG_RUN, 95)
    cache = engine.runner.static  # the CPU runner's static cache never grew past the plan's row
    assert cache.max_len <= 100 + engine.runner.cache_slack
    fake_free(monkeypatch, 1000)
    with pytest.raises(ValueError, match="memory_fraction"):
        engine_over(tiny_target)


def test_a_growing_cache_stops_at_the_plans_row_length():
    """The CPU runner's cache starts at 512 slots and doubles as rows grow: a row near a 1024-token
    window takes it to the plan's bound (the window and the slack), not to 2048."""
    loaded = tiny_loaded(16, seed=0, max_positions=1024)
    engine = engine_over(loaded)
    prompt = [(7 * i) % 15 for i in range(1000)]
    result = engine.generate(prompt, max_new_tokens=24)
    assert result.token_ids == hf(loaded, prompt, 24)
    cache = engine.runner.static
    assert 1000 < cache.max_len <= 1024 + engine.runner.cache_slack


def test_max_context_lowers_what_a_row_reserves_so_more_rows_fit(tiny_target, monkeypatch):
    roomy = engine_over(tiny_target)
    fake_free(monkeypatch, int(2.5 * row_bytes_of(roomy) / 0.9))  # 2 rows of the model's 256 tokens
    assert engine_over(tiny_target).memory.rows == 2
    engine = engine_over(tiny_target, max_context=100)
    plan = engine.memory
    assert engine.context_window == 100 and plan.rows == plan.budget // plan.row_cost(100) == 4  # rows of 100 tokens
    with pytest.raises(ContextLengthError, match=r"at most 95 new tokens fit max_context=100 tokens .* is 256"):
        engine.submit([LONG_RUN], max_new_tokens=96)
    assert engine.generate(LONG_RUN, max_new_tokens=95).token_ids == hf(tiny_target, LONG_RUN, 95)
    assert engine_over(tiny_target, max_context=1000).context_window == 256  # never past the model's window
    for bad in (1, 2.5, True):
        with pytest.raises(ValueError, match="max_context"):
            engine_over(tiny_target, max_context=bad)
