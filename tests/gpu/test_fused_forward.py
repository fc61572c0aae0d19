"""The fused forward on CUDA (fused_ops' Triton kernels, replayed from graphs) computes what the
transformers-ops forward computes, and a fused layer costs about ten kernels.

Tiny random models in fp32 for tight comparisons and in bf16, where the kernels round as
transformers does and what remains is the norms' and attention's summation order. The kernels
themselves are compared element for element with transformers' modules in
tests/core/backends/test_fused_ops.py, which runs them compiled here.
"""
from __future__ import annotations

import random

import pytest
import torch
from helpers import tiny_llama
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashspec_core.backends.cuda_graph import GraphedModel
from flashspec_core.backends.static_llama import StaticLlama

pytestmark = pytest.mark.gpu
VOCAB = 32


def _model(family: str, dtype: torch.dtype, layers: int = 2):
    if family == "llama":
        model = tiny_llama(VOCAB, seed=3, layers=layers, hidden=64, max_positions=1024)
    else:  # Qwen3: per-head q/k norms inside the rotation kernel
        config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=1024, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).eval()
    return model.to("cuda", dtype)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
# bf16: the two forwards multiply in different GEMMs (q|k|v in one) and attend in different
# layouts, so logits of magnitude ~10 differ by a few bf16 ulps; a wrong layout, sign or norm
# moves them by units. Element-wise rounding is checked exactly in test_fused_ops.py.
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.25)])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_graphs_match_the_transformers_ops_forward(family, dtype, tol, rows):
    model = _model(family, dtype)
    fused = GraphedModel(model, pad_token_id=0, max_len=64)
    plain = GraphedModel(model, pad_token_id=0, max_len=64, graphs=False, fuse=False)
    assert fused.static.ops is not None, "on CUDA the fused path runs the Triton kernels"
    rng = random.Random(rows)
    seqs = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(rows)]
    for runner in (fused, plain):
        runner.reset(rows)
    for _ in range(30):
        keep = rng.choice([1, 3, 5])
        seqs = [s[:max(1, len(s) - rng.randint(0, 3))] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
                for s in seqs]
        seqs = [s + [1] * max(0, keep - len(s)) for s in seqs]
        if all(len(s) > keep for s in seqs):  # the decode shape, so that graphs replay
            for runner in (fused, plain):
                runner.forward_to([s[:-keep] for s in seqs], keep_logits=1)
        got, want = (runner.forward_to(seqs, keep_logits=keep).float() for runner in (fused, plain))
        torch.testing.assert_close(got, want, atol=tol, rtol=0.02 if dtype == torch.bfloat16 else tol)
    assert fused.captures > 0 and fused.static.max_len > 64, "graphs replayed and the cache grew"


def _cuda_kernels(static: StaticLlama, width: int) -> int:
    """CUDA kernels (and copies) one eager forward over `width` tokens launches."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.ones((1, width), dtype=torch.long, device="cuda")
    positions = torch.arange(width, device="cuda")[None]
    with torch.inference_mode():
        static(ids, positions)  # compile the kernels and pick cuBLAS algorithms first
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            static(ids, positions)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.parametrize("width", [1, 5])
def test_a_fused_layer_is_about_ten_kernels(width):
    counts = {n: _cuda_kernels(StaticLlama(_model("llama", torch.bfloat16, n), 64, fuse=True), width) for n in (2, 4)}
    per_layer = (counts[4] - counts[2]) / 2
    # norm+add, qkv, rope+cache, attention, o_proj, norm+add, gate|up, silu*up, down; +1 copy at width > 1
    assert per_layer <= 11, f"{per_layer} kernels per layer (forward with 2 / 4 layers: {counts})"
