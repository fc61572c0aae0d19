"""The router's writes to its `RouterStore`, queued in memory and written when asked.

Each update's increments are summed per domain and written when `flush` is called: the engine's
scheduler asks for it from a thread of its own (never the one that runs the device) every
FLUSH_EVERY decode steps and when a request ends. A write that fails (a locked or read-only file,
a full disk) leaves what it was writing queued, a warning says so once, and the next flush writes
it; `RouterStore.record` takes nothing when it fails, so the increments are counted once. Why:
docs/design.md, "Router statistics on disk".
"""
from __future__ import annotations

import threading
import warnings

from flashspec_core.routing.store import ArmDelta, RouterStore

FLUSH_EVERY = 64  # decode steps between the scheduler's writes while requests run (and at every request's end)

Queued = dict[str, tuple[int, dict[str, ArmDelta], float | None]]  # domain -> steps, deltas, scale


class StoreWriter:
    """Queued increments for one store (None: nothing is ever written). Thread-safe: the router
    queues under its own lock while another thread writes."""

    def __init__(self, store: RouterStore | None) -> None:
        self.store = store
        self.failing = False  # the last write failed (warned once until one succeeds)
        self._queued: Queued = {}
        self._lock = threading.Lock()  # guards _queued
        self._writing = threading.Lock()  # one write at a time: a domain's latest scale is written last

    @property
    def active(self) -> bool:
        """Whether increments are wanted: there is a store."""
        return self.store is not None

    def add(self, domain: str, deltas: dict[str, ArmDelta], scale: float | None) -> None:
        """Queue one update's increments (arm name -> delta) and the domain's current scale."""
        with self._lock:
            _merge(self._queued, {domain: (1, deltas, scale)})

    def flush(self) -> None:
        """Write what is queued, one transaction per domain; what a failed write held stays queued."""
        if self.store is None:
            return
        with self._writing:
            with self._lock:
                pending, self._queued = self._queued, {}
            for domain in list(pending):
                steps, deltas, scale = pending[domain]
                try:
                    self.store.record(domain, deltas, steps=steps, scale=scale)
                except Exception as exc:  # statistics must never stop generation
                    with self._lock:  # this domain and those not tried yet go back, before newer updates
                        newer, self._queued = self._queued, pending
                        _merge(self._queued, newer)
                    if not self.failing:
                        warnings.warn(f"router store write failed ({exc!r}); the statistics stay queued "
                                      "in memory and are written by a later flush", RuntimeWarning, stacklevel=3)
                    self.failing = True
                    return
                del pending[domain]
            self.failing = False


def _merge(into: Queued, later: Queued) -> None:
    """Add `later`'s increments to `into`, each domain's scale taken from the later when it has one."""
    for domain, (steps, deltas, scale) in later.items():
        had_steps, had, had_scale = into.get(domain, (0, {}, None))
        for arm, d in deltas.items():
            had.setdefault(arm, ArmDelta()).add(d)
        into[domain] = (had_steps + steps, had, had_scale if scale is None else scale)
