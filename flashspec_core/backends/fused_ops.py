"""Triton kernels that merge the small element-wise steps of a Llama layer, for CUDA-graph replay.

`add_rms_norm` (the residual add and the next RMSNorm; `rms_norm` for the first layer),
`rope_and_cache` (the rotation of q and k, after Qwen3's per-head norms when given, the K/V cache
writes and the query layout the grouped attention call takes) and `silu_mul` (SiLU(gate) * up).
Every intermediate torch would store in the model's dtype is rounded to it here too, so a fused
forward rounds as the HF forward does, but for the summation order of the norm's mean and the libm
behind rsqrt and exp. They run on CUDA, or on the CPU under TRITON_INTERPRET=1 (set before Triton
is imported); `usable(device)` says which. Inputs need a contiguous last dimension. Why: docs/backends.md.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_ROW = 16384  # elements of one norm row held in registers at once (hidden size)


def usable(device: torch.device) -> bool:
    """Whether these kernels run for tensors on `device`: CUDA, or the CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _check_row(name: str, t: torch.Tensor, width: int) -> None:
    if t.shape[-1] != width or t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be {width} and contiguous; got shape "
                         f"{tuple(t.shape)}, strides {t.stride()} (pass .contiguous())")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused with the next RMSNorm: one read of x and delta, one kernel.

    x, delta: [..., N] in the model dtype (delta None: no add, for the first layer); weight: [N].
    Returns (x + delta rounded to x's dtype, LlamaRMSNorm(x + delta)), both [..., N]; the norm's
    dtype is torch's promotion of weight and x, as `weight * normed.to(x.dtype)` gives.
    """
    n = x.shape[-1]
    if not 0 < n <= MAX_ROW:
        raise ValueError(f"x: the last dimension must be in 1..{MAX_ROW}; got {n}")
    _check_row("x", x, n)
    _check_row("weight", weight, n)
    if delta is not None:
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(f"delta: must match x ({tuple(x.shape)} {x.dtype}); "
                             f"got {tuple(delta.shape)} {delta.dtype}")
        _check_row("delta", delta, n)
    rows_x = x.reshape(-1, n)
    rows_d = rows_x if delta is None else delta.reshape(-1, n)
    total = rows_x if delta is None else torch.empty_like(rows_x)  # unused (not written) without delta
    normed = torch.empty(rows_x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows_x.shape[0]:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(rows_x.shape[0],)](
            rows_x, rows_d, weight, total, normed, n, rows_x.stride(0), rows_d.stride(0), total.stride(0), eps,
            HAS_DELTA=delta is not None, BLOCK=block, num_warps=max(1, min(16, block // 512)))
    return (x if delta is None else total.view(x.shape)), normed.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm of x [..., N] with weight [N], in one kernel (the first layer's norm)."""
    return add_rms_norm(x, None, weight, eps)[1]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from the fused gate|up projection, one kernel instead of three.

    gate_up: [..., 2I], gate in the first half, up in the second. Returns [..., I] in its dtype,
    rounded as torch rounds `act_fn(gate) * up` (SiLU rounded to the dtype, then the product).
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: the last dimension must be 2 * intermediate; got {gate_up.shape[-1]}")
    inter = gate_up.shape[-1] // 2
    _check_row("gate_up", gate_up, 2 * inter)
    rows = gate_up.reshape(-1, 2 * inter)
    out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](rows, out, inter, rows.stride(0), BLOCK=block)
    return out.view(*gate_up.shape[:-1], inter)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, n_q: int, n_kv: int,
                   head_dim: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   norm_eps: float = 1e-6) -> torch.Tensor:
    """Rotate q and k, write k and v into the caches and lay q out for grouped attention: one kernel.

    qkv: [B, W, (n_q + 2 n_kv) * D], the fused projection (q heads, then k, then v);
    cos, sin: [B, W, D] as the model's rotary_emb returns them (HF rotate_half convention);
    k_cache, v_cache: [B_cache, n_kv, S, D]; rows, positions: [B, W] int, token (b, w) goes to
    cache[rows[b, w], :, positions[b, w]] (positions outside 0..S-1 are not written: the caller
    keeps them in range, no check can run inside a graph); q_norm, k_norm: [D] per-head RMSNorm
    weights applied before the rotation (Qwen3), or None.
    Returns q [B, n_kv, G*W, D], G = n_q // n_kv: query head h = kv*G + g at row g*W + w of kv
    head kv, so one attention call over the caches serves every query head of a group.
    """
    _check_rope(qkv, cos, sin, k_cache, v_cache, rows, positions, n_q, n_kv, head_dim)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm, k_norm: pass both per-head norm weights or neither")
    bsz, width, _ = qkv.shape
    q = torch.empty((bsz, n_q, width, head_dim), dtype=qkv.dtype, device=qkv.device)  # = [B, n_kv, G*W, D]
    if q.numel():
        _rope_cache_kernel[(bsz * width,)](
            qkv, qkv.stride(0), qkv.stride(1),
            cos, sin, cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            rows, positions, rows.stride(0), rows.stride(1), positions.stride(0), positions.stride(1),
            k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[2], q,
            qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm, norm_eps,
            width, n_q, n_kv, head_dim, HP=triton.next_power_of_2(n_q + 2 * n_kv),
            DP=triton.next_power_of_2(head_dim), HAS_NORM=q_norm is not None,
            enable_fp_fusion=False)  # no FMA: torch rounds x*cos before adding, in fp32 too
    return q.view(bsz, n_kv, (n_q // n_kv) * width, head_dim)


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, n_kv: int, d: int, dtype: torch.dtype) -> None:
    """k_cache, v_cache: [R, n_kv, S, d] of `dtype`, equal strides, contiguous last dimension (what
    a kernel indexing both with one set of strides needs); else a ValueError naming them."""
    if k_cache.dim() != 4 or (k_cache.shape[1], k_cache.shape[3]) != (n_kv, d) or k_cache.shape != v_cache.shape \
            or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.dtype != dtype:
        raise ValueError(f"k_cache, v_cache: must be [R, {n_kv}, S, {d}] {dtype} with equal strides; "
                         f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)} {k_cache.dtype}")


