"""A causal LM with its KV cache, kept in step with per-row token sequences.

The engine and model drafts say which tokens each row should hold (`forward_to`); this class
works out what the cache already holds, rolls back what was rejected and feeds the rest. Rows of
a batch advance by different amounts, so a rejected slot in one row may sit below a slot another
row still needs: such slots are masked out (attention mask 0) instead of cropped, and positions
come from the count of valid slots, so each row sees exactly its own sequence. The cache itself is
transformers' `DynamicCache`; only its tail, past every row's last valid slot, is cropped.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from flashspec_core.backends import blockq
from flashspec_core.backends.base import TargetRunner
from flashspec_core.backends.cpu_linear import BLOCKS, PACKED, STOCK, PackedLinear, use_packed_linear
from flashspec_core.backends.prefix import common_prefix

if TYPE_CHECKING:
    from flashspec_core.backends.calibration import Calibration


class LinearKernels:
    """The calibration contract (`backends/calibration.py`) of a runner over an HF model on the CPU.

    The model's fp32 linear layers are swapped in place for `PackedLinear`, whose cost barely
    grows with the number of tokens fed on some CPUs (see backends/cpu_linear.py); for a model loaded from
    a GGUF file they also get the file's blocks (`backends/gguf_weights.py`), read by a kernel
    that moves 4-5x fewer bytes a token. Which kernel runs a forward of a given width is `plan`'s
    choice (a `backends.calibration.Calibration` measured on this machine); without a plan the
    packed kernel runs.
    """

    plan: Calibration | None = None  # width -> kernel, measured on this machine

    def _swap_linears(self, model: nn.Module, gguf: str | Path | None = None) -> None:
        self._choice = use_packed_linear(model)
        self.plan = None  # a Calibration: width -> kernel
        self.block_layers = 0  # layers computing from GGUF blocks under the BLOCKS kernel
        if self._choice is None:
            return
        if gguf is not None and blockq.available():
            from flashspec_core.backends import gguf_weights

            gguf_weights.attach(model, gguf)
        # attached now or before (by another runner on this model, or by hand)
        held = sum(1 for m in model.modules() if isinstance(m, PackedLinear) and m.blocks() is not None)
        self.block_layers = held if held and blockq.available() else 0

    def kernels(self) -> tuple[str, ...]:
        """The linear kernels this model can switch between (calibration.py times them)."""
        if self._choice is None:
            return (STOCK,)
        return (STOCK, PACKED, BLOCKS) if self.block_layers else (STOCK, PACKED)

    def use_kernel(self, name: str) -> None:
        if name not in self.kernels():
            raise ValueError(f"kernel must be one of {self.kernels()}; got {name!r}")
        if self._choice is not None:
            self._choice.name = name
        if name == BLOCKS:
            blockq.set_tile_rows(1)

    def _use_planned_kernel(self, tokens: int) -> None:
        """Switch to the kernel `plan` keeps for a forward of `tokens` tokens (rows x width)."""
        if self.plan is not None:
            self.use_kernel(self.plan.kernel_for(tokens))


class CachedModel(LinearKernels, TargetRunner):
    """One HF causal LM plus the cache and slot mask of a batch of rows (any architecture; for
    Llama-family models on the CPU, `backends/cpu_static.py` runs a static cache instead)."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, gguf: str | Path | None = None) -> None:
        self._swap_linears(model, gguf)
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = model.get_output_embeddings().weight.device
        # transformers renamed `past_key_values` to `cache` (5.2x); accept either release.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.reset(1)

    def begin(self, batch_size: int) -> None:
        """Start a request. A single prompt keeps what the previous single-prompt request left,
        so `forward_to` reuses their common prefix (an agent's steps resend the same system
        prompt, tools and document; the kept keys and values are those of the same tokens at the
        same positions); a batch, or a single prompt after a batch, starts afresh."""
        if batch_size != 1 or len(self.held) != 1:
            self.reset(batch_size)

    def reset(self, batch_size: int) -> None:
        self.cache = DynamicCache()
        self.held: list[list[int]] = [[] for _ in range(batch_size)]
        self.slot_mask = torch.zeros((batch_size, 0), dtype=torch.long, device=self.device)  # [B, S]

    def resize(self, rows: int) -> None:
        """Hold `rows` rows; the first min(rows, now) keep their caches, added rows start empty
        (their cache columns copy row 0's and are masked out)."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1; got {rows}")
        old = len(self.held)
        if rows == old:
            return
        if self.cache.get_seq_length() == 0:
            self.reset(rows)
            return
        keep = torch.tensor(list(range(min(rows, old))) + [0] * max(0, rows - old), device=self.device)
        self.cache.reorder_cache(keep)  # type: ignore[arg-type]  # a long tensor: what LongTensor means
        grown = self.slot_mask.new_zeros((max(0, rows - old), self.slot_mask.shape[1]))
        self.slot_mask = torch.cat([self.slot_mask[:rows], grown])
        self.held = self.held[:rows] + [[] for _ in range(rows - old)]

    def _rollback(self, keep: list[int]) -> None:
        """Keep the first keep[b] valid slots of each row; mask the rest, crop the common tail."""
        ends = []
        for b, k in enumerate(keep):
            valid = self.slot_mask[b].nonzero().squeeze(-1)
            if k < len(valid):
                self.slot_mask[b, valid[k:]] = 0
            ends.append(int(valid[k - 1]) + 1 if k > 0 else 0)
            del self.held[b][k:]
        new_len = max(ends)
        drop = self.slot_mask.shape[1] - new_len
        if drop > 0:
            self.cache.crop(-drop)
            self.slot_mask = self.slot_mask[:, :new_len]

    def prefix_len(self, row: int, sequence: Sequence[int]) -> int:
        """How many leading tokens of `sequence` row `row` already holds (reusable as they are)."""
        return common_prefix(self.held[row], sequence)

    @torch.inference_mode()
    def forward_to(
        self, sequences: Sequence[Sequence[int]], active: Sequence[bool] | None = None, keep_logits: int = 1
    ) -> torch.Tensor:
        """Make each active row hold `sequences[b]` and return the logits of its last positions.

        Returns [B, keep_logits, V]: the logits after each of the last `keep_logits` tokens of each
        active row (rows are right-aligned, so index -1 is every row's last token). Each active row
        must feed at least `keep_logits` tokens; a row already holding its whole sequence re-feeds
        its tail. Inactive rows feed nothing and their logits are meaningless.
        """
        bsz = len(sequences)
        active = [True] * bsz if active is None else list(active)
        keep = []
        for b, seq in enumerate(sequences):
            if not active[b]:
                keep.append(len(self.held[b]))
                continue
            lcp = common_prefix(self.held[b], seq)
            keep.append(min(lcp, len(seq) - keep_logits))
        if any(k < 0 for k in keep):
            raise ValueError("sequences: each active row needs at least keep_logits tokens")
        self._rollback(keep)

        chunks = [list(seq[keep[b]:]) if active[b] else [] for b, seq in enumerate(sequences)]
        width = max(len(c) for c in chunks)
        ids = torch.full((bsz, width), self.pad_token_id, dtype=torch.long)
        chunk_mask = torch.zeros((bsz, width), dtype=torch.long)
        positions = torch.zeros((bsz, width), dtype=torch.long)
        for b, chunk in enumerate(chunks):
            if chunk:
                ids[b, width - len(chunk):] = torch.tensor(chunk)
                chunk_mask[b, width - len(chunk):] = 1
                positions[b, width - len(chunk):] = torch.arange(keep[b], keep[b] + len(chunk))
        ids, chunk_mask, positions = (t.to(self.device) for t in (ids, chunk_mask, positions))
        attention = torch.cat([self.slot_mask, chunk_mask], dim=1)
        self._use_planned_kernel(width * max(1, sum(active)))
        out = self.model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep_logits,
            **{self._cache_kwarg: self.cache},
        )
        self.slot_mask = attention
        for b, chunk in enumerate(chunks):
            self.held[b].extend(chunk)
        return out.logits
