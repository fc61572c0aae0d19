"""RouterStore keeps its promise that routing state never stops generation: a half-made file is
completed, a foreign SQLite file at the store's path is moved aside, and a store locked by another
process past the timeout keeps the update in memory and writes it with a later one (the router
never falls back to memory for the rest of the process because of one busy moment).
"""
from __future__ import annotations

import sqlite3
import time
import warnings

import pytest

from flashspec_core.arms import Arm
from flashspec_core.records import StepRecord
from flashspec_core.routing import BanditRouter, RouterStore
from flashspec_core.routing.store import SCHEMA_VERSION, ArmDelta, StoreUnavailable

NGRAM = Arm("ngram", 4)


def _one(arm: str = "ngram@4") -> dict[str, ArmDelta]:
    return {arm: ArmDelta(pulls=1, reward_n=1.0, reward_sum=0.5, reward_sumsq=0.25, goodput_sum=40.0,
                          seconds_sum=0.1)}


def _record() -> StepRecord:
    return StepRecord(domain="tool", arm=NGRAM, drafted=4, accepted=2, emitted=3, draft_seconds=0.01,
                      verify_seconds=0.04, context_len=10, sequence=list(range(10)), rows=1)


def test_a_half_made_file_is_completed_not_fatal(tmp_path):
    """user_version says "router store" but the tables never got created (a crash, a copy)."""
    path = tmp_path / "r.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    conn.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the file is ours, only unfinished
        router = BanditRouter([NGRAM], store=RouterStore(path))  # loads the store: once "no such table"
    router.update(_record())
    router.flush()  # the router queues writes; the engine flushes at every request's end
    router.store.close()
    with RouterStore(path) as store:
        assert store.persistent and store.load()["tool"].arms["ngram@4"].pulls == 1


@pytest.mark.parametrize("foreign", [
    "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)",
    "CREATE TABLE arm_stats (domain TEXT, hits INTEGER)",  # our table's name, not its columns
])
def test_a_foreign_database_is_moved_aside_and_left_intact(tmp_path, foreign):
    path = tmp_path / "r.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(foreign)
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.warns(StoreUnavailable, match="not a router store") as caught:
        store = RouterStore(path)
    moved = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name and not p.name.endswith(("-wal", "-shm"))]
    assert len(moved) == 1 and moved[0].read_bytes() == before, "the foreign file must be kept as it was"
    assert str(moved[0]) in str(caught[0].message)
    assert store.persistent
    store.record("tool", _one())
    assert store.load()["tool"].arms["ngram@4"].pulls == 1
    store.close()


def test_a_locked_store_keeps_the_update_and_writes_it_later(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = RouterStore(path, timeout=0.5)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another process writing for longer than the timeout
    with pytest.warns(StoreUnavailable, match="locked"):
        store.record("tool", _one(), scale=50.0)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        store.record("tool", _one())
    assert time.monotonic() - start < 0.25, "while behind, a write must not wait out the timeout again"
    blocker.execute("COMMIT")
    blocker.close()
    store.record("chat", _one("none"))
    data = store.load()
    assert data["tool"].steps == 2 and data["tool"].scale == 50.0
    assert data["tool"].arms["ngram@4"].pulls == 2 and data["chat"].arms["none"].pulls == 1
    store.close()


def test_the_router_keeps_persisting_after_a_transient_lock(tmp_path):
    path = tmp_path / "r.sqlite3"
    router = BanditRouter([NGRAM], store=RouterStore(path, timeout=0.05))
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreUnavailable)
        warnings.simplefilter("error", RuntimeWarning)  # the router's "statistics stay in memory"
        router.update(_record())
        router.flush()  # the write meets the lock
    blocker.execute("COMMIT")
    blocker.close()
    router.update(_record())
    router.flush()
    router.store.close()
    with RouterStore(path) as store:
        assert store.load()["tool"].arms["ngram@4"].pulls == 2


def _read_only(store: RouterStore, on: bool) -> None:
    """Make the store's file refuse writes as a read-only file does (SQLITE_READONLY) or accept
    them again. query_only, because root (which the suite may run as) ignores permission bits."""
    with store._lock:
        store._conn.execute(f"PRAGMA query_only = {int(on)}")


def test_a_write_that_fails_takes_nothing_so_sending_it_again_counts_it_once(tmp_path):
    store = RouterStore(tmp_path / "r.sqlite3")
    _read_only(store, True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        store.record("tool", _one(), scale=50.0)
    _read_only(store, False)
    store.record("tool", _one(), scale=50.0)  # the caller sends what failed again
    data = store.load()["tool"]
    assert data.steps == 1 and data.arms["ngram@4"].pulls == 1 and data.scale == 50.0
    store.close()


def test_the_routers_statistics_survive_failed_writes_and_are_written_once_later(tmp_path):
    store = RouterStore(tmp_path / "r.sqlite3")
    router = BanditRouter([NGRAM], store=store)
    router.update(_record())
    router.flush()
    _read_only(store, True)
    with pytest.warns(RuntimeWarning, match="store write failed"):
        router.update(_record())
        router.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once while the store stays unwritable
        router.update(_record())
        router.flush()
    assert store.load()["tool"].arms["ngram@4"].pulls == 1
    _read_only(store, False)
    router.update(_record())
    router.flush()
    on_disk = store.load()["tool"]
    assert on_disk.arms["ngram@4"].pulls == router.summary()["tool"]["ngram@4"]["pulls"] == 4
    assert on_disk.steps == 4
    store.close()
