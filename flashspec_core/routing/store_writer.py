"""The router's writes to its `RouterStore`, queued in memory.

Why queued: one SQLite transaction per decode step cost about a tenth of a CPU decode step, so
each update's increments are summed per domain and written every FLUSH_EVERY updates and when a
request ends (the engine calls `BanditRouter.flush`). Why a write may fail quietly: routing must
never stop generation, so after the first failed write the statistics stay in memory and a
warning says so once.
"""
from __future__ import annotations

import sqlite3
import warnings

from flashspec_core.routing.store import ArmDelta, RouterStore

FLUSH_EVERY = 64  # updates queued before the store is written (and at every request's end)


class StoreWriter:
    """Queued increments for one store (None: nothing is ever written). Not thread-safe: the
    router calls it under its own lock."""

    def __init__(self, store: RouterStore | None) -> None:
        self.store = store
        self.failed = False
        self._queued: dict[str, tuple[int, dict[str, ArmDelta], float | None]] = {}  # domain -> steps, deltas, scale
        self._updates = 0

    @property
    def active(self) -> bool:
        """Whether increments are wanted: a store, and no write has failed."""
        return self.store is not None and not self.failed

    def add(self, domain: str, deltas: dict[str, ArmDelta], scale: float | None) -> None:
        """Queue one update's increments (arm name -> delta) and the domain's current scale."""
        steps, queued, _ = self._queued.get(domain, (0, {}, None))
        for arm, d in deltas.items():
            queued.setdefault(arm, ArmDelta()).add(d)
        self._queued[domain] = (steps + 1, queued, scale)
        self._updates += 1
        if self._updates >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Write what is queued, one transaction per domain."""
        pending, self._queued, self._updates = self._queued, {}, 0
        if not self.active or self.store is None:
            return
        for domain, (steps, deltas, scale) in pending.items():
            try:
                self.store.record(domain, deltas, steps=steps, scale=scale)
            except sqlite3.Error as exc:
                self.failed = True
                warnings.warn(
                    f"router store write failed ({exc}); statistics stay in memory from now on",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
