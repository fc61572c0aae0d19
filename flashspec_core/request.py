"""One request's decode state: its rows, its settings, and what the processors read along the way.

The engine builds one `RequestState` per `generate` or `stream` call and hands it to every step,
so a step's inputs are named in one place and nothing is kept between steps elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashspec_core.constrained.constraint import Constraint
from flashspec_core.processors.paths import PathProcessors
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.results import GenerationStats
from flashspec_core.stopping import RowOutput
from flashspec_core.types import StepRecord


@dataclass
class RequestState:
    """The rows of one request, decoded together with one setting."""

    prompts: list[list[int]]  # each row's prompt ids
    rows: list[RowOutput]  # each row's output text, stop strings and finish reason
    stats: list[GenerationStats]  # each row's statistics
    sampling: SamplingParams
    domain: str  # the router's domain of every step
    constraint: Constraint | None  # the grammar state of each row (json_schema), or None
    generator: torch.Generator | None  # the request's random draws (None: greedy)
    # Draft lengths a step verifies uncut, others being cut to the longest of them that fits (a
    # sampled step on CUDA graphs replays a graph of its exact width); () when any length runs.
    draft_lengths: tuple[int, ...] = ()
    # Whether the router learns from a step while the runner computes the next (CUDA graphs).
    overlap: bool = False
    seqs: list[list[int]] = field(default_factory=list)  # each row's prompt + verified output
    processors: PathProcessors | None = None  # set up by the prefill, on the logits' device
    first: torch.Tensor | None = None  # [B, 1, V] the prefill's logits, scoring the first step's first position
    unlearned: list[StepRecord] = field(default_factory=list)  # finished steps the router has not learned from

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [list(p) for p in self.prompts]

    @property
    def active(self) -> list[bool]:
        """Which rows are still decoding."""
        return [not r.finished for r in self.rows]

    def remaining(self, active: list[bool]) -> int:
        """Tokens the active row closest to its budget may still emit."""
        return min(r.max_new_tokens - len(r.token_ids) for r, a in zip(self.rows, active) if a)
