"""decode_attention's split kernels attend as causal attention over each row's own cache slots.

Without CUDA they run under TRITON_INTERPRET=1 (conftest.py); tests/gpu runs them compiled inside
the fused forward. The reference is SDPA in fp64 over one row at a time with the boolean mask of
the rule "a query at position p sees slots 0..p of its row".
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashspec_core.backends.decode_attention import SPLIT, attend, splits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, else interpreted


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
               scale: float) -> torch.Tensor:
    """q: [B, H_kv, G*W, D]; k, v: [R, H_kv, S, D]; returns [B, W, H*D] as `attend` lays it out."""
    q, k, v, rows, positions = (t.cpu() for t in (q, k, v, rows, positions))
    bsz, n_kv, gw, d = q.shape
    width = positions.shape[1]
    group = gw // width
    out = torch.empty(bsz, width, n_kv * group, d, dtype=torch.float64)
    for b in range(bsz):
        # packed query row g*W + w is query head kv*G + g of token w
        qb = q[b].double().view(n_kv, group, width, d)
        seen = torch.arange(k.shape[2])[None, :] <= positions[b][:, None]  # [W, S]
        o = F.scaled_dot_product_attention(qb, k[rows[b]].double()[:, None], v[rows[b]].double()[:, None],
                                           attn_mask=seen, scale=scale)  # [H_kv, G, W, D]
        out[b] = o.permute(2, 0, 1, 3).reshape(width, n_kv * group, d)
    return out.view(bsz, width, -1)


def _case(bsz: int, n_kv: int, group: int, width: int, d: int, slots: int, cache_rows: int, dtype: torch.dtype,
          seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, n_kv, group * width, d, generator=gen).to(dtype)
    k = torch.randn(cache_rows, n_kv, slots, d, generator=gen).to(dtype)
    v = torch.randn(cache_rows, n_kv, slots, d, generator=gen).to(dtype)
    rows = torch.randperm(cache_rows, generator=gen)[:bsz]  # any cache rows, in any order
    starts = torch.randint(0, slots - width + 1, (bsz,), generator=gen)
    positions = starts[:, None] + torch.arange(width)[None]
    positions[0] = torch.arange(slots - width, slots)  # one row reaches the last slot
    return tuple(t.to(DEVICE) for t in (q, k, v, rows, positions))


@pytest.mark.parametrize(("bsz", "n_kv", "group", "width", "d", "slots", "cache_rows"), [
    (1, 3, 3, 1, 64, 512, 1),  # the default model's decode step
    (2, 3, 3, 17, 64, 700, 4),  # a draft's verify width, slots not a multiple of a split
    (3, 2, 4, 5, 32, 300, 5),
    (1, 1, 1, 3, 16, 96, 2),  # fewer slots than one split
    (2, 2, 8, 9, 48, 5000, 2),  # 40 splits; 72 query rows
])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_attend_is_causal_attention_over_each_rows_own_slots(bsz, n_kv, group, width, d, slots, cache_rows,
                                                            dtype, tol):
    q, k, v, rows, positions = _case(bsz, n_kv, group, width, d, slots, cache_rows, dtype, seed=slots)
    scale = 1 / math.sqrt(d)
    got = attend(q, k, v, rows, positions, scale)
    assert got.shape == (bsz, width, n_kv * group * d) and got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), _reference(q, k, v, rows, positions, scale), atol=tol, rtol=tol)


def test_slots_past_a_query_and_other_rows_change_nothing():
    q, k, v, rows, positions = _case(2, 2, 3, 4, 32, 400, 3, torch.float32, seed=1)
    before = attend(q, k, v, rows, positions, 0.2)
    k2, v2 = k.clone(), v.clone()
    for b in range(2):  # every slot a query of row b cannot see, and the row no query reads
        k2[rows[b], :, int(positions[b, 0]) + 1:] = 50.0
        v2[rows[b], :, int(positions[b, 0]) + 1:] = -50.0
    unread = [r for r in range(3) if r not in rows.tolist()]
    k2[unread], v2[unread] = 1e4, 1e4
    after = attend(q, k2, v2, rows, positions, 0.2)
    # tokens of a row see one more slot each: only the first token's view was left untouched
    torch.testing.assert_close(after[:, 0], before[:, 0], atol=0, rtol=0)
    assert not torch.equal(after[:, 1:], before[:, 1:]), "later tokens see the slots changed before them"


@pytest.fixture
def row_local_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the CPU interpreter, `tl.dot` with each output element summed over k in one fixed
    order, a function of its own row and column alone.

    The interpreter's dot is numpy's matmul, whose BLAS may sum an element's products in an order
    that depends on the element's place in the tile (OpenBLAS's Haswell kernels do: a query at
    packed row 1 and the same query at row 22 of a 64-row tile differ in their last bits). A
    compiled kernel on the GPU runs one instruction sequence for every row of a tile, so there the
    real dot keeps a query's bits; on the CPU the row-local dot tests everything else that must
    (the splits a query reads, its loop bounds, the exact zeros of slots it cannot see, the merge
    order), on every CPU alike."""
    if DEVICE == "cuda":
        return
    import numpy as np
    from triton.runtime import interpreter

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # the builder's signature
        acc_type = d.data.dtype
        products = a.data.astype(acc_type)[:, :, None] * b.data.astype(acc_type)[None, :, :]  # [M, K, N]
        return interpreter.TensorHandle(np.add.reduce(products, axis=1) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_querys_result_is_the_same_bits_alone_and_beside_others(dtype, row_local_dot):
    """One query alone (batch 1, width 1), the same query as token 5 of row 1 in a batch of 3 rows
    17 wide, and alone again after the cache grew: what a scheduler's steps may feed it. Its
    output must not move by one bit, or a row's greedy tokens would depend on its neighbours
    (on the CPU with the row-local dot of `row_local_dot`: what the kernel itself guarantees)."""
    gen = torch.Generator().manual_seed(4)
    n_kv, group, d, slots = 3, 3, 64, 700
    k = torch.randn(4, n_kv, slots, d, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(4, n_kv, slots, d, generator=gen).to(dtype).to(DEVICE)
    one = torch.randn(n_kv, group, d, generator=gen).to(dtype).to(DEVICE)  # the query's heads
    alone = attend(one.reshape(1, n_kv, group, d).contiguous(), k, v, torch.tensor([2], device=DEVICE),
                   torch.tensor([[411]], device=DEVICE), 0.125)
    width = 17
    q = torch.randn(3, n_kv, group, width, d, generator=gen).to(dtype).to(DEVICE)
    q[1, :, :, 5] = one
    positions = torch.randint(0, slots, (3, width), generator=gen).to(DEVICE)
    positions[1] = torch.arange(406, 406 + width, device=DEVICE)  # token 5 at 411
    beside = attend(q.reshape(3, n_kv, group * width, d), k, v, torch.tensor([0, 2, 3], device=DEVICE),
                    positions, 0.125)
    assert torch.equal(beside[1, 5], alone[0, 0])
    more = (4, n_kv, 4300, d)  # the cache grown to 5,000 slots for another row's sake: more splits
    grown_k, grown_v = (torch.cat([t, torch.randn(more, generator=gen).to(dtype).to(DEVICE)], dim=2)
                        for t in (k, v))
    again = attend(one.reshape(1, n_kv, group, d).contiguous(), grown_k, grown_v, torch.tensor([2], device=DEVICE),
                   torch.tensor([[411]], device=DEVICE), 0.125)
    assert torch.equal(again, alone)


def test_positions_past_the_cache_read_inside_it():
    q, k, v, rows, positions = _case(1, 1, 2, 2, 16, 128, 1, torch.float32, seed=2)
    # a pad's position past the end: clamped, never out of bounds
    positions[0] = torch.tensor([127, 400], device=DEVICE)
    out = attend(q, k, v, rows, positions, 0.25)
    assert torch.isfinite(out).all()
    want = _reference(q, k, v, rows, torch.tensor([[127, 127]]), 0.25)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("slots", [1, 64, 127, 128, 129, 2048, 4096, 32768, 100_000])
def test_splits_cover_every_slot_in_whole_blocks(slots):
    n, size = splits(slots)
    assert size == SPLIT and size % 64 == 0
    assert (n - 1) * size < slots <= n * size, "every slot in exactly one split, no empty split"


def test_bad_arguments_are_refused_naming_them():
    q, k, v, rows, positions = _case(2, 2, 2, 3, 16, 64, 2, torch.float32, seed=3)
    with pytest.raises(ValueError, match="positions"):
        attend(q, k, v, rows, torch.cat([positions, positions[:, :1]], 1), 0.25)
    with pytest.raises(ValueError, match="k_cache, v_cache"):
        attend(q, k[:, :1], v[:, :1], rows, positions, 0.25)
    with pytest.raises(ValueError, match="rows"):
        attend(q, k, v, rows[:1], positions, 0.25)
    with pytest.raises(ValueError, match="q: must be"):
        attend(q.transpose(2, 3), k, v, rows, positions, 0.25)
