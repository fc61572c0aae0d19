"""Draft proposals: a draft source's for the step's rows (`Proposal`), one row's share of it
(`Drafted`), and the cut of a sampled step's proposal on CUDA graphs to a length some graph was
warmed for (`cut_length`).

Why the cut: such a step replays a graph of its exact width (a padded slot would be a token to test),
captured per temperature at first use; copy drafts propose anything from 1 to γ tokens, so uncut
they would capture up to γ graphs per temperature mid-request. Exact: the cut depends on the
proposal's length only. The router scores copy drafts with the same cut.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A draft's random draws: one generator per row (each row's own: its draws then do not depend on
# the rows beside it), one for every row, or None (fresh randomness).
Generators = torch.Generator | Sequence[torch.Generator] | None


@dataclass
class Proposal:
    """What a draft source offers for one step.

    tokens: one list per row, at most γ long (deterministic drafts may find nothing to copy).
    probs:  [B, k, V] the distribution q each token was drawn from (k = len of every row), or
            None for deterministic drafts, whose q is one-hot at the proposed token.
    """

    tokens: list[list[int]]
    probs: torch.Tensor | None = None
    # Seconds a model draft spent feeding context it had not seen since it last ran (the prompt,
    # or the steps other drafts took): the price of switching to it, not of its steps.
    catchup_seconds: float = 0.0


@dataclass
class Drafted:
    """One row's proposal for this step."""

    tokens: list[int]  # at most the row's γ ids
    probs: torch.Tensor | None  # [g, V] on the target's device, or None (one-hot)
    seconds: float  # the row's share of its draft call
    catchup: float  # the part of `seconds` the draft spent catching up on unseen context


def cut_length(proposed: int, lengths: Sequence[int]) -> int:
    """The longest of `lengths` within `proposed` (`proposed` itself when `lengths` is empty):
    what a proposal of that length is cut to (the router scores copy drafts with the same cut)."""
    return max((n for n in lengths if n <= proposed), default=proposed)
