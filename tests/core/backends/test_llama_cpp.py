"""The llama.cpp target: exact against llama.cpp's own decoding of the same GGUF file.

With flash attention on and one-token passes on one thread, llama.cpp's logits depend on how
tokens are batched only between a large batch (its prompt kernels, 64+ tokens) and small ones;
widths up to a verify pass compute what one-token decoding computes, bit for bit, at any context
length (llama_cpp.py says what breaks it otherwise). So the engine, which scores the first token
from the prompt's own forward and every later one from verify passes, must reproduce the greedy tokens of
llama-cpp-python's own `Llama.generate` at temperature 0 (the prompt after the prefix its context
already holds in one batch, then one token at a time), for every draft; and its sampling path must
follow the law of llama.cpp's distributions.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from helpers import g_test

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.backends import llama_cpp as backend
from flashspec_core.drafts import PromptLookupDraft, SuffixCacheDraft
from flashspec_core.drafts.trained import shipped_drafts
from flashspec_core.engine import SpecEngine
from flashspec_core.models import default_gguf_path, vocab_size
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.prompts import encode_prompt
from flashspec_core.routing.fixed import FixedRouter
from flashspec_workloads.baselines import LlamaCppGreedy

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not backend.available(), reason="llama-cpp-python missing")]
MAX_NEW = 48


@pytest.fixture(scope="module")
def runner():
    return backend.LlamaCppModel(default_gguf_path(), n_ctx=2048)


def test_rollbacks_and_widths_give_one_token_decodings_logits(runner):
    rng = random.Random(0)
    base = [rng.randrange(200, 20000) for _ in range(240)]  # the walk crosses 256 tokens
    walk = base + [rng.randrange(200, 20000) for _ in range(40)]
    runner.reset(1)
    runner.forward_to([base])
    one_by_one = torch.stack([runner.forward_to([walk[:t + 1]])[0, 0] for t in range(len(base), len(walk))])
    runner.reset(1)
    runner.forward_to([base])
    held = len(base)
    for _ in range(30):  # verify-like steps: roll back a few, feed a few with logits for each
        keep = rng.randint(len(base), held)
        width = rng.randint(1, min(9, len(walk) - keep))
        logits = runner.forward_to([walk[:keep + width]], keep_logits=width)[0]
        expected = one_by_one[keep - len(base):keep - len(base) + width]
        assert torch.equal(logits, expected)
        held = keep + width
    assert runner.prefix_len(0, walk) == held


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(runner):
    """Prompts of 24 rows fed in one `forward_to` (404 tokens: llama.cpp's batch kernels, which
    round otherwise, if they shared a pass), then a verify-like step of 3 tokens each (72 tokens):
    every row's logits are the bits that row computes alone, on whatever kernels this CPU runs."""
    rng = random.Random(5)
    prompts = [[rng.randrange(200, 20000) for _ in range(5 + 2 * i)] for i in range(24)]
    steps = [p + [rng.randrange(200, 20000) for _ in range(3)] for p in prompts]
    many = backend.LlamaCppModel(default_gguf_path(), n_ctx=2048, max_batch=24)
    try:
        many.reset(24)
        together = many.forward_to(prompts)[:, 0]
        verified = many.forward_to(steps, keep_logits=3)
    finally:
        many.close()
    for b, (prompt, step) in enumerate(zip(prompts, steps)):
        runner.reset(1)
        assert torch.equal(together[b], runner.forward_to([prompt])[0, 0]), f"row {b}'s prompt"
        assert torch.equal(verified[b], runner.forward_to([step], keep_logits=3)[0]), f"row {b}'s step"


def test_the_context_holds_the_memory_plans_tokens_for_every_row():
    """After `limit_cache(n)` the context is created for n tokens a row times its rows (one unified
    cache of n tokens would be full mid-request with several rows), and a longer row is refused by
    name before anything is fed."""
    import llama_cpp

    model = backend.LlamaCppModel(default_gguf_path(), n_ctx=256)
    try:
        model.limit_cache(300)
        model.resize(4)
        assert model.n_ctx == 4 * 300 <= llama_cpp.llama_n_ctx(model._ctx)
        with pytest.raises(ValueError, match="301 tokens; this llama.cpp context holds 300 a row"):
            model.forward_to([[5] * 301] * 4)
        assert model.held == [[]] * 4
    finally:
        model.close()


