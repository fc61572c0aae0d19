"""A Llama-family target on the CPU over a static KV cache, attending only over the live slots.

The cache is `StaticLlama`'s preallocated [B, H_kv, S, D] per layer: a step writes its keys and
values in place, attention reads each row's live slice as a view, rolling back is moving a row's
length, and the cache doubles when a request needs more. Every forward is one ragged pass
(`ragged.py`) of the active rows' new tokens, with no padding. The row bookkeeping (prefix reuse,
rollback, growth) is `StaticRows`, shared with the CUDA-graph runner; the layers are the model's
own, its nn.Linear layers swapped for `PackedLinear` as in `hf.CachedModel`, each width's kernel
the calibration's. Models `StaticLlama` does not support keep `hf.CachedModel`. Why: docs/backends.md.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from flashspec_core.backends import blockq, ragged
from flashspec_core.backends.base import TargetRunner
from flashspec_core.backends.cpu_linear import BLOCKS
from flashspec_core.backends.hf import LinearKernels
from flashspec_core.backends.native_layers import NATIVE, NATIVE_4ROW, NativeLayers, eligible
from flashspec_core.backends.ragged import Feed
from flashspec_core.backends.static_llama import StaticLlama
from flashspec_core.backends.static_rows import StaticRows

INITIAL_LEN = 512  # slots per row at first; doubled as needed (the GPU runner starts at 2048)


class StaticCachedModel(LinearKernels, StaticRows, TargetRunner):
    """The `TargetRunner` contract (and its `kernels()/use_kernel()/plan`) on a static cache.

    model: a Llama-family HF model on the CPU (`static_llama.supports`); its nn.Linear layers are
    swapped in place for `PackedLinear` (given the GGUF file it was loaded from, `gguf`, they get
    its blocks too: hf.LinearKernels). Memory: 2 x layers x H_kv x D x dtype bytes per slot and
    row, allocated up front for `max_len` slots (46 KB per slot for the default model: 24 MB per
    row at 512 slots, 188 MB at 4096): 512 doubled until the longest row (plus StaticRows' 32
    scratch slots) fits, so up to twice what `DynamicCache` would hold.
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, max_len: int = INITIAL_LEN,
                 gguf: str | Path | None = None) -> None:
        if model.get_output_embeddings().weight.device.type != "cpu":
            raise ValueError("model: StaticCachedModel runs on the CPU; on CUDA use GraphedModel")
        self._swap_linears(model, gguf)
        self.model = model
        StaticRows.__init__(self, StaticLlama(model, max_len, batch=1), pad_token_id, pinned=False)
        self.device = self.static.device
        self._lock = threading.Lock()  # one forward at a time: rows share the cache tensors
        # every projection runs from blocks: the native layer stack may too
        self._native = NativeLayers(self.static) if self.block_layers and eligible(self.static) else None
        self.native: NativeLayers | None = None  # the layer stack runs natively (the kernel NATIVE)

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
            self.native = self._native
            return
        super().use_kernel(name)
        self.native = None

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
        tokens (inactive rows: zeros). Same contract as `CachedModel.forward_to`."""
        active = [True] * len(sequences) if active is None else list(active)
        kept = self._ragged(sequences, active, [keep_logits] * len(sequences))
        first = next(t for t in kept if t is not None)
        out = first.new_zeros((len(sequences), keep_logits, first.shape[-1]))
        for b, logits in enumerate(kept):
            if logits is not None:
                out[b] = logits
        return out

    def score_rows(self, sequences: Sequence[Sequence[int] | None], needs: Sequence[int]) -> list[torch.Tensor | None]:
        """Every row with a sequence in one forward, each feeding only its own new tokens (see
        `TargetRunner.score_rows`)."""
        active = [s is not None and n > 0 for s, n in zip(sequences, needs)]
        if not any(active):
            return [None] * len(sequences)
        return self._ragged([s or [] for s in sequences], active, needs)

    @torch.inference_mode()
    def _ragged(self, sequences: Sequence[Sequence[int]], active: Sequence[bool],
                keep: Sequence[int]) -> list[torch.Tensor | None]:
        """One ragged forward (`ragged.hidden`) of every active row's new tokens; per row its logits
        [keep[b], V] after its last keep[b] tokens (None for inactive rows). Only the kept positions
        go through the LM head (over every position of a prompt, the head would add about a quarter
        to a small model's prefill)."""
        if not any(active):
            raise ValueError("active: at least one row")
        with self._lock:
            chunks = self._plan(sequences, active, keep)
            live = [b for b, on in enumerate(active) if on]
            feed = Feed.of([chunks[b] for b in live], [len(self.held[b]) for b in live], live)
            self._use_planned_kernel(len(feed.ids))
            hidden = ragged.hidden(self.static, feed, self.native)  # [T, hidden]
            ends = feed.starts[1:].tolist()
            index = torch.cat([torch.arange(end - keep[b], end) for b, end in zip(live, ends)])
            logits = self.model.lm_head(hidden[index])  # [sum of keep, V]
            for b in live:
                self.held[b].extend(chunks[b])
            out: list[torch.Tensor | None] = [None] * len(sequences)
            for b, part in zip(live, logits.split([keep[b] for b in live])):
                out[b] = part
            return out
