"""A submitted request and the decode state of each of its rows.

A `Request` is what a caller submits: one or more prompts with their settings (sampling, stop
strings, token budget, schema, domain, deadline) and the `RequestHandle` the caller reads its
output from. Each prompt becomes a `Row`: the unit the scheduler admits into the running batch,
steps and retires, with its own sampling generator, processors and output. Rows of one request
and rows of other requests run side by side in the same steps; nothing one row does changes
another's output law.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flashspec_core.constrained.constraint import Constraint
from flashspec_core.handle import RequestHandle
from flashspec_core.processors.paths import PathProcessors
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.results import GenerationStats
from flashspec_core.stopping import RowOutput


@dataclass
class Request:
    """One call's prompts and settings, and where its output goes."""

    prompts: list[list[int]]  # each row's prompt ids (chat template applied)
    sampling: SamplingParams
    stops: tuple[str, ...]
    max_new_tokens: int
    domain: str  # the router's domain of every step of every row
    constraints: list[Constraint] | None  # one per row under a json_schema, else None
    handle: RequestHandle
    deadline: float | None = None  # time.monotonic() after which the rows end ("timeout")
    submitted: float = field(default_factory=time.monotonic)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline


@dataclass
class Row:
    """One prompt's decode state while it is in the running batch."""

    request: Request
    index: int  # which prompt of its request
    slot: int  # the runner row (cache slot) it holds while it runs
    output: RowOutput  # its output text, stop strings and finish reason
    stats: GenerationStats
    generator: torch.Generator | None  # its own random draws (None: greedy)
    seq: list[int] = field(default_factory=list)  # prompt + verified output
    processors: PathProcessors | None = None  # set up by the prefill, on the logits' device
    first: torch.Tensor | None = None  # [1, V] the prefill's logits, scoring the first step's first position
    prefilled: int = 0  # prompt tokens fed so far (a long prompt is fed in pieces between steps)
    admitted: int = 0  # the scheduler's admission count when it got its slot (who is fed first)

    @property
    def prompt(self) -> list[int]:
        return self.request.prompts[self.index]

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def domain(self) -> str:
        return self.request.domain

    @property
    def constraint(self) -> Constraint | None:
        constraints = self.request.constraints
        return None if constraints is None else constraints[self.index]

    @property
    def finished(self) -> bool:
        return self.output.finished

    @property
    def remaining(self) -> int:
        """Tokens this row may still emit."""
        return self.output.max_new_tokens - len(self.output.token_ids)
