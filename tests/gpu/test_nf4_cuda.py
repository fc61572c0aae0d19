"""NF4 (bitsandbytes 4-bit) on CUDA, as the target and as the `nf4` draft, through CUDA graphs.

The static forward calls the 4-bit model's own `Linear4bit` modules (unfused), so a graph replays
bitsandbytes' kernels. Greedy in fp32 compute must equal HF `generate(do_sample=False)` on the
same model: the NF4 model's own generate when NF4 is the target, the full-precision target's when
NF4 only drafts (the draft cannot change the output, whatever it proposes). Divergence is allowed
only where the reference's top-2 gap is an fp tie (test_gpu_default.py's rule).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import TIE_GAP, greedy_references

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.engine import SpecEngine
from flashspec_core.models import load_model, vocab_size
from flashspec_core.prompts import encode_prompt
from flashspec_core.routing.fixed import FixedRouter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes"),
]
MAX_NEW = 64


def _check(engine, prompts, refs, label):
    for i, (ids, (expected, gaps)) in enumerate(zip(prompts, refs)):
        got = engine.generate(ids, max_new_tokens=MAX_NEW).token_ids
        if got == expected:
            continue
        at = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        gap = gaps[at] if at < len(gaps) else float("inf")
        assert gap < TIE_GAP, f"{label}, prompt {i}: diverges at token {at} where the top-2 gap is {gap:.2e}"


@pytest.fixture(scope="module")
def nf4():
    return load_model(None, device="cuda", dtype=torch.float32, load_in_4bit=True)


@pytest.fixture(scope="module")
def prompts(nf4):
    from default_prompts import PROMPTS

    vocab = vocab_size(nf4.model)
    return [encode_prompt(nf4.tokenizer, m, vocab) for m in list(PROMPTS.values())[:5]]


@pytest.mark.parametrize("arm", [Arm(NO_DRAFT, 0), Arm("prompt_lookup", 4)])
def test_nf4_target_on_graphs_equals_its_own_generate(nf4, prompts, arm):
    from flashspec_core.drafts import PromptLookupDraft

    assert nf4.model.get_output_embeddings().weight.device.type == "cuda"
    engine = SpecEngine(nf4, [PromptLookupDraft()], router=FixedRouter(arm))
    assert engine.backend == "cuda-graph" and engine.runner.captures > 0
    _check(engine, prompts, greedy_references(nf4.model, prompts, MAX_NEW), f"nf4 target, {arm}")


def test_nf4_draft_keeps_the_full_precision_targets_output(nf4, prompts):
    engine = SpecEngine.from_pretrained(None, drafts=["nf4"], router=FixedRouter(Arm("nf4", 3)), device="cuda",
                                        dtype=torch.float32)
    res_accepted = 0
    target = engine.target_model
    refs = greedy_references(target, prompts, MAX_NEW)
    _check(engine, prompts, refs, "nf4 draft")
    for ids in prompts[:2]:
        res_accepted += engine.generate(ids, max_new_tokens=32).stats.accepted
    assert res_accepted > 0, "the NF4 copy of the target should agree with it most of the time"
