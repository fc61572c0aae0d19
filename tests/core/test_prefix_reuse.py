"""Prefix reuse with teeth: a request admitted into the slot the previous one left
reuses the prompt they share, exactly that much, on every CPU runner of the default model.

Three agent-style chat prompts share a long system prompt (a document) and the first turns, and
are sent one after another, so each is admitted into the slot its predecessor left:

- "france" first, with nothing cached;
- "japan" differs from "france" only in the last question's country, right after ~170 shared tokens;
- "airport" differs from "japan" right after the system prompt (another first turn).

Each output must be what the model computes from the prompt alone: HF `generate(do_sample=False)`
on a stock copy of the model (a divergence at an fp tie of the reference is allowed, as in
test_greedy_default.py), or, on the llama.cpp runner, llama-cpp-python's own greedy decoding of
the same GGUF file given the same prompts in the same order (it reuses its own context's
prefix as the engine does; test_llama_cpp.py says why that makes it bit for bit comparable).

A runner that reuses one token more than the prompts share (plants.py's `reuse_one_past`: the
last reused position holds the previous request's keys and values) answers "japan" with Paris
and "airport" from the wrong turn; the last test plants it in every runner and requires the
output test to fail (on every runner, both prompts admitted after another).
"""
from __future__ import annotations

import pytest
from default_prompts import DOC
from helpers import TIE_GAP, greedy_references, idle_core_threads
from plants import reuse_one_past, share_one_past

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.backends import llama_cpp
from flashspec_core.backends.cpu_linear import BLOCKS
from flashspec_core.backends.hf import CachedModel
from flashspec_core.backends.native_layers import NATIVE
from flashspec_core.engine import SpecEngine
from flashspec_core.models import default_gguf_path, vocab_size
from flashspec_core.prompts import encode_prompt
from flashspec_core.routing.fixed import FixedRouter
from flashspec_workloads.baselines import LlamaCppGreedy, stock_default_model

pytestmark = pytest.mark.slow

MAX_NEW = 16
# Every CPU runner: the static cache (cpu_static.py) on the GGUF block kernel and on the native
# layer stack, transformers' dynamic cache (hf.py), llama.cpp (llama_cpp.py).
RUNNERS = ["static-" + NATIVE, "static-" + BLOCKS, "hf", "llama.cpp"]

SYSTEM = ("You are the travel assistant of Northwind Rail. Answer in one short sentence, using this document "
          "where it helps.\n\n" + DOC)


def _chat(first: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": first},
            {"role": "assistant", "content": "Great! Where would you like to go?"},
            {"role": "user", "content": question}]


TRIP = "Hi, I am planning a trip abroad next month."
CONVERSATIONS = {  # sent in this order
    "france": _chat(TRIP, "What is the capital of France?"),
    "japan": _chat(TRIP, "What is the capital of Japan?"),
    "airport": _chat("Which line takes me to the airport?", "And how long does the ride take?"),
}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with idle_core_threads() as threads:
        yield threads


@pytest.fixture(scope="module")
def prompts(default_target) -> list[list[int]]:
    vocab = vocab_size(default_target.model)
    ids = [encode_prompt(default_target.tokenizer, c, vocab) for c in CONVERSATIONS.values()]
    for before, after in zip(ids, ids[1:]):  # each shares a long prefix with the one before, and differs
        shared = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
        assert shared >= 64
    return ids


@pytest.fixture(scope="module")
def hf_references(prompts) -> list[tuple[list[int], list[float]]]:
    return greedy_references(stock_default_model(), prompts, MAX_NEW)


@pytest.fixture(scope="module")
def engines(default_target):
    """One engine per runner (built when first asked for), shared by the tests of this module."""
    built: dict[str, SpecEngine] = {}

    def get(runner: str) -> SpecEngine:
        if runner not in built:
            built[runner] = _engine(default_target, runner)
        return built[runner]

    return get


def _engine(target, runner: str) -> SpecEngine:
    router = FixedRouter(Arm(NO_DRAFT, 0))
    if runner == "llama.cpp":
        if not llama_cpp.available():
            pytest.skip("llama-cpp-python missing")
        return SpecEngine(target, [], router=router, backend="llama.cpp", calibrate=False)
    engine = SpecEngine(target, [], router=router, backend="hf", calibrate=False)
    if runner == "hf":
        engine.runner = CachedModel(target.model, engine.runner.pad_token_id, gguf=target.gguf)
        return engine
    kernel = runner.removeprefix("static-")
    if kernel not in engine.runner.kernels():
        pytest.skip(f"{kernel} is not available on this machine")
    engine.runner.use_kernel(kernel)  # no plan: it stays on for every forward
    return engine


def _diverging(engine: SpecEngine, runner: str, prompts, hf_references, reset: bool = True) -> dict[str, str]:
    """Send the prompts one after another (from empty rows unless `reset` is False); return how each
    output that is not the reference's diverges, by conversation (empty: all exact)."""
    return _compare(engine, runner, prompts, hf_references, reset,
                    (engine.generate(ids, max_new_tokens=MAX_NEW).token_ids for ids in prompts))


