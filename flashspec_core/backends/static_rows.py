"""The host's record of each cache row of a static KV cache: prefix reuse, rollback, growth, and
the inputs of a forward.

A row's cache holds its tokens at positions 0..len - 1; `held[b]` is the host's copy of those
tokens. Feeding a row a sequence rolls it back to what the two share (moving its length: slots
past it are never read) and feeds the rest; the cache doubles when a row needs more slots, up to
the memory plan's bound (`limit_cache`). The last SCRATCH slots of each row are never a row's:
graphs are warmed up and captured there.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from flashspec_core.backends.prefix import common_prefix, longest_holder
from flashspec_core.backends.static_llama import StaticLlama

SCRATCH = 32  # slots at the end of every row kept for warm-up and capture (widths <= SCRATCH)


class StaticRows:
    """Rows of `static`'s cache and their host records. pad_token_id: what padded columns feed;
    pinned: build the host inputs in pinned memory (copied to a GPU without a sync); pad: the
    widest a feed is padded to past a row's end (a prefill graph's width)."""

    def __init__(self, static: StaticLlama, pad_token_id: int, pinned: bool, pad: int = 0) -> None:
        self.static = static
        self.pad_token_id = pad_token_id
        self._pinned = pinned
        self.held: list[list[int]] = [[]]
        # Seconds spent on one-time work (growing the cache; a graphed runner adds its captures).
        self.warmup_seconds = 0.0
        self.max_slots = 0  # slots a row's cache grows to at most (0: no bound); `limit_cache`
        # Slots past a row's tokens: the scratch, and a feed padded to a graph's width (a step's
        # width, at most SCRATCH, or with graphs the prefill graph's, `pad`).
        self.cache_slack = SCRATCH + max(SCRATCH, pad)

    def limit_cache(self, row_tokens: int) -> None:
        """Grow each row's cache to at most `row_tokens` + `cache_slack` slots (and cut it there now)."""
        self.max_slots = row_tokens + self.cache_slack
        if self.static.max_len > self.max_slots:
            self.static.resize(self.max_slots)
            self._drop_graphs()
            for held in self.held:
                del held[self.max_slots - SCRATCH:]

    def _drop_graphs(self) -> None:
        """The cache was reallocated: whatever captured its old tensors is stale (graphs)."""

    def begin(self, batch_size: int) -> None:
        """A single prompt keeps what the previous single prompt left (prefix reuse)."""
        if batch_size != 1 or len(self.held) != 1:
            self.reset(batch_size)

    def reset(self, batch_size: int) -> None:
        if self.static.use_rows(batch_size):  # graphs of other row counts stay: same tensors
            self._drop_graphs()
        self.held = [[] for _ in range(batch_size)]

    def resize(self, rows: int) -> None:
        """Feed `rows` rows; the first min(rows, now) keep their caches. Graphs of other row
        counts stay (same tensors) unless the cache had to be reallocated for more rows."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1; got {rows}")
        if rows == len(self.held) and rows == self.static.batch:
            return
        if self.static.use_rows(rows):
            self._drop_graphs()  # captured on the old buffers
        self.held = self.held[:rows] + [[] for _ in range(rows - len(self.held))]

    def prefix_len(self, row: int, sequence: Sequence[int]) -> int:
        return common_prefix(self.held[row], sequence)

    def share_prefix(self, row: int, sequence: Sequence[int]) -> int:
        """`TargetRunner.share_prefix`: the keys and values of the row holding the longest prefix of
        `sequence` (`prefix.longest_holder`) are copied into row `row`: the cache's bytes, what the
        row would hold had it fed those tokens itself in the other row's forwards."""
        own = self.prefix_len(row, sequence)
        best, source = longest_holder(self.held, row, sequence, own)
        if source != row:
            del self.held[row][own:]  # true even if the copy fails
            self.static.copy_prefix(source, row, best)
            self.held[row] = list(sequence[:best])
        return best

    def _ensure(self, length: int) -> None:
        """Room for rows of `length` tokens plus the scratch slots: double the cache if needed."""
        if length + SCRATCH <= self.static.max_len:
            return
        new = self.static.max_len
        while length + SCRATCH > new:
            new *= 2
        if self.max_slots:  # no further than the plan's bound, unless this feed needs more
            new = max(length + SCRATCH, min(new, self.max_slots))
        start = time.perf_counter()
        self.static.resize(new)
        self._drop_graphs()  # captured on the old buffers
        self.warmup_seconds += time.perf_counter() - start

    def _plan(self, sequences: Sequence[Sequence[int]], active: Sequence[bool],
              keep_logits: int | Sequence[int]) -> list[list[int]]:
        """Roll each active row back to what it shares with its sequence (and at least keep_logits,
        or row b's keep_logits[b], tokens before its end); return the chunks to feed."""
        chunks: list[list[int]] = []
        for b, seq in enumerate(sequences):
            if not active[b]:
                chunks.append([])
                continue
            tail = keep_logits if isinstance(keep_logits, int) else keep_logits[b]
            keep = min(common_prefix(self.held[b], seq), len(seq) - tail)
            if keep < 0:
                raise ValueError("sequences: each active row needs at least keep_logits tokens")
            del self.held[b][keep:]
            chunks.append(list(seq[keep:]))
        self._ensure(max(len(h) for h in self.held) + max(len(c) for c in chunks))
        return chunks

    def _host_inputs(self, chunks: Sequence[Sequence[int]], width: int,
                     drafts: Sequence[Sequence[int]] | None = None, first_row: int = 0) -> torch.Tensor:
        """[3, B, width] long on the host: ids, positions and draft tokens, left-aligned per row
        (chunks[b] is cache row first_row + b's).

        Columns past a row's chunk (and every column of an inactive row) feed the pad token at
        positions past the row's end, where nothing valid lives and nothing reads.
        """
        bsz = len(chunks)
        host = torch.empty((3, bsz, width), dtype=torch.long, pin_memory=self._pinned)
        host[0].copy_(padded(chunks, width, self.pad_token_id))
        host[2].copy_(padded(drafts or [()] * bsz, width, -1))  # -1: never a target token, so never accepted
        starts = torch.tensor([len(h) for h in self.held[first_row:first_row + bsz]], dtype=torch.long)
        torch.add(starts[:, None], torch.arange(width), out=host[1])
        return host


def padded(rows: Sequence[Sequence[int]], width: int, fill: int) -> torch.Tensor:
    """[len(rows), width] long on the host: each row's ids, then `fill`. One conversion of padded
    host lists, not a tensor and a copy per row: at 64 rows a step the per-row copies took longer
    on the host than the GPU's whole step."""
    lists = [[*r, *[fill] * (width - len(r))] for r in rows]
    return torch.from_numpy(np.array(lists, dtype=np.int64).reshape(len(rows), width))
