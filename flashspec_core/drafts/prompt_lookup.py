"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

Agent steps quote their inputs (RAG chunks, tool schemas, code under edit), so the continuation of
a repeated n-gram is often what comes next. The draft is deterministic: q is one-hot.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from flashspec_core.sampling import SamplingParams
from flashspec_core.types import Proposal


def lookup_continuation(context: Sequence[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to `gamma` tokens after the most recent earlier match of the longest matching tail n-gram.

    Runs on every step (and again when the router scores the draft after the fact), over contexts
    of thousands of tokens: one vectorised comparison finds where the last token occurred before,
    and only those candidates are extended backwards, instead of comparing every window.
    """
    if gamma <= 0 or len(context) < min_ngram + 1:
        return []
    arr = np.asarray(context, dtype=np.int64)
    last = len(arr) - 1
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # candidate ends of an earlier copy of the tail
    for n in range(min(max_ngram, last), min_ngram - 1, -1):
        cand = ends[ends >= n - 1]
        ok = np.ones(cand.size, dtype=bool)
        for k in range(1, n):
            ok &= arr[cand - k] == arr[last - k]
        if ok.any():
            start = int(cand[ok][-1]) + 1
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
