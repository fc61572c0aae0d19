"""Greedy on the default model re-quantized by llama.cpp to Q4_K_M and to F16: token-identical to
HF `generate(do_sample=False)` on the weights transformers de-quantises from the same file.

The Q4_K_M file mixes Q5_0, Q8_0, Q4_K and Q6_K (the default model's widths are not multiples of
256, so most rows cannot be K-quants), within a layer's q, k and v too; the F16 file holds every
projection (and the tied embedding) as F16 values. Every linear layer must run from
its blocks (each attached only where they de-quantise to transformers' weight bit for bit), and the
native layer stack and the block kernel, forced on every forward, must give HF's tokens. As in
test_greedy_default.py, a divergence is accepted only at an fp tie of the reference.
"""
from __future__ import annotations

import logging

import pytest
import torch
from helpers import TIE_GAP, idle_core_threads, requantized_default

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.backends import blockq
from flashspec_core.backends.cpu_linear import BLOCKS, PackedLinear
from flashspec_core.backends.native_layers import NATIVE
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.loading import load_target
from flashspec_core.models import load_model, vocab_size
from flashspec_core.prompts import encode_prompt
from flashspec_core.routing.fixed import FixedRouter

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not blockq.available(), reason="no C compiler for the block kernel")]

MAX_NEW = 32
# llama.cpp file type -> GGUF types its projections must hold (at least)
FILES = {"Q4_K_M": {"q5_0", "q8_0", "q4_k", "q6_k"}, "F16": {"f16"}}
PROMPTS = [
    [{"role": "user", "content": "List the planets of the solar system in order from the sun, one per line."}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number iteratively."}],
]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with idle_core_threads() as threads:
        yield threads


@pytest.fixture(scope="module", params=list(FILES))
def ftype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def target(ftype):
    loaded = load_target(str(requantized_default(ftype)))
    if loaded.model.get_output_embeddings().weight.device.type != "cpu":
        pytest.skip("the target is on a GPU here; the block kernel is a CPU kernel")
    return loaded


@pytest.fixture(scope="module")
def prompt_ids(target) -> list[list[int]]:
    return [encode_prompt(target.tokenizer, messages, vocab_size(target.model)) for messages in PROMPTS]


@pytest.fixture(scope="module")
def references(ftype, prompt_ids) -> list[tuple[list[int], list[float]]]:
    """Per prompt: HF greedy tokens and the top-2 logit gap at each position, from a fresh copy of
    the model as transformers builds it from the file (the engine swaps its own copy's layers)."""
    stock = load_model(str(requantized_default(ftype))).model
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            inputs = torch.tensor([ids])
            out = stock.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                 max_new_tokens=MAX_NEW, output_logits=True, return_dict_in_generate=True)
            top2 = torch.stack([step[0].float().topk(2).values for step in out.logits])  # [T, 2]
            refs.append((out.sequences[0, len(ids):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return refs


def test_every_layer_runs_from_the_file_s_blocks(ftype, target, caplog):
    import gguf

    kinds = {t.tensor_type.name.lower() for t in gguf.GGUFReader(str(target.gguf)).tensors
             if t.name.startswith("blk.")} - {"f32"}
    assert FILES[ftype] <= kinds, f"llama.cpp's {ftype} mix changed: {kinds}"
    with caplog.at_level(logging.INFO, logger="flashspec_core.backends.gguf_weights"):
        engine = SpecEngine(target, [], router=FixedRouter(Arm(NO_DRAFT, 0)), backend="hf", calibrate=False)
    layers = [m for m in target.model.modules() if isinstance(m, PackedLinear)]
    assert engine.runner.block_layers == len(layers) == 7 * target.model.config.num_hidden_layers + 1
    assert {m.blocks().kind for m in layers} == kinds
    assert NATIVE in engine.runner.kernels()
    if caplog.records:  # attached here, not by an earlier test of this process: its one line says so
        assert "fp32 kernels for none" in caplog.records[-1].getMessage()


@pytest.mark.parametrize(("kind", "kernel"), [("none", NATIVE), ("prompt_lookup", NATIVE), ("none", BLOCKS)])
def test_greedy_is_token_identical_to_hf_generate(target, prompt_ids, references, kind, kernel):
    draft = PromptLookupDraft() if kind == "prompt_lookup" else None
    arm = Arm(draft.name, 4) if draft else Arm(NO_DRAFT, 0)
    engine = SpecEngine(target, [draft] if draft else [], router=FixedRouter(arm), backend="hf", calibrate=False)
    assert kernel in engine.runner.kernels()
    engine.runner.use_kernel(kernel)  # no plan: it stays on for every forward
    results = engine.generate(prompt_ids, max_new_tokens=MAX_NEW)
    for i, (result, (expected, gaps)) in enumerate(zip(results, references)):
        got = result.token_ids
        if got == expected:
            continue
        at = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        gap = gaps[at] if at < len(gaps) else float("inf")
        assert gap < TIE_GAP, (f"{kind} on {kernel}, prompt {i}: diverges from HF generate at token {at} "
                               f"(engine {got[at:at + 3]}, HF {expected[at:at + 3]}), top-2 gap {gap:.2e}")
