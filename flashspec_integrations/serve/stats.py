"""Router statistics shared by every replica: one SQLite ledger, merged into each router live.

Each replica routes with its own `BanditRouter` (selection stays in-process) and writes every update
to the router store (`flashspec_core/routing/store.py`). Before a call, at most every `interval`
seconds, a replica reads the ledger and absorbs what the others added since it last looked
(`BanditRouter.absorb`: the ledger's totals minus what it had seen minus its own writes). A new or
restarted replica loads the ledger when its router is built, so it starts warm. Replicas must share
a local disk (SQLite's WAL does not work over network file systems). Why SQLite and not a Ray
actor: docs/serve.md, "Router statistics shared by the replicas".
"""
from __future__ import annotations

import sqlite3
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashspec_core.routing.router import BanditRouter
from flashspec_core.routing.store import ArmDelta, DomainStats, RouterStore

if TYPE_CHECKING:
    from flashspec_core.engine import SpecEngine

Ledger = dict[str, DomainStats]


def _add(into: Ledger, domain: str, arms: Mapping[str, ArmDelta], steps: int, scale: float | None) -> None:
    stats = into.setdefault(domain, DomainStats())
    stats.steps += steps
    stats.scale = scale if scale is not None else stats.scale
    for arm, delta in arms.items():
        stats.arms.setdefault(arm, ArmDelta()).add(delta)


def _minus(a: Ledger, b: Ledger) -> Ledger:
    """a - b per domain and arm (what b lacks), clamped at 0 against float round-off."""
    out: Ledger = {}
    for domain, stats in a.items():
        base = b.get(domain, DomainStats())
        arms = {}
        for arm, d in stats.arms.items():
            other = base.arms.get(arm, ArmDelta())
            diff = ArmDelta(**{f.name: max(0, getattr(d, f.name) - getattr(other, f.name)) for f in fields(ArmDelta)})
            if diff.pulls or diff.scored or diff.reward_n:
                arms[arm] = diff
        steps = max(0, stats.steps - base.steps)
        if steps or arms:
            out[domain] = DomainStats(steps=steps, scale=stats.scale, arms=arms)
    return out


class TrackingStore(RouterStore):
    """A `RouterStore` that also remembers what this process wrote since `snapshot` last ran, so
    a reader can tell its own steps from the other replicas'."""

    def __init__(self, path: str | Path | None = None, **kwargs: Any):
        super().__init__(path, **kwargs)
        self._own: Ledger = {}
        self._own_lock = threading.Lock()

    def record(self, domain: str, arms: Mapping[str, ArmDelta], *, steps: int = 1, scale: float | None = None) -> None:
        with self._own_lock:
            super().record(domain, arms, steps=steps, scale=scale)
            _add(self._own, domain, arms, steps, scale)

    def snapshot(self) -> tuple[Ledger, Ledger]:
        """(the ledger's totals, this process's writes since the last snapshot), read together so
        that no write of ours falls between them. sqlite3.Error when the ledger cannot be read."""
        with self._own_lock:
            totals = self.read()  # raises on a failed read, leaving this process's writes counted
            own, self._own = self._own, {}
        return totals, own


class SharedRouterStats:
    """Keeps one replica's router merged with the ledger every replica writes.

    A failed read of the ledger changes nothing (a warning, once until a read succeeds again): the
    next read absorbs what is new since the last good one, never the whole ledger again. If the
    first read fails, the first good one only sets the baseline (the router warm-started from
    its own read or from nothing; absorbing the whole ledger could count steps twice).
    """

    def __init__(self, router: BanditRouter, store: TrackingStore, interval: float = 2.0):
        if interval < 0:
            raise ValueError(f"interval must be >= 0 seconds; got {interval!r}")
        self.router, self.store, self.interval = router, store, interval
        self._lock = threading.Lock()
        self._seen: Ledger | None = None  # the ledger's totals at the last good read
        self.warm_steps = 0  # what the router started from
        self.peer_steps = 0  # steps absorbed from other replicas since
        self.failed_reads = 0
        self._last = time.monotonic()
        self._read()
        if self._seen is not None:
            self.warm_steps = sum(s.steps for s in self._seen.values())
        if not store.persistent:
            warnings.warn("the router store is in memory (see the warning before), so this replica "
                          "shares no statistics with the others", RuntimeWarning, stacklevel=2)

    def _read(self) -> tuple[Ledger, Ledger] | None:
        """(totals, own writes) from the ledger, or None after a failed read (which changes nothing)."""
        try:
            totals, own = self.store.snapshot()
        except sqlite3.Error as exc:  # sharing must never stop generation
            self.failed_reads += 1
            if self.failed_reads == 1:
                warnings.warn(f"router store read failed ({exc}); this replica merges the others' "
                              "statistics again at the next good read", RuntimeWarning, stacklevel=3)
            return None
        self.failed_reads = 0
        if self._seen is None:
            self._seen = totals
            return None
        return totals, own

    def sync(self, force: bool = False) -> int:
        """Absorb the other replicas' new steps if `interval` has passed; the number absorbed."""
        with self._lock:
            if not (force or time.monotonic() - self._last >= self.interval):
                return 0
            self._last = time.monotonic()
            read = self._read()
            if read is None:
                return 0
            totals, own = read
            peers = _minus(_minus(totals, self._seen or {}), own)
            self._seen = totals
            self.router.absorb(peers)
            steps = sum(s.steps for s in peers.values())
            self.peer_steps += steps
            return steps

    def info(self) -> dict[str, int]:
        return {"warm_steps": self.warm_steps, "peer_steps": self.peer_steps}


def share_router(engine: SpecEngine, path: str | Path | None, interval: float = 2.0,
                 algorithm: str = "thompson") -> SharedRouterStats:
    """Give `engine` a bandit router over its arms that writes to and merges from the ledger at
    `path` (None: the default store beside the converted weights)."""
    free = {name: d for name, d in engine.drafts.items() if d.deterministic}
    store = TrackingStore(path)
    engine.router = BanditRouter(engine.arms, algorithm=algorithm, free_drafts=free, store=store)
    return SharedRouterStats(engine.router, store, interval)
