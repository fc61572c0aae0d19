"""`FixedRouter`: always one arm; the engine's baseline, and what benchmarks pin an arm with."""
from __future__ import annotations

from typing import Any

from flashspec_core.arms import Arm
from flashspec_core.records import StepRecord, check_record
from flashspec_core.routing.base import Router


class FixedRouter(Router):
    """Always the same arm; still tallies steps so `summary()` reads like the bandit router's."""

    def __init__(self, arm: Arm) -> None:
        if not isinstance(arm, Arm):
            raise ValueError(f"arm must be an Arm, e.g. Arm('ngram', 4), got {arm!r}")
        self.arm = arm
        self.arms: tuple[Arm, ...] = (arm,)
        self._tally: dict[str, list[float]] = {}

    def select(self, domain: str, unavailable: frozenset[str] = frozenset()) -> Arm:
        """The pinned arm, whatever the row: a pinned draft that cannot propose there decodes plainly."""
        return self.arm

    def update(self, record: StepRecord) -> None:
        check_record(record, {self.arm: 0})
        t = self._tally.setdefault(record.domain, [0, 0.0])
        t[0] += 1
        t[1] += record.emitted / record.seconds

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {
            d: {str(self.arm): {"pulls": int(n), "mean_goodput": g / n if n else None}}
            for d, (n, g) in self._tally.items()
        }