def test_a_named_cpu_variant_is_the_one_loaded():
    """FLASHSPEC_LLAMA_CPU_VARIANT picks the variant (another process: one loads per process)."""
    import os
    import subprocess
    import sys

    if backend.load_cpu_backends() is None:
        pytest.skip("llama.cpp was built without CPU variants")
    code = "from flashspec_core.backends import llama_cpp as b; print(b.load_cpu_backends())"
    env = {**os.environ, backend.VARIANT_ENV: "x64"}  # the baseline x86-64 variant: every x86 CPU runs it
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "x64"


@pytest.mark.parametrize("arm", ["none", "prompt_lookup@4", "suffix_cache@4", "distill_chat@2"])
def test_greedy_equals_llama_cpps_own_greedy(default_target, runner, arm):
    from default_prompts import PROMPTS

    name, _, gamma = arm.partition("@")
    drafts = [PromptLookupDraft(), SuffixCacheDraft(), *shipped_drafts(default_target)]
    engine = SpecEngine(default_target, drafts, router=FixedRouter(Arm(NO_DRAFT, 0) if name == NO_DRAFT
                                                                      else Arm(name, int(gamma))), backend="llama.cpp")
    vocab = vocab_size(default_target.model)
    accepted = 0
    # llama-cpp-python's own Llama.generate from a fresh context, as the engine's, with its threads.
    reference = LlamaCppGreedy(default_gguf_path(), engine.eos_ids, n_ctx=runner.n_ctx, one_token_threads=1)
    # A retrieval prompt of ~500 tokens (decoding past 256 is where thread counts would matter).
    prompts = dict(PROMPTS, long=[dict(m, content=m["content"] * 3) if m["role"] == "user" else m
                                  for m in PROMPTS["rag"]])
    for key in ("long", "code", "tool", "list", "long"):  # the repeat gives the suffix cache its own answer
        ids = encode_prompt(default_target.tokenizer, prompts[key], vocab)
        res = engine.generate(ids, max_new_tokens=MAX_NEW)
        accepted += res.stats.accepted
        assert res.token_ids == reference(ids, MAX_NEW)[0], f"{arm}, {key}"
    assert name == NO_DRAFT or accepted > 0


def test_sampling_follows_llama_cpps_distributions(default_target, runner):
    """Two tokens sampled at top_k=2 with prompt lookup proposing: a G-test of the joint law
    against the law computed from llama.cpp's own logits after the prompt and after each first token."""
    prompt = default_target.tokenizer.encode("one two three four one two three four one two")
    engine = SpecEngine(default_target, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 2)),
                        backend="llama.cpp", verify_backend="torch")
    sampling = SamplingParams(temperature=1.5, top_k=2, seed=11)
    results = [r for seed in (11, 12) for r in engine.generate(
        [prompt] * 200, max_new_tokens=2, sampling=sampling.model_copy(update={"seed": seed}))]
    assert sum(r.stats.accepted for r in results) > 0, "prompt lookup never had a token accepted"
    counts = Counter(tuple(r.token_ids) for r in results)
    runner.reset(1)
    first = runner.forward_to([prompt])[0, 0]
    law = {}
    top1 = torch.topk(first, 2)
    p1 = torch.softmax(top1.values / 1.5, -1)
    for t1, q1 in zip(top1.indices.tolist(), p1.tolist()):
        second = runner.forward_to([prompt + [t1]])[0, 0]
        top2 = torch.topk(second, 2)
        for t2, q2 in zip(top2.indices.tolist(), torch.softmax(top2.values / 1.5, -1).tolist()):
            law[(t1, t2)] = q1 * q2
    assert g_test(counts, law) > 0.01


def test_the_baselines_own_prompt_lookup_runs_past_n_batch_tokens(default_target):
    """llama-cpp-python's prompt lookup (the benchmarks' baseline) keeps every position's logits
    but sizes that buffer from `logits_all`; without asking for it a prompt past n_batch (512)
    tokens failed ("could not broadcast input array", 0.3.36). Its first token comes from the
    prompt's forward, as plain decoding's does."""
    from default_prompts import PROMPTS

    messages = [dict(m, content=m["content"] * 5) if m["role"] == "user" else m for m in PROMPTS["rag"]]
    ids = encode_prompt(default_target.tokenizer, messages, vocab_size(default_target.model))
    assert len(ids) > 512
    eos = [default_target.tokenizer.eos_token_id]
    plain, _ = LlamaCppGreedy(default_gguf_path(), eos, n_ctx=2048)(ids, 16)
    looked_up, _ = LlamaCppGreedy(default_gguf_path(), eos, n_ctx=2048, prompt_lookup=4)(ids, 16)
    assert looked_up and looked_up[0] == plain[0]
