"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

Agent steps quote their inputs (RAG chunks, tool schemas, code under edit), so the continuation of
a repeated n-gram is often what comes next. The draft is deterministic: q is one-hot.
"""
from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from flashspec_core.drafts.base import DraftSource
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.proposals import Generators, Proposal

MIRRORS = 256  # rows' mirrors kept (the least recently used dropped): a few full batches' worth


def _as_text(tokens: Sequence[int]) -> str | None:
    """The token ids as one code point each, so that `str.rfind` (C, no per-call array set-up)
    does the n-gram search; None when an id is outside [0, 0x110000), which no tokenizer has."""
    try:
        return array("I", tokens).tobytes().decode("utf-32-le", "surrogatepass")
    except (OverflowError, UnicodeDecodeError):
        return None


def _latest_match_end(text: str, max_ngram: int, min_ngram: int) -> int | None:
    """Where the most recent earlier copy of the longest matching tail n-gram of `text` ends
    (an earlier copy ends before the last token, so at least one token follows it)."""
    last = len(text) - 1
    for n in range(min(max_ngram, last), min_ngram - 1, -1):
        start = text.rfind(text[last + 1 - n:], 0, last)
        if start >= 0:
            return start + n - 1
    return None


def _continuation(text: str | None, end: int | None, gamma: int) -> list[int]:
    return [] if text is None or end is None else list(map(ord, text[end + 1:end + 1 + gamma]))


def lookup_continuation(context: Sequence[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to `gamma` tokens after the most recent earlier match of the longest matching tail
    n-gram (nothing if an id is outside [0, 0x110000))."""
    if gamma <= 0 or len(context) < min_ngram + 1:
        return []
    text = _as_text(context)
    return _continuation(text, None if text is None else _latest_match_end(text, max_ngram, min_ngram), gamma)


class _Mirror:
    """One row's context as text (`_as_text`), extended while the row grows instead of rebuilt.

    Converting costs time linear in the context, and a row is looked up twice a step
    (the engine's arm, then the router scoring the draft after the fact) while it grows by a few
    tokens. The text is reused only when a C-level list comparison proves that the new context
    is `tokens` (the context it was built from) followed by what it added: a new request, a
    rollback or an edited list rebuilds it. The match found is kept until the context changes,
    so the second lookup of a step is that comparison alone.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.text: str | None = ""  # _as_text(tokens)
        self.match: tuple[int, int, int | None] | None = None  # (max_ngram, min_ngram, end) for tokens

    def lookup(self, context: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
        """`lookup_continuation(context, gamma, max_ngram, min_ngram)`, from the mirror."""
        if gamma <= 0 or len(context) < min_ngram + 1:
            return []
        seen = len(self.tokens)
        new = context[seen:] if seen else []
        self.tokens += new  # kept if the whole context equals the result: no O(L) slice to compare
        if seen and context == self.tokens:
            if new:
                added = _as_text(new)
                self.text = None if self.text is None or added is None else self.text + added
                self.match = None
        else:
            self.tokens = list(context)
            self.text = _as_text(self.tokens)
            self.match = None
        if self.text is None:
            return []
        if self.match is None or self.match[:2] != (max_ngram, min_ngram):
            self.match = (max_ngram, min_ngram, _latest_match_end(self.text, max_ngram, min_ngram))
        return _continuation(self.text, self.match[2], gamma)


class PromptLookupDraft(DraftSource):
    """N-gram copy from the request's own context (prompt and output so far).

    Proposes exactly what `lookup_continuation` returns for each row; it keeps one `_Mirror` per
    context list (a row's own list, which the engine extends in place step by step), found by the
    list's identity, so a growing row is not converted again every step wherever it stands in the
    call: rows join, leave and change arms between steps. The mirror itself proves that the context
    extends what it holds, so a list that reuses a dead one's identity is converted afresh, never
    served a stale copy. The most recently used `MIRRORS` are kept. Rows that are not lists are
    looked up from scratch.
    """

    deterministic = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "prompt_lookup"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name
        self._mirrors: OrderedDict[int, _Mirror] = OrderedDict()  # by id() of the context list, oldest first
        self._lock = threading.Lock()  # the mirrors are shared state if one draft serves two engines

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        gamma: int,
        sampling: SamplingParams,
        generator: Generators = None,
    ) -> Proposal:
        with self._lock:
            return Proposal([
                self._mirror(c).lookup(c, gamma, self.max_ngram, self.min_ngram) if isinstance(c, list)
                else lookup_continuation(c, gamma, self.max_ngram, self.min_ngram)
                for c in contexts
            ])

    def _mirror(self, context: list[int]) -> _Mirror:
        """Under the lock: the mirror of `context`'s list, the least recently used one dropped past MIRRORS."""
        key = id(context)
        mirror = self._mirrors.get(key)
        if mirror is not None:
            self._mirrors.move_to_end(key)
            return mirror
        mirror = self._mirrors[key] = _Mirror()
        if len(self._mirrors) > MIRRORS:
            self._mirrors.popitem(last=False)
        return mirror

    def end(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """Nothing to remember across requests."""
