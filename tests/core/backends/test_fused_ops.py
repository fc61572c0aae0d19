"""The fused Triton ops compute what transformers' own modules compute, and write every output.

References are transformers' code itself (LlamaRMSNorm, Qwen3RMSNorm, the rotary embedding and
`apply_rotary_pos_emb`, ACT2FN["silu"]) and the cache assignment static_llama's torch path does.
Without CUDA the kernels run under TRITON_INTERPRET=1 (conftest.py), so sizes are small but odd
on purpose: rows not a power of two (576, 40), half head dims that leave a masked tail (D = 12),
G = 3 query heads per kv head, widths 1..9, batches 1..3 written to permuted cache rows.
fp16 runs too: the interpreter rounds it as CUDA does, so there every rounding is checked exactly.
Every output comes from a poisoned allocator (NaN), and caches start as NaN, so an element a
kernel skips, or a slot it writes that it should not, shows up as a mismatch.
"""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from flashspec_core.backends import fused_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EXACT = dict(rtol=0, atol=0, equal_nan=True)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like return NaN-filled tensors (their contents are undefined anyway)."""
    def poison(make):
        def wrapped(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)
        return wrapped

    monkeypatch.setattr(torch, "empty", poison(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poison(torch.empty_like))


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def assert_like(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """got == want bit for bit where the arithmetic is torch's (`exact`), else nearly.

    Not exact: fp32 statistics and libm (the norms' mean and rsqrt, SiLU's exp) differ from
    torch's in the last fp32 ulp, which flips a 16-bit rounding only where the value straddles a
    boundary, so at least 99 % of 16-bit elements must still be bit-identical (an intermediate
    left unrounded breaks ~25 %). Triton's interpreter casts fp32 to bf16 by truncation (CUDA
    rounds to nearest even, as torch does), so on the CPU a bf16 output may be off by one rounding
    of each term it sums: up to 2^-6 of a term of magnitude ~4, even where the terms cancel. Its
    fp16 casts round to nearest even: fp16 checks every rounding on the CPU.
    """
    dtype = got.dtype
    rounds_as_torch = dtype == torch.float16 or (dtype == torch.bfloat16 and DEVICE == "cuda")
    if exact and (rounds_as_torch or dtype == torch.float32):
        torch.testing.assert_close(got, want, **EXACT)
        return
    bf16_atol = 1e-5 if rounds_as_torch else 6e-2
    # fp16: a libm ulp may flip one rounding inside (SiLU's) and the product rounds again: 2 ulps
    rtol, atol = {torch.float32: (2e-6, 1e-6), torch.float16: (2e-3, 1e-5)}.get(dtype, (1.6e-2, bf16_atol))
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if rounds_as_torch:
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.float().mean() >= 0.99, f"only {same.float().mean():.1%} bit-identical"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "scale"), [((1, 1, 576), 3.0), ((3, 7, 40), 3e-3), ((2, 5, 576), 1.0),
                                             ((1, 2, 8192), 1.0)])  # at 3e-3, eps is a third of the mean square
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_the_residual_add_then_llama_rms_norm(shape, scale, dtype, with_delta, poisoned):
    x = _randn(*shape, dtype=dtype, seed=1) * scale
    delta = _randn(*shape, dtype=dtype, seed=2) * scale if with_delta else None
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(_randn(shape[-1], dtype=torch.float32, seed=3))
    norm = norm.to(dtype)
    total, normed = fused_ops.add_rms_norm(x, delta, norm.weight, 1e-5)
    want = x + delta if with_delta else x
    assert_like(total, want, exact=True)  # one rounding, as torch's add
    with torch.no_grad():
        assert_like(normed, norm(want), exact=False)
    if not with_delta:
        torch.testing.assert_close(fused_ops.rms_norm(x, norm.weight, 1e-5), normed, **EXACT)


def _rope_case(bsz: int, width: int, n_kv: int, group: int, d: int, dtype: torch.dtype, seed: int,
               qk_norm: bool) -> tuple[tuple, dict, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """rope_and_cache's arguments as static_llama passes them (caches NaN, rows permuted, distinct
    positions per row), its norm keywords, and the references: q [B, n_kv, G*W, D] and the caches
    [B + 1, n_kv, 16, D] after transformers' norm and rotation and the torch path's assignment."""
    rng = random.Random(seed)
    n_q, slots, cache_rows = n_kv * group, 16, bsz + 1
    qkv = _randn(bsz, width, (n_q + 2 * n_kv) * d, dtype=dtype, seed=seed)
    positions = torch.tensor([rng.sample(range(slots), width) for _ in range(bsz)], device=DEVICE)
    rows = torch.tensor(rng.sample(range(cache_rows), bsz), device=DEVICE)[:, None].expand(bsz, width)
    config = LlamaConfig(hidden_size=n_q * d, num_attention_heads=n_q, num_key_value_heads=n_kv, head_dim=d,
                         rope_theta=500.0, max_position_embeddings=slots)
    cos, sin = LlamaRotaryEmbedding(config).to(DEVICE)(qkv, positions)  # [B, W, D] in qkv's dtype
    norms = None
    q, k, v = qkv.view(bsz, width, n_q + 2 * n_kv, d).split([n_q, n_kv, n_kv], dim=2)
    if qk_norm:
        norms = [Qwen3RMSNorm(d, eps=1e-6).to(DEVICE) for _ in range(2)]
        with torch.no_grad():
            for i, n in enumerate(norms):
                n.weight.copy_(_randn(d, dtype=torch.float32, seed=seed + 10 + i))
        norms = [n.to(dtype) for n in norms]
        q, k = norms[0](q), norms[1](k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, W, D]
    k_ref = torch.full((cache_rows, n_kv, slots, d), float("nan"), dtype=dtype, device=DEVICE)
    v_ref = k_ref.clone()
    k_ref[rows, :, positions] = k.transpose(1, 2)
    v_ref[rows, :, positions] = v
    args = (qkv, cos, sin, torch.full_like(k_ref, float("nan")), torch.full_like(v_ref, float("nan")), rows,
            positions, n_q, n_kv, d)
    weights = {} if norms is None else {"q_norm": norms[0].weight, "k_norm": norms[1].weight, "norm_eps": 1e-6}
    return args, weights, (q.reshape(bsz, n_kv, group * width, d), k_ref, v_ref)


CASES = [  # B, W, n_kv, G, D
    (1, 1, 3, 3, 64), (2, 5, 3, 3, 64), (3, 9, 1, 3, 12), (1, 4, 2, 1, 8), (3, 2, 2, 3, 8), (2, 7, 3, 3, 12),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_rotates_writes_and_packs_as_transformers(case, dtype, qk_norm, poisoned):
    bsz, width, n_kv, group, d = case
    args, weights, (q_ref, k_ref, v_ref) = _rope_case(bsz, width, n_kv, group, d, dtype, sum(case), qk_norm)
    q = fused_ops.rope_and_cache(*args, **weights)
    k_cache, v_cache = args[3], args[4]
    # Each product and the sum round to the dtype as in transformers: without the norm, bit-identical.
    assert_like(q, q_ref, exact=not qk_norm)
    assert_like(k_cache, k_ref, exact=not qk_norm)  # NaN where nothing may be written
    torch.testing.assert_close(v_cache, v_ref, **EXACT)  # v is copied, untouched slots stay NaN


def test_rope_and_cache_skips_positions_outside_the_cache(poisoned):
    args, _, (_, k_ref, v_ref) = _rope_case(2, 3, 1, 3, 8, torch.float32, 0, False)
    positions = args[6].clone()
    positions[1, 2] = k_ref.shape[2]  # one past the end: not written anywhere
    fused_ops.rope_and_cache(*args[:6], positions, *args[7:])
    row = int(args[5][1, 2])
    k_ref[row, :, int(args[6][1, 2])] = float("nan")
    v_ref[row, :, int(args[6][1, 2])] = float("nan")
    torch.testing.assert_close(args[3], k_ref, **EXACT)
    torch.testing.assert_close(args[4], v_ref, **EXACT)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (3, 7, 2 * 40), (2, 9, 2 * 7), (5, 2 * 1100)])
def test_silu_mul_is_act_fn_of_gate_times_up(shape, dtype, poisoned):
    gate_up = _randn(*shape, dtype=dtype, seed=shape[-1]) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    want = ACT2FN["silu"](gate) * up
    assert_like(fused_ops.silu_mul(gate_up), want, exact=False)


def test_bad_shapes_are_refused_naming_the_argument():
    args, _, _ = _rope_case(1, 2, 1, 3, 8, torch.float32, 0, False)
    with pytest.raises(ValueError, match="qkv"):
        fused_ops.rope_and_cache(args[0][..., :-1], *args[1:])
    with pytest.raises(ValueError, match="cos"):
        fused_ops.rope_and_cache(args[0], args[1][..., :4], *args[2:])
    with pytest.raises(ValueError, match="k_cache"):
        fused_ops.rope_and_cache(*args[:3], args[3][:, :, :, :4], *args[4:])
    x = torch.zeros(2, 6, device=DEVICE)
    with pytest.raises(ValueError, match="delta"):
        fused_ops.add_rms_norm(x, torch.zeros(2, 5, device=DEVICE), torch.ones(6, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="gate_up"):
        fused_ops.silu_mul(torch.zeros(3, 5, device=DEVICE))
