"""The length of the prefix two token sequences share: how every runner and draft finds what its
cache can keep."""
from __future__ import annotations

from collections.abc import Sequence

_TAIL = 64  # positions `common_prefix` walks one by one before bisecting
MIN_COPY = 16  # tokens more than its own that make another row's cached prefix worth copying (or waiting for)


def _head(seq: list[int], n: int) -> list[int]:
    return seq if len(seq) == n else seq[:n]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix, compared in C (list equality), never element by element in
    Python over the whole context: this runs on every forward with contexts of thousands of tokens.

    Two rows differ, if at all, near their ends (a rejected draft, an agent's next turn), so one
    comparison of everything before the last _TAIL positions settles most calls, and only those
    positions are walked; a difference further back is found by bisection on slice equality.
    """
    a = a if type(a) is list else list(a)
    b = b if type(b) is list else list(b)
    n = min(len(a), len(b))
    if _head(a, n) == _head(b, n):
        return n
    hi = max(0, n - _TAIL)
    if a[:hi] == b[:hi]:
        return next(i for i in range(hi, n) if a[i] != b[i])
    lo = 0  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def longest_holder(held: Sequence[Sequence[int]], row: int, sequence: Sequence[int], own: int) -> tuple[int, int]:
    """(length, row) of the longest prefix of `sequence` that a row of `held` (each row's cached
    tokens) other than `row` holds, when it is at least MIN_COPY longer than `own` (what `row`
    holds of it); else (own, row). A row is compared in full only if it agrees with `sequence` at
    the one position a longer prefix needs: with many rows, most are ruled out by one comparison
    (they share at most a system prompt)."""
    best, source = own, row
    need = own + MIN_COPY
    for b, tokens in enumerate(held):
        if b != row and need <= min(len(tokens), len(sequence)) and tokens[need - 1] == sequence[need - 1]:
            shared = common_prefix(tokens, sequence)
            if shared >= need:
                best, source, need = shared, b, shared + 1
    return best, source
