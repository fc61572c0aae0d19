"""A CPU linear layer whose cost grows slowly with the number of rows, so verifying γ+1 tokens pays.

Why: with fp32 weights on CPU, `F.linear` on 1–4 rows runs as row-by-row GEMV on one thread and
streams the whole weight matrix from memory once per row; a forward of the default model then
costs 61 ms for 1 token and 121 ms for 3 (2 cores, MKL; BENCHMARKS.md, "CPU forward cost"). Read
as blocks of output rows, `[out/c, c, in]`, the same weight goes through one batched matmul that
splits the blocks over the cores and reuses each block, in cache, for every row: 40 ms for 1
token, 57 ms for 3. The reduction over `in` is the same dot product; only the BLAS kernel changes, which
moves results by float rounding (the greedy tests against `generate` cover it).

Only plain `nn.Linear` modules with fp32 CPU weights are swapped (quantized subclasses, GPUs and
bf16 keep their own kernels), and only small row counts take the blocked path: prefill and large
batches stay on one GEMM, which is already efficient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BLOCK_ROWS = (64, 32, 16)
MAX_ROWS = 16


class BlockedLinear(nn.Module):
    """`nn.Linear` computed as one batched matmul over blocks of output rows for up to MAX_ROWS rows.

    Shares the original module's parameters (tied embeddings stay tied), so the swap costs no memory.
    """

    def __init__(self, linear: nn.Linear, block: int):
        super().__init__()
        self.weight = linear.weight  # [out, in]
        self.bias = linear.bias  # [out] or None
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]."""
        rows = x.numel() // self.in_features
        if rows > MAX_ROWS or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        blocks = self.weight.view(-1, self.block, self.in_features)  # [out/c, c, in]
        y = torch.matmul(x.reshape(1, rows, self.in_features), blocks.transpose(1, 2))  # [out/c, rows, c]
        y = y.transpose(0, 1).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


def _block_for(module: nn.Module) -> int | None:
    """The block size for a plain fp32 CPU `nn.Linear` whose rows it divides; None for anything else."""
    if type(module) is not nn.Linear:
        return None
    w = module.weight
    if w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous():
        return None
    return next((c for c in BLOCK_ROWS if module.out_features % c == 0 and module.out_features > c), None)


def use_blocked_linear(model: nn.Module) -> int:
    """Swap every eligible `nn.Linear` of `model` for a BlockedLinear in place; returns how many."""
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            block = _block_for(child)
            if block is not None:
                swaps.append((parent, name, BlockedLinear(child, block)))
    for parent, name, blocked in swaps:
        setattr(parent, name, blocked)
    return len(swaps)
