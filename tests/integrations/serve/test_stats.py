"""Router statistics shared through one ledger: each router learns the others' steps, once.

No Ray here: replicas are routers in one process writing the same SQLite file, which is exactly
what replicas on one host do (tests/integrations/serve/test_endpoint.py runs the real thing).
"""
from __future__ import annotations

import sqlite3

import pytest

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.records import StepRecord
from flashspec_core.routing.router import BanditRouter
from flashspec_core.routing.store import ArmDelta, DomainStats
from flashspec_integrations.serve.stats import SharedRouterStats, TrackingStore

ARMS = [Arm(NO_DRAFT, 0), Arm("model", 2)]


def replica(path, interval: float = 0.0) -> SharedRouterStats:
    store = TrackingStore(path)
    return SharedRouterStats(BanditRouter(ARMS, store=store, seed=0), store, interval)


def steps(shared: SharedRouterStats, n: int, domain: str = "chat", arm: Arm = ARMS[1]) -> None:
    for _ in range(n):
        shared.router.update(StepRecord(domain=domain, arm=arm, drafted=2, accepted=1, emitted=2,
                                        draft_seconds=0.001, verify_seconds=0.01))
    shared.router.flush()  # the engine flushes the router's queued writes when a request ends


def pulls(shared: SharedRouterStats, domain: str = "chat", arm: Arm = ARMS[1]) -> int:
    return shared.router.summary()[domain][str(arm)]["pulls"]


def test_each_replica_absorbs_the_others_steps_exactly_once(tmp_path):
    a, b = replica(tmp_path / "ledger.sqlite3"), replica(tmp_path / "ledger.sqlite3")
    steps(a, 5)
    assert b.sync() == 5 and pulls(b) == 5
    assert a.sync() == 0 and pulls(a) == 5  # its own steps are not counted twice
    steps(b, 3)
    assert a.sync() == 3 and pulls(a) == 8
    assert b.sync() == 0 and pulls(b) == 8
    assert a.sync() == 0 and b.sync() == 0  # nothing new: nothing absorbed
    assert (a.peer_steps, b.peer_steps) == (3, 5)
    # Absorbed evidence moves the bandit as the replica's own steps would.
    counts_a = a.router._domains["chat"].bandit.counts
    counts_b = b.router._domains["chat"].bandit.counts
    assert counts_a == pytest.approx(counts_b)


def test_a_new_replica_starts_warm_from_the_ledger(tmp_path):
    a = replica(tmp_path / "ledger.sqlite3")
    steps(a, 4, domain="code")
    late = replica(tmp_path / "ledger.sqlite3")
    assert late.warm_steps == 4 and pulls(late, "code") == 4
    assert late.sync() == 0  # what it loaded at start is not absorbed again


def test_sync_waits_for_the_interval_unless_forced(tmp_path):
    a, b = replica(tmp_path / "l.sqlite3"), replica(tmp_path / "l.sqlite3", interval=3600)
    steps(a, 2)
    assert b.sync() == 0 and "chat" not in b.router.summary()
    assert b.sync(force=True) == 2


def test_absorb_rejects_what_is_not_store_statistics(tmp_path):
    a = replica(tmp_path / "l.sqlite3")
    with pytest.raises(ValueError, match="increments"):
        a.router.absorb({"chat": {"pulls": 1}})
    a.router.absorb({"chat": DomainStats(steps=1, arms={"model@2": ArmDelta(pulls=1, reward_n=1, reward_sum=0.5,
                                                                            reward_sumsq=0.25)})})
    assert pulls(a) == 1


class FailingReads:
    """A planted fault: the ledger connection's next `reads` SELECTs fail as a broken disk would."""

    def __init__(self, conn: sqlite3.Connection, reads: int = 1):
        self.conn, self.reads = conn, reads

    def execute(self, sql: str, *args):
        if self.reads and sql.lstrip().upper().startswith("SELECT"):
            self.reads -= 1
            raise sqlite3.OperationalError("disk I/O error (planted)")
        return self.conn.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.conn, name)


def test_a_failed_read_changes_nothing_and_the_next_sync_merges_only_what_is_new(tmp_path):
    a, b = replica(tmp_path / "l.sqlite3"), replica(tmp_path / "l.sqlite3")
    steps(a, 5)
    assert b.sync() == 5 and pulls(b) == 5
    steps(a, 2)
    steps(b, 1)
    b.store._conn = FailingReads(b.store._conn)
    with pytest.warns(Warning, match="read"):
        assert b.sync() == 0
    assert pulls(b) == 6  # nothing merged, nothing forgotten
    steps(a, 3)
    assert b.sync() == 5 and pulls(b) == 11  # a's 2 + 3 since the last good read; b's own once
    assert b.sync() == 0 and a.sync() == 1 and pulls(a) == pulls(b) == 11
    with sqlite3.connect(tmp_path / "l.sqlite3") as db:
        assert db.execute("SELECT pulls FROM arm_stats WHERE domain = 'chat'").fetchone()[0] == 11


def test_a_replica_whose_first_read_fails_takes_the_next_good_read_as_its_baseline(tmp_path, monkeypatch):
    a = replica(tmp_path / "l.sqlite3")
    steps(a, 4)
    store = TrackingStore(tmp_path / "l.sqlite3")
    router = BanditRouter(ARMS, store=store, seed=0)  # warm-started from its own read: 4 pulls
    store._conn = FailingReads(store._conn)
    with pytest.warns(Warning, match="read"):
        late = SharedRouterStats(router, store, 0.0)
    assert late.sync() == 0 and pulls(late) == 4  # the baseline, not the whole ledger again
    steps(a, 2)
    assert late.sync() == 2 and pulls(late) == 6
