"""How a prompt is fed: in pieces, a budget of tokens a turn (see scheduler.py's module doc).

A GPU computes rows side by side, so every new prompt gets a piece of `prefill_chunk` tokens each
turn. A CPU's forward costs the tokens it computes: a turn feeds `prefill_chunk` tokens in all,
earliest request first, beside the decoding rows' step in one ragged pass. The budget is the
trade between a running stream's inter-token latency (a turn that feeds a piece costs the piece)
and everyone's rate (every turn costs the decoding rows' host work too, so small pieces stretch a
long prompt over many turns): BENCHMARKS.md (`concurrency.py`) measures both.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flashspec_core.backends.prefix import MIN_COPY, shares_at_least
from flashspec_core.request import Row

PREFILL_CHUNK = 512  # prompt tokens fed per turn of the loop


@dataclass(frozen=True)
class Pieces:
    """The next prompt piece of each of `rows`, as a runner's per-slot sequences and needs."""

    rows: Sequence[Row]
    sequences: list[list[int] | None]  # per slot: the prompt up to the piece's end, or None
    needs: list[int]  # per slot: 1 for a fed row (the logits after its piece), else 0
    tokens: int  # prompt tokens the pieces add

    @classmethod
    def of(cls, rows: Sequence[Row], slots: int, chunk: int | None) -> Pieces:
        """Advance each row's `prefilled` by at most `chunk` tokens (None: to the prompt's end)."""
        sequences: list[list[int] | None] = [None] * slots
        needs = [0] * slots
        tokens = 0
        for row in rows:
            start = row.prefilled
            row.prefilled = len(row.prompt) if chunk is None else min(len(row.prompt), row.prefilled + chunk)
            sequences[row.slot], needs[row.slot] = row.prompt[:row.prefilled], 1
            tokens += row.prefilled - start
        return cls(rows, sequences, needs, tokens)


def fed_rows(waiting: Sequence[Row], piece: int | None, graphs: bool) -> list[Row]:
    """The rows whose prompts get a piece this turn, of the rows `waiting` for their prompts. With
    graphs (or whole prompts) all of them; without, the budget `piece` is counted per request: a
    request's prompts are fed side by side (a batch call waits for all of them, and its rows then
    decode together), requests one after another, earliest admitted first; a row whose prompt
    shares a prefix with an earlier one's still to be fed waits for it (then copies it: the
    runner's `share_prefix`)."""
    ordered = sorted(waiting, key=lambda r: r.admitted)
    if graphs or piece is None:
        return ordered
    ordered = _not_waiting_for_a_prefix(ordered)
    requests: dict[int, list[Row]] = {}
    for row in ordered:
        requests.setdefault(id(row.request), []).append(row)
    fed: list[Row] = []
    budget = piece
    for rows in requests.values():
        left = sum(len(r.prompt) - r.prefilled for r in rows)
        if fed and left > budget:
            break
        fed += rows
        budget -= left
        if budget <= 0:
            break
    return fed


def _not_waiting_for_a_prefix(ordered: Sequence[Row]) -> list[Row]:
    """`ordered` less each row whose prompt shares at least MIN_COPY more tokens with an earlier
    row's than either has fed: that row feeds them now, and this one copies them once they are."""
    kept: list[Row] = []
    for row in ordered:
        if not any(shares_at_least(row.prompt, other.prompt, max(row.prefilled, other.prefilled) + MIN_COPY)
                   for other in kept):
            kept.append(row)
    return kept
