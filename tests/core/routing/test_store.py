"""RouterStore: additive upserts, concurrency, corruption, read-only places, crash safety."""
from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashspec_core.routing.store import (
    SCHEMA_VERSION,
    ArmDelta,
    RouterStore,
    StoreUnavailable,
    default_store_path,
)

REPO = Path(__file__).resolve().parents[3]
# Child processes load store.py by path: it is stdlib-only, and importing it through the
# package would first import the whole engine (torch, transformers), adding seconds per child.
_CHILD_PRELUDE = textwrap.dedent(
    f"""
    import importlib.util, sys
    _spec = importlib.util.spec_from_file_location(
        "flashspec_store", {str(REPO / "flashspec_core" / "routing" / "store.py")!r})
    _store = sys.modules["flashspec_store"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_store)
    RouterStore, ArmDelta = _store.RouterStore, _store.ArmDelta
    """
)


def _one(domain="tool", arm="ngram@4", **kw):
    return {arm: ArmDelta(pulls=1, reward_n=1.0, reward_sum=0.5, reward_sumsq=0.25,
                          goodput_sum=40.0, seconds_sum=0.1, **kw)}


def test_increments_add_up_and_schema_is_versioned(tmp_path):
    path = tmp_path / "r.sqlite3"
    with RouterStore(path) as store:
        assert store.persistent
        store.record("tool", _one(), scale=50.0)
        store.record("tool", _one(), scale=None)  # None keeps the stored scale
        store.record("chat", {"none": ArmDelta(scored=1, reward_n=1.0, reward_sum=1.0, reward_sumsq=1.0)})
        data = store.load()
    assert data["tool"].steps == 2 and data["tool"].scale == 50.0
    row = data["tool"].arms["ngram@4"]
    assert (row.pulls, row.reward_n, row.goodput_sum) == (2, 2.0, 80.0)
    assert data["chat"].arms["none"].scored == 1
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_default_path_honours_the_cache_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHSPEC_CACHE_DIR", str(tmp_path / "cache"))
    assert default_store_path() == tmp_path / "cache" / "router.sqlite3"
    with RouterStore() as store:
        store.record("x", _one())
    assert (tmp_path / "cache" / "router.sqlite3").exists()
    monkeypatch.delenv("FLASHSPEC_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_store_path() == Path.home() / ".cache" / "flashspec-agents" / "router.sqlite3"


def test_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="timeout"):
        RouterStore(tmp_path / "a.sqlite3", timeout=0)
    with pytest.raises(ValueError, match="path"):
        RouterStore(42)
    with RouterStore(":memory:") as store, pytest.raises(ValueError, match="domain"):
        store.record("", _one())


def _writer(path: str, n: int, start) -> None:
    start.wait()
    with RouterStore(path, timeout=30.0) as store:
        for _ in range(n):
            store.record("tool", _one())


def test_two_processes_updating_at_once_lose_nothing(tmp_path):
    path = str(tmp_path / "r.sqlite3")
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(path, 150, start)) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()  # both open the (not yet existing) file and write at the same moment
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with RouterStore(path) as store:
        data = store.load()
    assert data["tool"].steps == 300
    assert data["tool"].arms["ngram@4"].pulls == 300
    assert data["tool"].arms["ngram@4"].goodput_sum == pytest.approx(300 * 40.0)


def test_a_corrupt_file_is_moved_aside_with_a_warning(tmp_path):
    path = tmp_path / "r.sqlite3"
    garbage = b"this is not a database " * 200
    path.write_bytes(garbage)
    with pytest.warns(StoreUnavailable, match="corrupt") as caught:
        store = RouterStore(path)
    assert store.persistent
    moved = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(moved) == 1 and moved[0].read_bytes() == garbage
    assert str(moved[0]) in str(caught[0].message)
    store.record("tool", _one())
    assert store.load()["tool"].arms["ngram@4"].pulls == 1
    store.close()


