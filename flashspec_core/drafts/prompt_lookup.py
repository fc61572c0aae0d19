"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

Agent steps quote their inputs (RAG chunks, tool schemas, code under edit), so the continuation of
a repeated n-gram is often what comes next. The draft is deterministic: q is one-hot.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch

from flashspec_core.sampling import SamplingParams
from flashspec_core.types import Proposal


def _latest_match_end(arr: np.ndarray, max_ngram: int, min_ngram: int) -> int | None:
    """Where the most recent earlier copy of the longest matching tail n-gram of `arr` ends.

    One vectorised comparison finds where the last token occurred before, and only those
    candidates are extended backwards, instead of comparing every window.
    """
    last = len(arr) - 1
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # candidate ends of an earlier copy of the tail
    for n in range(min(max_ngram, last), min_ngram - 1, -1):
        cand = ends[ends >= n - 1]
        ok = np.ones(cand.size, dtype=bool)
        for k in range(1, n):
            ok &= arr[cand - k] == arr[last - k]
        if ok.any():
            return int(cand[ok][-1])
    return None


def lookup_continuation(context: Sequence[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to `gamma` tokens after the most recent earlier match of the longest matching tail n-gram."""
    if gamma <= 0 or len(context) < min_ngram + 1:
        return []
    arr = np.asarray(context, dtype=np.int64)
    end = _latest_match_end(arr, max_ngram, min_ngram)
    return [] if end is None else arr[end + 1:end + 1 + gamma].tolist()


class _Mirror:
    """An int64 copy of one row's context, extended while the row grows instead of rebuilt.

    Converting a list of Python ints costs ~30 ns a token (80 µs at 3k tokens), and a row is
    looked up twice a step (the engine's arm, then the router scoring the draft after the fact)
    while it grows by a few tokens. The copy is reused only when a C-level list comparison with
    `tokens` (the context it was built from) proves that the new context extends it: a new
    request, a rollback or an edited list rebuilds. The match found for a context is kept until
    the context changes, so the second lookup of a step is that comparison alone.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.buf = np.empty(0, dtype=np.int64)  # buf[:len(tokens)] == tokens
        self.match: tuple[int, int, int | None] | None = None  # (max_ngram, min_ngram, end) for tokens

    def sync(self, context: list[int]) -> np.ndarray:
        """`np.asarray(context, dtype=np.int64)`, from the copy where `context` extends it."""
        seen, n = len(self.tokens), len(context)
        if seen and n >= seen and (context == self.tokens if n == seen else context[:seen] == self.tokens):
            if n > seen:
                new = context[seen:]
                if n > len(self.buf):  # doubling: amortised O(new tokens) per step
                    self.buf = np.resize(self.buf, max(n, 2 * len(self.buf)))
                self.buf[seen:n] = np.asarray(new, dtype=np.int64)
                self.tokens += new
                self.match = None
        else:
            self.tokens = list(context)
            self.buf = np.asarray(self.tokens, dtype=np.int64)
            self.match = None
        return self.buf[:n]

    def lookup(self, context: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
        """`lookup_continuation(context, gamma, max_ngram, min_ngram)`, from the mirror."""
        if gamma <= 0 or len(context) < min_ngram + 1:
            return []
        arr = self.sync(context)
        if self.match is None or self.match[:2] != (max_ngram, min_ngram):
            self.match = (max_ngram, min_ngram, _latest_match_end(arr, max_ngram, min_ngram))
        end = self.match[2]
        return [] if end is None else arr[end + 1:end + 1 + gamma].tolist()


class PromptLookupDraft:
    """N-gram copy from the request's own context (prompt and output so far).

    Proposes exactly what `lookup_continuation` returns for each row; it keeps one `_Mirror` per
    row index of the latest calls so a growing row is not converted again every step. Rows that
    are not lists are looked up from scratch.
    """

    deterministic = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "prompt_lookup"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name
        self._mirrors: list[_Mirror] = []
        self._lock = threading.Lock()  # the mirrors are shared state if one draft serves two engines

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        with self._lock:
            while len(self._mirrors) < len(contexts):
                self._mirrors.append(_Mirror())
            return Proposal([
                m.lookup(c, gamma, self.max_ngram, self.min_ngram) if isinstance(c, list)
                else lookup_continuation(c, gamma, self.max_ngram, self.min_ngram)
                for m, c in zip(self._mirrors, contexts)
            ])

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Drop the mirrors of rows past this request's: the context carries everything else."""
        with self._lock:
            del self._mirrors[len(prompts):]

    def end(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """Nothing to remember across requests."""
