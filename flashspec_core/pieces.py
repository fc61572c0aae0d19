"""How a prompt is fed: in pieces, a budget of tokens a turn (see scheduler.py's module doc).

A GPU computes rows side by side, so every new prompt gets a piece of `prefill_chunk` tokens each
turn. A CPU's forward costs the tokens it computes: a turn feeds one budget in all, earliest
request first, and while rows decode the budget shrinks towards a few of their steps' tokens, so
a running stream's turn (its step and the piece fed beside it, one ragged pass) stays a few of
its steps long.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def piece_budget(prefill_chunk: int | None, graphs: bool, decoding: bool, step_tokens: int) -> int | None:
    """Prompt tokens a turn feeds: `prefill_chunk` (None: whole prompts), or, without graphs while
    rows decode, four times the last step's tokens (`step_tokens`) within a quarter of
    `prefill_chunk` and all of it. Why not less: every turn costs the decoding rows' host work
    too, so pieces much smaller than that stretch a long prompt over many turns and lower the
    rate of everyone (BENCHMARKS.md, `concurrency.py`)."""
    if prefill_chunk is None or graphs or not decoding:
        return prefill_chunk
    return min(prefill_chunk, max(prefill_chunk // 4, 4 * step_tokens))


def fed_rows(waiting: Sequence[Row], piece: int | None, graphs: bool) -> list[Row]:
    """The rows whose prompts get a piece this turn, of the rows `waiting` for their prompts. With
    graphs (or whole prompts) all of them; without, the budget `piece` is counted per request: a
    request's prompts are fed side by side (a batch call waits for all of them, and its rows then
    decode together), requests one after another, earliest admitted first."""
    ordered = sorted(waiting, key=lambda r: r.admitted)
    if graphs or piece is None:
        return ordered
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
