"""A sampled step's proposal on CUDA graphs is cut to a length some graph was warmed for.

Why: such a step replays a graph of its exact width (a padded slot would be a token to test),
captured per temperature at first use; copy drafts propose anything from 1 to γ tokens, so uncut
they would capture up to γ graphs per temperature mid-request. Exact: the cut depends on the
proposal's length only. The router scores copy drafts with the same cut.
"""
from __future__ import annotations

from collections.abc import Sequence


def cut_length(proposed: int, lengths: Sequence[int]) -> int:
    """The longest of `lengths` within `proposed` (`proposed` itself when `lengths` is empty):
    what a proposal of that length is cut to (the router scores copy drafts with the same cut)."""
    return max((n for n in lengths if n <= proposed), default=proposed)
