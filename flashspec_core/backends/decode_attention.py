"""Attention of a few new tokens per row over a static KV cache, split along the keys (Triton).

The slots are cut into splits of one size, one program per (split, row, head, block of queries)
reading only the slots its queries can see (0..p of its row for a query at p), so the work follows
each row's length inside one fixed graph; a second kernel merges the splits' partial softmax sums
(flash decoding) in the layout the output projection reads. A query's result is the same bits
whatever else the step feeds (one kernel for every shape, unseen slots add exact zeros). Rows are
read through an index (`rows`): no gather, no mask. Scores and sums in fp32, probabilities rounded
to the cache's dtype before the product with V. CUDA, or the CPU under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashspec_core.backends.fused_ops import check_caches

BLOCK_N = 64  # slots per inner iteration of a split
# Packed query rows per program, whatever the step's width: one compiled kernel, so a query's
# sums run in the same order alone or beside others (a row's output does not depend on its batch).
BLOCK_M = 64
# Slots per split, whatever the cache's size: the splits a query's slots fall into, and so the
# order its sums are merged in, do not change when the cache grows for another row.
SPLIT = 128


def splits(slots: int) -> tuple[int, int]:
    """(number of splits, slots per split) for a cache of `slots` slots per row."""
    return triton.cdiv(slots, SPLIT), SPLIT


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
           positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of new tokens over their rows' cached keys and values.

    q: [B, H_kv, G*W, D], query head h = kv*G + g at row g*W + w of kv head kv (what
    `fused_ops.rope_and_cache` returns); k_cache, v_cache: [R, H_kv, S, D]; rows: [B] int, the
    cache row of each batch row; positions: [B, W] int, query w of row b sees slots
    0..positions[b, w] of its cache row (positions must lie in 0..S-1: a graph cannot check).
    Returns [B, W, H_kv*G*D] in q's dtype (head h's D values at columns h*D..), the input of the
    output projection. Scratch: the splits' partial outputs, B*H_kv*(S/SPLIT)*G*W*D fp32 (a
    captured graph keeps it in its memory pool).
    """
    _check(q, k_cache, v_cache, rows, positions)
    bsz, n_kv, gw, d = q.shape
    width = positions.shape[1]
    n_split, size = splits(k_cache.shape[2])
    m_blocks = triton.cdiv(gw, BLOCK_M)
    part = torch.empty((bsz * n_kv, n_split, gw, d), dtype=torch.float32, device=q.device)
    stats = torch.empty((2, bsz * n_kv, n_split, gw), dtype=torch.float32, device=q.device)  # max, sum
    out = torch.empty((bsz, width, n_kv * (gw // width), d), dtype=q.dtype, device=q.device)
    if not out.numel():
        return out.view(bsz, width, -1)
    dp = max(16, triton.next_power_of_2(d))  # tl.dot takes inner dimensions of 16 or more
    # fp32 products: an fp32 model (no TF32), and the CPU interpreter, whose dot is wrong in bf16
    ieee = q.dtype == torch.float32 or q.device.type == "cpu"
    _split_kernel[(n_split, bsz * n_kv, m_blocks)](
        q, k_cache, v_cache, rows, positions, part, stats,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), rows.stride(0),
        positions.stride(0), positions.stride(1), scale,
        n_kv, gw, width, d, k_cache.shape[2], size, n_split,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DP=dp, IEEE=ieee, num_warps=4)
    _merge_kernel[(bsz * n_kv * gw,)](
        part, stats, positions, out, positions.stride(0), positions.stride(1),
        n_kv, gw, width, d, k_cache.shape[2], size, n_split, DP=dp, num_warps=1 if dp <= 64 else 2)
    return out.view(bsz, width, -1)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
           positions: torch.Tensor) -> None:
    """attend's arguments: a wrong shape would read out of bounds, so it is refused here, naming it."""
    if q.dim() != 4 or not q.is_contiguous():
        raise ValueError(f"q: must be a contiguous [B, H_kv, G*W, D]; got {tuple(q.shape)}")
    bsz, n_kv, gw, d = q.shape
    if positions.dim() != 2 or positions.shape[0] != bsz or positions.dtype.is_floating_point \
            or gw % max(1, positions.shape[1]):
        raise ValueError(f"positions: must be [B, W] integers with G*W = {gw} query rows; got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    check_caches(k_cache, v_cache, n_kv, d, q.dtype)
    if rows.shape != (bsz,) or rows.dtype.is_floating_point:
        raise ValueError(f"rows: must be [B] = [{bsz}] integers; got {tuple(rows.shape)} {rows.dtype}")
    if len({t.device for t in (q, k_cache, v_cache, rows, positions)}) != 1:
        raise ValueError("q, k_cache, v_cache, rows, positions: must all be on one device")


# Arguments are annotated `tl.tensor` (a pointer or a scalar inside a kernel), as in fused_ops.


@triton.jit(do_not_specialize=["GW", "W"])  # one compiled kernel for every step shape (see BLOCK_M)
def _split_kernel(q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor,  # q [B, NKV, GW, D]; caches [R, NKV, S, D]
                  rows_ptr: tl.tensor, pos_ptr: tl.tensor,  # [B], [B, W]
                  part_ptr: tl.tensor, stats_ptr: tl.tensor,  # [B*NKV, NS, GW, D], [2, B*NKV, NS, GW] fp32
                  stride_kr: tl.tensor, stride_kh: tl.tensor, stride_ks: tl.tensor, stride_r: tl.tensor,
                  stride_pb: tl.tensor, stride_pw: tl.tensor, scale: tl.tensor,
                  NKV: tl.tensor, GW: tl.tensor, W: tl.tensor, D: tl.tensor, S: tl.tensor, SIZE: tl.tensor,
                  NS: tl.tensor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DP: tl.constexpr,
                  IEEE: tl.constexpr) -> None:
    """One split of one (row, kv head) for one block of packed query rows: the unnormalised
    output, running max and sum over the split's visible slots (max -inf, sum 0 when none are)."""
    split = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b, kv = bh // NKV, bh % NKV
    m = tl.program_id(2).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # packed query rows
    cols = tl.arange(0, DP).to(tl.int64)
    live = m < GW
    pos = tl.load(pos_ptr + b * stride_pb + (m % W) * stride_pw, mask=live, other=0).to(tl.int64)  # [BLOCK_M]
    pos = tl.minimum(tl.maximum(pos, 0), S - 1)  # a pad's position out of range reads in range
    start = split * SIZE
    end = tl.minimum(start + SIZE, tl.max(pos, axis=0) + 1)  # past the last visible slot: nothing to read
    q = tl.load(q_ptr + (bh * GW + m[:, None]) * D + cols[None, :], mask=live[:, None] & (cols[None, :] < D),
                other=0.0)
    row = tl.load(rows_ptr + b * stride_r).to(tl.int64)
    base = row * stride_kr + kv * stride_kh
    acc = tl.zeros((BLOCK_M, DP), dtype=tl.float32)
    top = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        inb = (n[:, None] < end) & (cols[None, :] < D)
        k = tl.load(k_ptr + base + n[:, None] * stride_ks + cols[None, :], mask=inb, other=0.0)
        v = tl.load(v_ptr + base + n[:, None] * stride_ks + cols[None, :], mask=inb, other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n[None, :] <= pos[:, None], s * scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
        new_top = tl.maximum(top, tl.max(s, axis=1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # a query that sees none of these slots
        p = tl.exp(s - safe[:, None])
        alpha = tl.exp(top - safe)
        total = total * alpha + tl.sum(p, axis=1)
        if IEEE:  # p rounded to the cache's dtype as below (a no-op in fp32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                                input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        top = new_top
    at = (bh * NS + split) * GW + m  # [BLOCK_M]
    tl.store(part_ptr + at[:, None] * D + cols[None, :], acc, mask=live[:, None] & (cols[None, :] < D))
    plane = tl.num_programs(1).to(tl.int64) * NS * GW  # elements of one stats plane: B*NKV*NS*GW
    tl.store(stats_ptr + at, top, mask=live)
    tl.store(stats_ptr + plane + at, total, mask=live)


@triton.jit(do_not_specialize=["GW", "W"])
def _merge_kernel(part_ptr: tl.tensor, stats_ptr: tl.tensor, pos_ptr: tl.tensor, out_ptr: tl.tensor,
                  stride_pb: tl.tensor, stride_pw: tl.tensor,
                  NKV: tl.tensor, GW: tl.tensor, W: tl.tensor, D: tl.tensor, S: tl.tensor, SIZE: tl.tensor,
                  NS: tl.tensor, DP: tl.constexpr) -> None:
    """One packed query row: merge the splits it can see and write head h = kv*G + g of token w
    into out [B, W, NKV*G, D]."""
    t = tl.program_id(0).to(tl.int64)
    bh, m = t // GW, t % GW
    b, kv = bh // NKV, bh % NKV
    g, w = m // W, m % W
    cols = tl.arange(0, DP).to(tl.int64)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + b * stride_pb + w * stride_pw).to(tl.int64), 0), S - 1)
    plane = tl.num_programs(0).to(tl.int64) * NS  # elements of one stats plane: B*NKV*GW*NS
    top = tl.full((), float("-inf"), dtype=tl.float32)
    for split in range(0, pos // SIZE + 1):
        top = tl.maximum(top, tl.load(stats_ptr + (bh * NS + split) * GW + m))
    total = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((DP,), dtype=tl.float32)
    for split in range(0, pos // SIZE + 1):
        at = (bh * NS + split) * GW + m
        weight = tl.exp(tl.load(stats_ptr + at) - top)
        total += weight * tl.load(stats_ptr + plane + at)
        acc += weight * tl.load(part_ptr + at * D + cols, mask=cols < D, other=0.0)
    heads = NKV * (GW // W)
    dst = out_ptr + ((b * W + w) * heads + kv * (GW // W) + g) * D + cols
    tl.store(dst, (acc / total).to(out_ptr.dtype.element_ty), mask=cols < D)
