"""Router statistics on disk (stdlib sqlite3), shared by every process on the machine.

An additive ledger: counters per (domain, arm) and per domain; writers send increments, added by an
upsert, so concurrent processes keep all their counts. Each update is one short `BEGIN IMMEDIATE`
transaction in WAL mode: readers never block, writers wait, a killed process loses at most its
uncommitted update. Failure policy (routing state never stops generation): a corrupt or foreign
file is moved aside and a fresh store starts; a locked write keeps its increments for the next; any
other failed write raises and takes nothing; a failed read is a cold start for `load`, an error for
`read`; an unwritable location or a newer schema gives an in-memory store. Details: docs/design.md.
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

_T = TypeVar("_T")

SCHEMA_VERSION = 1
DEFAULT_FILENAME = "router.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS arm_stats (
    domain       TEXT NOT NULL,
    arm          TEXT NOT NULL,
    pulls        INTEGER NOT NULL DEFAULT 0,
    scored       INTEGER NOT NULL DEFAULT 0,
    reward_n     REAL NOT NULL DEFAULT 0,
    reward_sum   REAL NOT NULL DEFAULT 0,
    reward_sumsq REAL NOT NULL DEFAULT 0,
    goodput_sum  REAL NOT NULL DEFAULT 0,
    seconds_sum  REAL NOT NULL DEFAULT 0,
    updated_at   REAL NOT NULL,
    PRIMARY KEY (domain, arm)
);
CREATE TABLE IF NOT EXISTS domain_stats (
    domain     TEXT PRIMARY KEY,
    steps      INTEGER NOT NULL DEFAULT 0,
    scale      REAL,
    updated_at REAL NOT NULL
);
"""

_UPSERT_ARM = """
INSERT INTO arm_stats (domain, arm, pulls, scored, reward_n, reward_sum, reward_sumsq,
                       goodput_sum, seconds_sum, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (domain, arm) DO UPDATE SET
    pulls = pulls + excluded.pulls,
    scored = scored + excluded.scored,
    reward_n = reward_n + excluded.reward_n,
    reward_sum = reward_sum + excluded.reward_sum,
    reward_sumsq = reward_sumsq + excluded.reward_sumsq,
    goodput_sum = goodput_sum + excluded.goodput_sum,
    seconds_sum = seconds_sum + excluded.seconds_sum,
    updated_at = excluded.updated_at
"""

_UPSERT_DOMAIN = """
INSERT INTO domain_stats (domain, steps, scale, updated_at) VALUES (?, ?, ?, ?)
ON CONFLICT (domain) DO UPDATE SET
    steps = steps + excluded.steps,
    scale = COALESCE(excluded.scale, scale),
    updated_at = excluded.updated_at
"""

# SQLite primary result codes (low byte of the extended code) that mean "this file is bad".
_CORRUPT_CODES = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB
# ... and those that may mean "this file or place is not ours to write".
_ACCESS_CODES = {3, 8, 10, 14}  # SQLITE_PERM, SQLITE_READONLY, SQLITE_IOERR, SQLITE_CANTOPEN


@dataclass
class ArmDelta:
    """Increments for one (domain, arm) row. Pulls are steps the arm really ran; `scored` are
    full-information estimates. Reward fields cover both; goodput and seconds only real pulls."""

    pulls: int = 0
    scored: int = 0
    reward_n: float = 0.0
    reward_sum: float = 0.0
    reward_sumsq: float = 0.0
    goodput_sum: float = 0.0
    seconds_sum: float = 0.0

    def add(self, other: ArmDelta) -> None:
        """Add `other`'s increments to these, every field (a field added later is summed too)."""
        for name in _DELTA_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


_DELTA_FIELDS = tuple(f.name for f in fields(ArmDelta))


@dataclass
class DomainStats:
    """What the store holds for one domain, summed over every process that wrote it."""

    steps: int = 0
    scale: float | None = None
    arms: dict[str, ArmDelta] = field(default_factory=dict)


def _with(pending: Mapping[str, DomainStats], domain: str, arms: Mapping[str, ArmDelta], steps: int,
          scale: float | None) -> dict[str, DomainStats]:
    """A copy of `pending` with one update's increments added (`pending` itself is left as it was)."""
    out: dict[str, DomainStats] = {}
    for name, st in pending.items():
        out[name] = DomainStats(st.steps, st.scale, {arm: ArmDelta(**vars(d)) for arm, d in st.arms.items()})
    st = out.setdefault(domain, DomainStats())
    st.steps += steps
    st.scale = st.scale if scale is None else scale
    for arm, d in arms.items():
        st.arms.setdefault(arm, ArmDelta()).add(d)
    return out


class StoreUnavailable(UserWarning):
    """Warned when the store falls back to memory or moves a bad file aside."""