def _compare(engine: SpecEngine, runner: str, prompts, hf_references, reset: bool, outputs) -> dict[str, str]:
    """How each of `outputs` (an iterable: the requests run as it is read) diverges from its
    reference, by conversation (empty: all exact)."""
    if reset:
        engine.runner.reset(1)
    if runner == "llama.cpp":  # llama.cpp's own greedy, from a fresh context, given the same prompts in turn
        reference = LlamaCppGreedy(default_gguf_path(), engine.eos_ids, n_ctx=engine.runner.n_ctx,
                                   one_token_threads=1)
        references = [(reference(ids, MAX_NEW)[0], None) for ids in prompts]
    else:
        references = hf_references
    found = {}
    for name, got, (expected, gaps) in zip(CONVERSATIONS, outputs, references):
        if got == expected:
            continue
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        gap = gaps[at] if gaps is not None and at < len(gaps) else float("inf")
        if gap >= TIE_GAP:
            found[name] = (f"{name!r} diverges at token {at}: {engine.tokenizer.decode(got)!r}, "
                           f"expected {engine.tokenizer.decode(expected)!r} (top-2 gap {gap:.1e})")
    return found


@pytest.mark.parametrize("runner", RUNNERS)
def test_prompts_that_diverge_after_a_long_shared_prefix_get_the_models_own_output(
        engines, runner, prompts, hf_references):
    engine = engines(runner)
    found = _diverging(engine, runner, prompts, hf_references)
    assert not found, f"{runner}: " + "; ".join(found.values())


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_output_test_catches_reuse_one_token_past_the_shared_prefix(engines, runner, prompts, hf_references,
                                                                       monkeypatch):
    engine = engines(runner)
    monkeypatch.setattr(engine.runner, "prefix_len", reuse_one_past(engine.runner))
    try:
        found = _diverging(engine, runner, prompts, hf_references)
    finally:
        engine.runner.reset(1)  # the plant's rows hold other requests' keys and values
    admitted_after_another = set(CONVERSATIONS) - {"france"}
    assert set(found) == admitted_after_another, (
        f"{runner}: the reuse_one_past plant went unnoticed on {sorted(admitted_after_another - set(found))}")


@pytest.mark.parametrize("runner", ["static-" + NATIVE, "static-" + BLOCKS])
def test_prefix_reuse_beside_a_decoding_row_gets_the_models_own_output(engines, runner, prompts, hf_references):
    """The same prompts while another request decodes on its own slot throughout: each prompt is
    fed in pieces inside that row's steps (one ragged forward a turn), reusing the slot its
    predecessor left, and each output is still the model's own."""
    engine = engines(runner)
    engine.runner.reset(1)
    busy = engine.submit([[{"role": "user", "content": "Write the numbers from 1 to 400, one per line."}]],
                         max_new_tokens=1500, stream=True)
    next(iter(busy))  # decoding before the first prompt is admitted
    found = _diverging(engine, runner, prompts, hf_references, reset=False)
    assert engine.running >= 1, "the decoding row ended before the prompts did: nothing was fed beside it"
    busy.cancel()
    assert not found, f"{runner}: " + "; ".join(found.values())


@pytest.mark.parametrize("runner, planted", [("static-" + NATIVE, False), ("static-" + BLOCKS, False),
                                             ("llama.cpp", False), ("static-" + NATIVE, True),
                                             ("static-" + BLOCKS, True)])
def test_prompts_sent_together_copy_the_prefix_one_of_them_fed(engines, runner, prompts, hf_references, planted,
                                                              monkeypatch):
    """The three prompts as one batch: "france" is fed first, the two that share its prefix wait for
    it and copy its keys and values from its cache row (`share_prefix`; llama.cpp shares the cells),
    and each output is the model's own (llama.cpp: its own greedy decoding of the prompts in turn).
    With `share_one_past` planted (the copy reaches one position into what the
    prompts do not share) "japan" answers from "france"'s question, and the comparison says so."""
    engine = engines(runner)
    engine.runner.reset(len(engine.runner.held))  # empty rows, as many as the scheduler's slots
    if planted:
        monkeypatch.setattr(engine.runner, "share_prefix", share_one_past(engine.runner))
    results = []

    def outputs():
        results.extend(engine.generate(prompts, max_new_tokens=MAX_NEW))
        return (r.token_ids for r in results)

    try:
        found = _compare(engine, runner, prompts, hf_references, False, outputs())
    finally:
        engine.runner.reset(len(engine.runner.held))  # empty rows, as many as the scheduler's slots
    if planted:
        assert "japan" in found, f"{runner}: the share_one_past plant went unnoticed"
        return
    assert not found, f"{runner}: " + "; ".join(found.values())
    cached = [r.stats.cached_prompt_tokens for r in results]
    assert cached[0] == 0 and min(cached[1:]) >= 64, f"the later prompts did not copy the shared prefix: {cached}"