def test_damaged_pages_inside_a_real_database_are_detected(tmp_path):
    path = tmp_path / "r.sqlite3"
    with RouterStore(path) as store:
        for i in range(300):  # enough rows to span several pages
            store.record(f"domain-{i}", _one())
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    raw = bytearray(path.read_bytes())
    page = 4096
    assert len(raw) > 3 * page
    raw[2 * page:3 * page] = os.urandom(page)  # scribble over a b-tree page, keep the header
    path.write_bytes(bytes(raw))
    with pytest.warns(StoreUnavailable, match="corrupt"):
        store = RouterStore(path)
    assert store.load() == {}
    store.close()


def test_a_newer_schema_is_left_untouched(tmp_path):
    path = tmp_path / "r.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.close()
    before = path.read_bytes()
    with pytest.warns(StoreUnavailable, match="newer"):
        store = RouterStore(path)
    assert not store.persistent
    store.record("tool", _one())  # still works, in memory
    store.close()
    assert path.read_bytes() == before


_READONLY_CHILD = _CHILD_PRELUDE + textwrap.dedent(
    """
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = RouterStore(sys.argv[1])
    store.record("tool", {"none": ArmDelta(pulls=1)})
    assert store.load()["tool"].arms["none"].pulls == 1
    assert not store.persistent, "should have fallen back to memory"
    assert any("in-memory" in str(w.message) for w in caught), [str(w.message) for w in caught]
    print("fallback-ok")
    """
)


def _run_with_read_only_dir(base: Path, path: Path) -> subprocess.CompletedProcess:
    """Run the child where `base` cannot be written. Root ignores permission bits, so as root
    the child gets a private mount namespace in which `base` is a read-only bind mount."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-c", _READONLY_CHILD, str(path)]
    if os.geteuid() == 0:
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                               capture_output=True)
        if probe.returncode != 0:
            pytest.skip("running as root without mount namespaces: cannot make a read-only dir")
        script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(base), *cmd]
    else:
        os.chmod(base, 0o555)
        if os.access(base, os.W_OK):
            pytest.skip("this filesystem ignores directory permissions")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("existing", [False, True], ids=["new-file", "existing-file"])
def test_a_read_only_directory_falls_back_to_memory_with_a_warning(tmp_path, existing):
    base = tmp_path / "ro"
    base.mkdir()
    path = base / "r.sqlite3"
    if existing:
        with RouterStore(path) as store:
            store.record("tool", _one())
    try:
        proc = _run_with_read_only_dir(base, path)
    finally:
        os.chmod(base, 0o755)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fallback-ok" in proc.stdout
    if existing:  # the child could not write it, so the file must be intact and unchanged
        with RouterStore(path) as store:
            assert store.load()["tool"].arms["ngram@4"].pulls == 1


_KILL_CHILD = _CHILD_PRELUDE + textwrap.dedent(
    """
    store = RouterStore(sys.argv[1])
    i = 0
    while True:
        store.record("tool", {"ngram@4": ArmDelta(pulls=1, goodput_sum=1.0),
                              "none": ArmDelta(scored=1)})
        i += 1
        print(i, flush=True)
    """
)


def _write_until_killed(path: Path, at_least: int) -> int:
    """Start a writer, SIGKILL it once it acknowledged `at_least` more commits; return its last ack."""
    proc = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        acked = 0
        while acked < at_least and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            acked = int(line)
        assert acked >= at_least, proc.stderr.read()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)  # the child is inside its write loop: mid-write
        proc.wait(timeout=30)
        # read() also drains what readline() buffered ahead (communicate() would skip it).
        acked = max([acked] + [int(x) for x in proc.stdout.read().split()])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return acked


def test_kill_9_mid_write_loses_at_most_the_last_update(tmp_path):
    path = tmp_path / "r.sqlite3"
    before = 0
    for _ in range(3):  # each round resumes the file the previous kill left behind
        acked = _write_until_killed(path, 200)
        conn = sqlite3.connect(path)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()
        with RouterStore(path) as store:
            data = store.load()["tool"]
        # Every acknowledged commit survived; only the one in flight may be there or not.
        assert before + acked <= data.steps <= before + acked + 1
        # The rows of one update are all-or-nothing.
        assert data.arms["ngram@4"].pulls == data.steps == data.arms["none"].scored
        before = data.steps
