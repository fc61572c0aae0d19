"""A Llama-family target on the CPU over a static KV cache, attending only over the live slots.

Why: transformers' `DynamicCache` appends each step's keys and values with `torch.cat`, so every
decode step copies the whole cache of every layer, a large part of a step after a long prompt.
Here the cache is `StaticLlama`'s preallocated
[B, H_kv, S, D] per layer: a step writes its keys and values in place, and attention reads the
live slice [:, :, :L] (L = 1 + the largest position fed) as a view, with no mask at all for one
token per row and SDPA's own causal mask for a prompt fed from empty. Rolling back is moving a row's length; the cache doubles when a request needs more.

The bookkeeping (rows, prefix reuse across requests, rollback, growth) is `GraphedModel`'s, run
without graphs; the forward is `StaticLlama`'s on the model's own submodules (`fuse=False`), so
the linear layers it calls are the model's, swapped for `PackedLinear` as in `hf.CachedModel`,
and the calibration picks the kernel per width the same way. Models `StaticLlama` does not
support keep `hf.CachedModel`.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from flashspec_core.backends import blockq
from flashspec_core.backends.cpu_linear import BLOCKS
from flashspec_core.backends.cuda_graph import GraphedModel
from flashspec_core.backends.hf import LinearKernels
from flashspec_core.backends.native_layers import NATIVE, NATIVE_4ROW, NativeLayers, eligible

INITIAL_LEN = 512  # slots per row at first; doubled as needed (the GPU runner starts at 2048)
CHUNK = 512  # columns per pass of a long feed after a reused prefix (see forward_to)


class StaticCachedModel(LinearKernels, GraphedModel):
    """The `TargetRunner` contract (and its `kernels()/use_kernel()/plan`) on a static cache.

    model: a Llama-family HF model on the CPU (`static_llama.supports`); its nn.Linear layers are
    swapped in place for `PackedLinear` (given the GGUF file it was loaded from, `gguf`, they get
    its blocks too: hf.LinearKernels). Memory: 2 x layers x H_kv x D x dtype bytes per slot and
    row, allocated up front for `max_len` slots (46 KB per slot for the default model: 24 MB per
    row at 512 slots, 188 MB at 4096): 512 doubled until the longest row (plus GraphedModel's 32
    scratch slots) fits, so up to twice what `DynamicCache` would hold.
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, max_len: int = INITIAL_LEN,
                 gguf: str | Path | None = None) -> None:
        if model.get_output_embeddings().weight.device.type != "cpu":
            raise ValueError("model: StaticCachedModel runs on the CPU; on CUDA use GraphedModel")
        self._swap_linears(model, gguf)
        super().__init__(model, pad_token_id, max_len=max_len, graphs=False, fuse=False)
        # every projection runs from blocks: the native layer stack may too
        self._native = NativeLayers(self.static) if self.block_layers and eligible(self.static) else None

    def kernels(self) -> tuple[str, ...]:
        """The linear kernels (`LinearKernels.kernels`), and NATIVE and NATIVE_4ROW where the whole
        layer stack can run from blocks in `decode_layers.c` (`native_layers.py`)."""
        return super().kernels() + ((NATIVE, NATIVE_4ROW) if self._native is not None else ())

    def use_kernel(self, name: str) -> None:
        """NATIVE runs the layers natively and everything else (the LM head) from blocks; NATIVE_4ROW
        the same in the block kernel's tiles of 4 rows."""
        if name in (NATIVE, NATIVE_4ROW) and self._native is not None:
            super().use_kernel(BLOCKS)
            blockq.set_tile_rows(4 if name == NATIVE_4ROW else 1)
            self.static.native = self._native
            return
        super().use_kernel(name)
        self.static.native = None

    def reset(self, batch_size: int) -> None:
        """Empty rows; a new row count also starts the cache small again (nothing is kept across
        it, and B rows at the longest length a past request needed could be gigabytes)."""
        if batch_size != self.static.batch:
            self.static.resize(min(INITIAL_LEN, self.max_slots or INITIAL_LEN), batch_size)
        self.held = [[] for _ in range(batch_size)]

    @torch.inference_mode()
    def forward_to(self, sequences: Sequence[Sequence[int]], active: Sequence[bool] | None = None,
                   keep_logits: int = 1) -> torch.Tensor:
        """Make each active row hold `sequences[b]`; return [B, keep_logits, V] logits after its last
        tokens (inactive rows: meaningless). Same contract as `CachedModel.forward_to`.

        Only the kept positions go through the LM head (over every position of a prompt, the
        default model's head would add about a quarter to its prefill).
        """
        active = [True] * len(sequences) if active is None else list(active)
        with self._lock:
            chunks = self._plan(sequences, active, keep_logits)
            out: torch.Tensor | None = None
            for lo, hi in runs(chunks, active):
                logits = self._forward_run(chunks, lo, hi, keep_logits)  # [hi - lo, keep_logits, V]
                if (lo, hi) == (0, len(chunks)):
                    out = logits
                    break
                if out is None:  # rows outside every run: meaningless
                    out = logits.new_zeros((len(chunks), keep_logits, logits.shape[-1]))
                out[lo:hi] = logits
            for b, chunk in enumerate(chunks):
                self.held[b].extend(chunk)
            assert out is not None  # runs() yields at least one run
            return out

    def _forward_run(self, chunks: Sequence[Sequence[int]], lo: int, hi: int, keep_logits: int) -> torch.Tensor:
        """Feed rows lo..hi-1 (each row's chunk, all of one length) in one forward; return their
        logits [hi - lo, keep_logits, V] after each row's last `keep_logits` tokens."""
        width = max(len(c) for c in chunks[lo:hi])
        host = self._host_inputs(chunks[lo:hi], width, first_row=lo)  # [3, hi - lo, width]: ids, positions, drafts
        start = max(len(h) for h in self.held[lo:hi])
        # From empty, one pass (SDPA's causal mask skips the blocks above the diagonal); after
        # a reused prefix, slices of CHUNK columns, so the explicit mask wastes only the
        # blocks above each slice's diagonal instead of above the whole feed's (one masked pass
        # over a long feed costs far more than slices of CHUNK columns).
        step = width if start == 0 else CHUNK
        self._use_planned_kernel(min(width, step) * (hi - lo))
        hidden = torch.cat([self.static.hidden(host[0, :, c:c + step], host[1, :, c:c + step],
                                               start + min(c + step, width),  # 1 + the largest position fed
                                               first_row=lo)
                            for c in range(0, width, step)], dim=1)  # [hi - lo, width, hidden]
        ends = torch.tensor([max(len(c), keep_logits) for c in chunks[lo:hi]])
        cols = ends[:, None] - keep_logits + torch.arange(keep_logits)  # [hi - lo, keep_logits]
        kept = hidden.gather(1, cols[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.model.lm_head(kept)


def runs(chunks: Sequence[Sequence[int]], active: Sequence[bool]) -> list[tuple[int, int]]:
    """The forwards that feed these chunks: maximal runs lo..hi-1 of adjacent active rows whose
    chunks are equally long ([(0, 1)] when no row is active).

    On a CPU a forward's cost grows with the tokens it computes, so no row is padded to a
    neighbour's width: a scheduler's rows, each at its own point of its prompt or with its own
    draft length, cost what they would alone, and adjacent rows of one width share a pass over
    the weights.
    """
    out: list[tuple[int, int]] = []
    for b, chunk in enumerate(chunks):
        if not active[b]:
            continue
        if out and out[-1][1] == b and len(chunks[out[-1][0]]) == len(chunk):
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out or [(0, 1)]
