"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

Agent steps quote their inputs (RAG chunks, tool schemas, code under edit), so the continuation of
a repeated n-gram is often what comes next. The draft is deterministic: q is one-hot.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from flashspec_core.sampling import SamplingParams
from flashspec_core.types import Proposal


def lookup_continuation(context: Sequence[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to `gamma` tokens after the most recent earlier match of the longest matching tail n-gram."""
    if gamma <= 0 or len(context) < min_ngram + 1:
        return []
    arr = np.asarray(context, dtype=np.int64)
    for n in range(min(max_ngram, len(arr) - 1), min_ngram - 1, -1):
        windows = sliding_window_view(arr[:-1], n)  # windows[i] = arr[i:i+n], never the tail itself
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + gamma].tolist()
    return []


class PromptLookupDraft:
    """N-gram copy from the request's own context (prompt and output so far)."""

    deterministic = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "prompt_lookup"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        return Proposal([lookup_continuation(c, gamma, self.max_ngram, self.min_ngram) for c in contexts])

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Stateless: the context carries everything."""

    def end(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """Stateless: nothing to remember across requests."""