def default_store_path() -> Path:
    """`$FLASHSPEC_CACHE_DIR/router.sqlite3`, else the user cache dir (XDG), else ~/.cache."""
    root = os.environ.get("FLASHSPEC_CACHE_DIR")
    if root:
        return Path(root).expanduser() / DEFAULT_FILENAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "flashspec-agents" / DEFAULT_FILENAME


def _code(exc: BaseException) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


class _NewerSchema(Exception):
    pass


class _Foreign(sqlite3.DatabaseError):
    """A readable SQLite file whose tables are not the router's: moved aside like a corrupt one."""


def _schema_columns() -> dict[str, list[str]]:
    """Each table of `_SCHEMA` and its columns, read from SQLite itself rather than restated."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(_SCHEMA)
        return {name: [c[1] for c in conn.execute(f"PRAGMA table_info({name})")]
                for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()


_COLUMNS = _schema_columns()


class RouterStore:
    """SQLite-backed ledger of router statistics. Thread-safe; one connection per instance.

    path: a file path, ":memory:" for a private in-memory store, or None for
    `default_store_path()`. timeout: seconds a writer waits for another process's transaction.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, timeout: float = 10.0) -> None:
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a str, os.PathLike, ':memory:' or None, got {path!r}")
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._pending: dict[str, DomainStats] = {}  # increments not yet written (the store was locked)
        self._behind = False  # the last write found the store locked
        if path is not None and os.fspath(path) == ":memory:":
            self.path: Path | None = None
            self.persistent = False
            self._conn = self._connect(":memory:")
            return
        self.path = Path(os.fspath(path)).expanduser() if path is not None else default_store_path()
        self.persistent = True
        self._conn = self._open_file(self.path)

    def _open_file(self, path: Path) -> sqlite3.Connection:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return self._fallback(f"cannot create directory {path.parent} ({exc})")
        try:
            return self._connect(str(path))
        except _NewerSchema as exc:
            return self._fallback(str(exc))
        except (sqlite3.DatabaseError, OSError) as exc:
            code = _code(exc)
            writable_dir = os.access(path.parent, os.W_OK | os.X_OK)
            bad_file = path.exists() and (code in _CORRUPT_CODES or code in _ACCESS_CODES
                                          or isinstance(exc, OSError) or code is None)
            if not (writable_dir and bad_file):
                return self._fallback(f"cannot write {path} ({exc})")
            if isinstance(exc, _Foreign):
                reason = "not a router store"
            elif code in _ACCESS_CODES and not os.access(path, os.R_OK | os.W_OK):
                reason = "unreadable"
            elif code in _ACCESS_CODES:
                # The file is accessible but SQLite cannot write beside it: not the file's fault.
                return self._fallback(f"cannot write {path} ({exc})")
            else:
                reason = "corrupt"
            moved = self._move_aside(path)
            warnings.warn(
                f"router store {path} was {reason} ({exc}); moved it to {moved} and started a "
                "fresh store (routing statistics restart from scratch)",
                StoreUnavailable,
                stacklevel=3,
            )
            try:
                return self._connect(str(path))
            except (sqlite3.DatabaseError, OSError, _NewerSchema) as exc2:
                return self._fallback(f"fresh store at {path} failed too ({exc2})")

    def _fallback(self, why: str) -> sqlite3.Connection:
        warnings.warn(
            f"router store unavailable: {why}. Using an in-memory store for this process, so "
            "routing statistics will not persist; set FLASHSPEC_CACHE_DIR or pass a writable path",
            StoreUnavailable,
            stacklevel=4,
        )
        self.persistent = False
        return self._connect(":memory:")

    @staticmethod
    def _move_aside(path: Path) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{os.getpid()}")
        # The -wal must go too: SQLite would otherwise replay the old frames into the new file.
        for suffix in ("-wal", "-shm", ""):
            src = path.with_name(path.name + suffix)
            if src.exists():
                os.replace(src, target.with_name(target.name + suffix))
        return target

    def _connect(self, where: str) -> sqlite3.Connection:
        conn = sqlite3.connect(
            where, timeout=self.timeout, isolation_level=None, check_same_thread=False
        )
        try:
            # Read-only checks first: a file we must not touch (newer schema, not ours) stays
            # byte-identical.
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check failed: {check}")
            self._check_version(conn.execute("PRAGMA user_version").fetchone()[0], where)
            self._check_tables(conn, where)
            self._retry_busy(lambda: conn.execute("PRAGMA journal_mode=WAL").fetchone())
            conn.execute("PRAGMA synchronous=NORMAL")
            self._retry_busy(lambda: self._ensure_schema(conn, where))
        except BaseException:
            conn.close()
            raise
        return conn

    def _retry_busy(self, fn: Callable[[], _T], timeout: float | None = None) -> _T:
        """Run `fn`, retrying "database is locked" until the timeout (default `self.timeout`): a
        few setup statements (switching to WAL) can report busy without waiting on the busy handler."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if _code(exc) not in (5, 6) or time.monotonic() > deadline:  # BUSY, LOCKED
                    raise
                time.sleep(0.01)

    @staticmethod
    def _check_version(version: int, where: str) -> None:
        if version > SCHEMA_VERSION:
            raise _NewerSchema(
                f"{where} has schema version {version}, newer than this code's "
                f"{SCHEMA_VERSION}; left untouched (upgrade flashspec-agents)"
            )

    def _ensure_schema(self, conn: sqlite3.Connection, where: str) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            self._check_version(version, where)  # again: another process may have migrated
            # IF NOT EXISTS: a new file gets the tables, a half-made one the tables it lacks.
            # Later versions add their migrations here, in order.
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            if version < SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @staticmethod
    def _check_tables(conn: sqlite3.Connection, where: str) -> None:
        """Raise _Foreign unless every table, view, index or trigger in the file is one of ours."""
        for kind, name in conn.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"):
            columns = [c[1] for c in conn.execute(f"PRAGMA table_info({name!r})")] if kind == "table" else None
            if _COLUMNS.get(name) != columns:
                raise _Foreign(f"{where} holds a {kind} {name!r} that is not the router store's")

    def record(
        self,
        domain: str,
        arms: Mapping[str, ArmDelta],
        *,
        steps: int = 1,
        scale: float | None = None,
    ) -> None:
        """Add one update's increments, all in one transaction (all or nothing).

        If another process holds the store locked past the timeout, the increments stay in memory
        and go out with the next write (which then does not wait: the lock may last). Any other
        failure raises having taken nothing: the caller still holds these increments and may send
        them again (the router's writer does), so none is lost and none is counted twice.
        """
        if not isinstance(domain, str) or not domain:
            raise ValueError(f"domain must be a non-empty str, got {domain!r}")
        with self._lock:
            pending = _with(self._pending, domain, arms, steps, scale)
            try:
                self._write(pending, 0.0 if self._behind else self.timeout)
            except sqlite3.OperationalError as exc:
                if _code(exc) not in (5, 6):  # BUSY, LOCKED
                    raise
                if not self._behind:
                    warnings.warn(
                        f"router store {self.path} is locked by another process; this update is "
                        "kept in memory and written with a later one",
                        StoreUnavailable,
                        stacklevel=2,
                    )
                self._pending, self._behind = pending, True
                return
            self._pending, self._behind = {}, False

    def _write(self, pending: Mapping[str, DomainStats], wait: float) -> None:
        """One transaction with every increment of `pending`; waits at most `wait` s for the lock."""
        if wait != self.timeout:
            self._conn.execute(f"PRAGMA busy_timeout={int(wait * 1000)}")
        try:
            self._retry_busy(lambda: self._conn.execute("BEGIN IMMEDIATE"), wait)
        finally:
            if wait != self.timeout:
                self._conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
        now = time.time()
        try:
            for domain, st in pending.items():
                self._conn.executemany(_UPSERT_ARM, [
                    (domain, arm, d.pulls, d.scored, d.reward_n, d.reward_sum, d.reward_sumsq,
                     d.goodput_sum, d.seconds_sum, now)
                    for arm, d in st.arms.items()
                ])
                self._conn.execute(_UPSERT_DOMAIN, (domain, st.steps, st.scale, now))
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:  # a failed COMMIT may have ended it already
                self._conn.execute("ROLLBACK")
            raise

    def read(self) -> dict[str, DomainStats]:
        """Everything in the store, by domain (written increments only, not those still pending).

        Raises sqlite3.Error when the store cannot be read: a reader that merges what is new since
        its last read must tell a failed read from an empty store (`load` cannot).
        """
        out: dict[str, DomainStats] = {}
        with self._lock:
            for domain, steps, scale in self._conn.execute("SELECT domain, steps, scale FROM domain_stats"):
                out[domain] = DomainStats(steps=steps, scale=scale)
            for row in self._conn.execute(
                "SELECT domain, arm, pulls, scored, reward_n, reward_sum, reward_sumsq, "
                "goodput_sum, seconds_sum FROM arm_stats"
            ):
                out.setdefault(row[0], DomainStats()).arms[row[1]] = ArmDelta(*row[2:])
        return out

    def load(self) -> dict[str, DomainStats]:
        """`read`, for a warm start: a store that cannot be read gives a warning and nothing (a
        cold start, never an error)."""
        try:
            return self.read()
        except sqlite3.Error as exc:
            warnings.warn(f"router store {self.path} could not be read ({exc}); starting cold",
                          StoreUnavailable, stacklevel=2)
            return {}

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> RouterStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
