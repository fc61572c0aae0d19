"""The one Protocol every router implements.

A router picks the arm (draft source, γ) of each decode step from the step's domain and from
finished steps only, never the current draft's or the target's values: whatever it picks, the
output law is the target's, so a router changes the speed and never the text's law.

`select` and `update` are the contract; the members with bodies are defaults for what only some
routers use (a measured cost model, priors, statistics kept on disk), so the engine calls every
member without asking first. A router subclasses `Router` to get them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from flashspec_core.arms import Arm
from flashspec_core.records import StepRecord


@runtime_checkable
class Router(Protocol):
    """Chooses an arm per step from past steps only."""

    arms: Sequence[Arm]

    def select(self, domain: str, unavailable: frozenset[str] = frozenset()) -> Arm:
        """The arm of the next step of a request in `domain`, never one whose draft is named in
        `unavailable` (drafts that cannot propose for this row: those that need a grammar, for a
        row without one)."""
        ...

    def update(self, record: StepRecord) -> None:
        """Learn from a finished step (its tokens are final)."""
        ...

    def set_forward_costs(self, seconds: Mapping[int, float], slopes: Mapping[int, float] | None = None,
                          context: int = 0) -> None:
        """The target's calibrated forward cost on this machine: seconds by width after `context`
        cached tokens, and their growth per cached token. Ignored by default."""
        return None

    def set_expected_goodput(self, goodput: Mapping[Arm, float]) -> None:
        """Tokens/s each untried arm is expected to reach (routing/priors.py). Ignored by default."""
        return None

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Per domain, per arm: what the router measured (pulls, goodput). Empty by default."""
        return {}

    def flush(self) -> None:
        """Write what is queued for the store. The scheduler calls it from a thread of its own,
        not the one that runs the device (when a request ends and every few steps); a failed
        write should keep what it held for the next call. Nothing by default."""
        return None
