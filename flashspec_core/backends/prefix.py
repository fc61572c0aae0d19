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


def shares_at_least(a: Sequence[int], b: Sequence[int], n: int) -> bool:
    """Whether `a` and `b` share a prefix of at least `n` tokens; most pairs that do not are ruled
    out by one comparison (at position n - 1) before `common_prefix` walks them."""
    return n <= min(len(a), len(b)) and a[n - 1] == b[n - 1] and common_prefix(a, b) >= n


def longest_holder(held: Sequence[Sequence[int]], row: int, sequence: Sequence[int], own: int) -> tuple[int, int]:
    """(length, row) of the longest prefix of `sequence` that a row of `held` (each row's cached
    tokens) other than `row` holds, when it is at least MIN_COPY longer than `own` (what `row`
    holds of it); else (own, row). With many rows, most are ruled out by one comparison
    (`shares_at_least`: they share at most a system prompt)."""
    best, source = own, row
    for b, tokens in enumerate(held):
        if b != row and shares_at_least(tokens, sequence, best + MIN_COPY if source == row else best + 1):
            best, source = common_prefix(tokens, sequence), b
    return best, source
