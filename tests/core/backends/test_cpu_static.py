"""The CPU static-cache runner: each row's logits equal a fresh transformers forward of its sequence.

At contexts of ~1k tokens, after rollbacks, growth of the cache, and batches whose rows hold
different lengths and advance by different amounts, on each Llama family the runner claims; the
cache past the live slice is never read (poisoned with NaN, the logits stay exact); the engine's
greedy output on it is HF `generate`'s.
"""
from __future__ import annotations

import random

import pytest
import torch
from helpers import tiny_family, tiny_loaded, tiny_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel
from walks import ragged_walk

from flashspec_core.arms import Arm
from flashspec_core.backends import make_runner, model_runner, ragged
from flashspec_core.backends.cpu_static import INITIAL_LEN, StaticCachedModel
from flashspec_core.backends.hf import CachedModel
from flashspec_core.backends.ragged import CHUNK
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.models import LoadedModel
from flashspec_core.routing.fixed import FixedRouter

VOCAB = 24
TOL = dict(atol=1e-5, rtol=1e-5)


@torch.no_grad()
def _fresh(model, seq, keep):
    return model(input_ids=torch.tensor([seq])).logits[0, -keep:]


def _check(model, runner, seqs, active, keep):
    out = runner.forward_to(seqs, active, keep_logits=keep)
    assert out.shape == (len(seqs), keep, VOCAB)
    for b, s in enumerate(seqs):
        if active[b]:
            torch.testing.assert_close(out[b], _fresh(model, s, keep), **TOL, msg=lambda m: f"row {b}: {m}")


@pytest.mark.parametrize(("family", "rows"), [("llama", 1), ("llama", 3), ("qwen2", 3), ("qwen3", 2)])
def test_logits_match_a_fresh_forward_at_a_long_context(family, rows, torch_one_thread):
    model = tiny_family(family, VOCAB, max_positions=2048)
    runner = StaticCachedModel(model, pad_token_id=0, max_len=64)
    rng = random.Random(rows)
    runner.reset(rows)
    # Rows of different lengths prefilled together from empty (SDPA's causal mask, padded rows).
    seqs = [[rng.randrange(VOCAB) for _ in range(1000 - 300 * b)] for b in range(rows)]
    _check(model, runner, seqs, [True] * rows, keep=2)
    assert runner.static.max_len >= 1024, "the prompt should have grown the cache from 64 slots"
    for step in range(16):
        keep = rng.choice([1, 1, 2, 5])
        seqs = [s[:len(s) - rng.randint(0, 4)] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]
                for s in seqs]
        if step == 8:  # a long feed after a reused prefix: passes of CHUNK columns with explicit masks
            seqs[0] = seqs[0][:600] + [rng.randrange(VOCAB) for _ in range(CHUNK + 200)]
        active = [b == 0 or rng.random() < 0.7 for b in range(rows)]
        _check(model, runner, seqs, active, keep)


@pytest.mark.parametrize("kernel", ["stock", "packed"])
def test_decoding_never_reads_past_the_live_slots(kernel, torch_one_thread):
    model = tiny_family("llama", VOCAB)
    runner = StaticCachedModel(model, pad_token_id=0)
    if kernel not in runner.kernels():
        pytest.skip("this torch build cannot pack linear weights")
    runner.use_kernel(kernel)
    rng = random.Random(0)
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (300, 40)]
    runner.reset(2)
    runner.forward_to(seqs)
    for _ in range(6):  # plain decoding and 3-token verify passes, every slot past the live ones poisoned
        width = rng.choice([1, 3])
        live = max(map(len, seqs)) + width  # rows are fed `width` columns (a shorter chunk is padded)
        seqs = [s + [rng.randrange(VOCAB) for _ in range(rng.choice([1, width]))] for s in seqs]
        for cache in runner.static.keys + runner.static.values:
            cache[:, :, live:] = float("nan")
        _check(model, runner, seqs, [True, True], keep=1)
        for cache in runner.static.keys + runner.static.values:  # below a later step's live length,
            cache[:, :, live:] = 0.0  # a shorter row reads (and masks) such slots: they must be finite


def test_prefix_reuse_across_requests_and_a_batch_after_a_single(torch_one_thread):
    model = tiny_family("llama", VOCAB)
    runner = StaticCachedModel(model, pad_token_id=0)
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(500)]
    runner.begin(1)
    _check(model, runner, [prompt + [1, 2]], [True], keep=1)
    runner.begin(1)  # the next single-prompt request keeps the common prefix
    assert runner.prefix_len(0, prompt + [3]) == 500
    _check(model, runner, [prompt + [3, 4]], [True], keep=2)
    assert runner.static.max_len == 1024, "500 tokens and the scratch slots need more than 512 slots"
    runner.begin(2)  # a batch starts afresh, and small
    assert runner.prefix_len(0, prompt) == 0 and runner.static.max_len == INITIAL_LEN
    _check(model, runner, [prompt[:300], prompt[:7]], [True, True], keep=1)


def test_the_cpu_picks_the_static_runner_for_llama_families_only():
    llama = tiny_loaded(16, seed=0)
    assert isinstance(make_runner(llama, "hf", 15, 256), StaticCachedModel)
    assert isinstance(model_runner(llama.model, 15), StaticCachedModel)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2))
    other = LoadedModel(model=gpt2, tokenizer=tiny_tokenizer(16), name="gpt2")
    assert type(make_runner(other, "hf", 15, 256)) is CachedModel
    assert type(model_runner(gpt2, 15)) is CachedModel


def test_engine_greedy_equals_hf_generate_on_long_prompts(torch_one_thread):
    loaded = tiny_loaded(VOCAB, seed=2, layers=2, max_positions=2048)
    stock = tiny_loaded(VOCAB, seed=2, layers=2, max_positions=2048).model  # the engine swaps its model's linears
    engine = SpecEngine(loaded, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 4)), backend="hf",
                        calibrate=False)
    assert isinstance(engine.runner, StaticCachedModel)
    rng = random.Random(4)
    motif = [rng.randrange(VOCAB - 1) for _ in range(12)]  # repeats, so prompt lookup drafts (and misses)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] + motif * 3 for n in (900, 400, 30)]
    got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=40)]
    prompts.append(prompts[0][:700] + motif)
    got.append(engine.generate(prompts[-1], max_new_tokens=40).token_ids)  # a single prompt after the batch
    prompts.append(prompts[-1] + got[-1][:5] + motif)
    got.append(engine.generate(prompts[-1], max_new_tokens=40).token_ids)  # reuses the previous one's prefix
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                 pad_token_id=VOCAB - 1)[0, len(prompt):].tolist()
        assert tokens == ref


@pytest.mark.parametrize(("family", "rows", "chunk"), [("llama", 3, 512), ("llama", 4, 5), ("qwen3", 3, 7)])
def test_rows_of_different_widths_share_one_forward(family, rows, chunk, monkeypatch, torch_one_thread):
    """The torch layers; chunk: queries per attention pass after a reused prefix (small: slices)."""
    monkeypatch.setattr(ragged, "CHUNK", chunk)
    model = tiny_family(family, VOCAB)
    ragged_walk(model, StaticCachedModel(model, pad_token_id=0, max_len=48), rows, seed=rows + chunk)
