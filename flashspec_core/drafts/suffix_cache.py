"""A cache of earlier outputs across requests, drafting what followed the same n-gram before.

Agent loops repeat themselves: the same tool call with other arguments, the same answer frame,
the same code skeleton. Finished outputs are indexed by their n-grams (most recent wins); a new
step whose tail matches copies the stored continuation. Deterministic: q is one-hot. Memory is
bounded by `max_outputs` (oldest evicted first).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from flashspec_core.drafts.base import DraftSource
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.proposals import Generators, Proposal


class SuffixCacheDraft(DraftSource):
    """Cross-request n-gram index over finished outputs."""

    deterministic = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, max_outputs: int = 2048, name: str = "suffix_cache"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_outputs < 1:
            raise ValueError(f"max_outputs must be >= 1; got {max_outputs}")
        self.max_ngram, self.min_ngram, self.max_outputs, self.name = max_ngram, min_ngram, max_outputs, name
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output id, end position)
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, tokens: Sequence[int]) -> None:
        """Index one finished output."""
        tokens = list(tokens)
        if len(tokens) < self.min_ngram + 1:
            return
        oid = self._next_id
        self._next_id += 1
        self._outputs[oid] = tokens
        for n in range(self.min_ngram, self.max_ngram + 1):
            for end in range(n, len(tokens)):
                self._index[tuple(tokens[end - n:end])] = (oid, end)
        while len(self._outputs) > self.max_outputs:
            self._evict(*self._outputs.popitem(last=False))

    def _evict(self, oid: int, tokens: list[int]) -> None:
        for n in range(self.min_ngram, self.max_ngram + 1):
            for end in range(n, len(tokens)):
                key = tuple(tokens[end - n:end])
                if self._index.get(key, (None,))[0] == oid:
                    del self._index[key]

    def lookup(self, context: Sequence[int], gamma: int) -> list[int]:
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            hit = self._index.get(tuple(context[len(context) - n:]))
            if hit is not None:
                oid, end = hit
                return self._outputs[oid][end:end + gamma]
        return []

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        gamma: int,
        sampling: SamplingParams,
        generator: Generators = None,
    ) -> Proposal:
        return Proposal([self.lookup(c, gamma) if gamma > 0 else [] for c in contexts])

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Nothing per request: the index spans requests."""

    def end(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        for out in outputs:
            self.add(out)