def _check_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, n_q: int, n_kv: int,
                d: int) -> None:
    """rope_and_cache's arguments (same shapes): a wrong shape would make the kernel read and write
    out of bounds, so it is refused here, naming the argument. qkv: [B, W, (n_q + 2 n_kv) * d];
    cos, sin: [B, W, d]; k_cache, v_cache: [B_cache, n_kv, S, d]; rows, positions: [B, W]."""
    if d % 2 or n_kv < 1 or n_q % n_kv:
        raise ValueError(f"head_dim must be even and n_q a multiple of n_kv; got {d}, {n_q}, {n_kv}")
    if qkv.dim() != 3:
        raise ValueError(f"qkv: must be [B, W, (n_q + 2 n_kv) * D]; got {tuple(qkv.shape)}")
    bsz, width, _ = qkv.shape
    _check_row("qkv", qkv, (n_q + 2 * n_kv) * d)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (bsz, width, d) or t.stride(-1) != 1 or t.dtype != qkv.dtype:
            raise ValueError(f"{name}: must be [B, W, D] = {(bsz, width, d)} {qkv.dtype}, last dim contiguous; "
                             f"got {tuple(t.shape)} {t.dtype}")
    check_caches(k_cache, v_cache, n_kv, d, qkv.dtype)
    for name, t in (("rows", rows), ("positions", positions)):
        if t.shape != (bsz, width) or t.dtype.is_floating_point:
            raise ValueError(f"{name}: must be [B, W] = {(bsz, width)} integers; got {tuple(t.shape)} {t.dtype}")
    if len({t.device for t in (qkv, cos, sin, k_cache, v_cache, rows, positions)}) != 1:
        raise ValueError("qkv, cos, sin, k_cache, v_cache, rows, positions: must all be on one device")


# ---------------------------------------------------------------------------------- kernels
# Arguments are annotated `tl.tensor` (what a non-constexpr argument is inside a kernel: a pointer
# or a scalar). Not `int` or `float`: Triton reads those annotations as fixed i32 / fp32 types and
# would stop specialising on the values.


@triton.jit
def _add_rms_norm_kernel(x_ptr: tl.tensor, d_ptr: tl.tensor, w_ptr: tl.tensor, sum_ptr: tl.tensor,
                         out_ptr: tl.tensor, N: tl.tensor, stride_x: tl.tensor, stride_d: tl.tensor,
                         stride_s: tl.tensor, eps: tl.tensor, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr) -> None:
    """One row: sum = x + d (stored in x's dtype), out = w * (sum * rsqrt(mean(sum^2) + eps)).to(dtype)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inb = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=inb, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + offs, mask=inb, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=inb)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _silu_mul_kernel(gu_ptr: tl.tensor, out_ptr: tl.tensor, INTER: tl.tensor, stride_gu: tl.tensor,
                     BLOCK: tl.constexpr) -> None:
    """One block of one row: out = (silu(gate) rounded to the dtype) * up, as torch rounds it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < INTER
    gate = tl.load(gu_ptr + row * stride_gu + offs, mask=inb, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + INTER + offs, mask=inb, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * INTER + offs, (act * up).to(gate.dtype), mask=inb)


@triton.jit
def _head_rms_norm(x: tl.tensor, xr: tl.tensor, heads: tl.tensor, cols: tl.tensor, qn_ptr: tl.tensor,
                   kn_ptr: tl.tensor, eps: tl.tensor, NQ: tl.tensor, D: tl.tensor) -> tuple[tl.tensor, tl.tensor]:
    """Qwen3's per-head RMSNorm of the [HP, DP] tile x and of its rotate-half partner tile xr.

    Query heads take q_norm's weights, the others k_norm's (v heads' results are not used).
    """
    dt = x.dtype
    a, ar = x.to(tl.float32), xr.to(tl.float32)
    inv = tl.rsqrt(tl.sum(a * a, axis=1) / D + eps)[:, None]
    partner = (cols + D // 2) % D
    is_q = heads < NQ
    inb = cols < D
    w = tl.where(is_q, tl.load(qn_ptr + cols, mask=inb, other=0.0), tl.load(kn_ptr + cols, mask=inb, other=0.0))
    wr = tl.where(is_q, tl.load(qn_ptr + partner, mask=inb, other=0.0),
                  tl.load(kn_ptr + partner, mask=inb, other=0.0))
    y = (w.to(tl.float32) * (a * inv).to(dt).to(tl.float32)).to(dt)
    yr = (wr.to(tl.float32) * (ar * inv).to(dt).to(tl.float32)).to(dt)
    return y, yr


@triton.jit
def _rope_cache_kernel(qkv_ptr: tl.tensor, stride_qkv_b: tl.tensor,
                       stride_qkv_w: tl.tensor,  # [B, W, (NQ + 2 NKV) * D]
                       cos_ptr: tl.tensor, sin_ptr: tl.tensor, stride_cb: tl.tensor, stride_cw: tl.tensor,
                       stride_sb: tl.tensor, stride_sw: tl.tensor,  # [B, W, D]
                       rows_ptr: tl.tensor, pos_ptr: tl.tensor, stride_rb: tl.tensor, stride_rw: tl.tensor,
                       stride_pb: tl.tensor, stride_pw: tl.tensor,  # [B, W] int
                       k_ptr: tl.tensor, v_ptr: tl.tensor, stride_kb: tl.tensor, stride_kh: tl.tensor,
                       stride_ks: tl.tensor, S: tl.tensor,  # [B_cache, NKV, S, D], shared strides
                       q_ptr: tl.tensor,  # [B, NQ, W, D] out, contiguous
                       qn_ptr: tl.tensor, kn_ptr: tl.tensor,  # [D] per-head norm weights, read when HAS_NORM
                       eps: tl.tensor,
                       W: tl.tensor, NQ: tl.tensor, NKV: tl.tensor, D: tl.tensor, HP: tl.constexpr, DP: tl.constexpr,
                       HAS_NORM: tl.constexpr) -> None:
    """One token (b, w): every head of its qkv row as one [HP, DP] tile, in one pass.

    rotate_half(x)[j] is -x[j + D/2] for j < D/2 and x[j - D/2] after, so each element's partner
    is loaded as a second tile; x*cos + rotate_half(x)*sin then rounds each product and the sum
    to x's dtype, as torch does op by op.
    """
    t = tl.program_id(0).to(tl.int64)  # int64 index math: no overflow, and the interpreter skips its checks
    b, w = t // W, t % W
    heads = tl.arange(0, HP)[:, None].to(tl.int64)
    cols = tl.arange(0, DP)[None, :].to(tl.int64)
    inb = (heads < NQ + 2 * NKV) & (cols < D)
    src = qkv_ptr + b * stride_qkv_b + w * stride_qkv_w + heads * D
    x = tl.load(src + cols, mask=inb, other=0.0)
    xr = tl.load(src + (cols + D // 2) % D, mask=inb, other=0.0)
    y, yr = x, xr
    if HAS_NORM:
        y, yr = _head_rms_norm(x, xr, heads, cols, qn_ptr, kn_ptr, eps, NQ, D)
    cos = tl.load(cos_ptr + b * stride_cb + w * stride_cw + cols, mask=cols < D, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + b * stride_sb + w * stride_sw + cols, mask=cols < D, other=0.0).to(tl.float32)
    sin = tl.where(cols < D // 2, -sin, sin)
    dt = x.dtype
    y = ((y.to(tl.float32) * cos).to(dt).to(tl.float32) + (yr.to(tl.float32) * sin).to(dt).to(tl.float32)).to(dt)
    is_q = heads < NQ
    tl.store(q_ptr + ((b * NQ + heads) * W + w) * D + cols, y, mask=inb & is_q)  # [B, NQ, W, D]
    row = tl.load(rows_ptr + b * stride_rb + w * stride_rw).to(tl.int64)
    pos = tl.load(pos_ptr + b * stride_pb + w * stride_pw).to(tl.int64)
    in_cache = (heads * 0 + pos >= 0) & (heads * 0 + pos < S)  # [HP, 1]: the interpreter wants tensor masks
    is_k = (heads >= NQ) & (heads < NQ + NKV) & in_cache
    is_v = (heads >= NQ + NKV) & in_cache
    kv_head = tl.where(is_k, heads - NQ, heads - NQ - NKV)
    cache = row * stride_kb + kv_head * stride_kh + pos * stride_ks + cols
    tl.store(k_ptr + cache, y, mask=inb & is_k)
    tl.store(v_ptr + cache, x, mask=inb & is_v)
