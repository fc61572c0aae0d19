"""Grammar compiles that can be stopped: each runs in a worker process, killed once past its limit.

A compile given a time limit (`compile_json_schema(..., timeout_s=)`) runs in one of a few worker
processes (compile_worker.py). Its caller waits at most the limit, a wait for a free worker
included; a compile still running then is killed with its process, and a fresh worker takes its
place. A finished compile sends its grammar back serialized (xgrammar's JSON form), so the grammar
that passed the limit is the one decoded under, never compiled again. Workers are fresh
interpreters (`python -m`), not forks; each takes compiles only once it says it is ready, and keeps
its own xgrammar cache. Why: docs/constrained.md, "Defaults and limits".
"""
from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

WORKER_MODULE = "flashspec_core.constrained.compile_worker"
STARTUP_LIMIT_S = 120.0  # a worker not ready by then is killed (a broken environment, not a slow import)
# The folder holding flashspec_core, for a worker whose parent found it other than by PYTHONPATH.
_ROOT = str(Path(__file__).resolve().parents[2])


class CompileBusy(RuntimeError):
    """Every worker stayed busy with other compiles for the caller's whole limit."""


@dataclass(eq=False)  # hashed by identity
class _Worker:
    process: subprocess.Popen
    conn: Connection


class CompileWorkers:
    """`workers.compile(kind, text, timeout_s)`: a compiled grammar's JSON from a worker process.

    kind and text are what `grammar.compile_text` takes ("json_schema" or "structural_tag", and the
    spec's JSON text). Raises ValueError with xgrammar's refusal, TimeoutError when the compile ran
    past `timeout_s` (its worker is then killed and replaced), CompileBusy when no worker came free
    within it.
    """

    def __init__(self, tokenizer_info_json: str, workers: int = 2, cache_limit_bytes: int = -1):
        if workers < 1:
            raise ValueError(f"workers must be >= 1; got {workers!r}")
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="flashspec-vocab-", delete=False) as f:
            f.write(tokenizer_info_json)  # each worker reads it once it has imported xgrammar
        self._info_path, self._cache_limit = f.name, cache_limit_bytes
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # At close, garbage collection or exit: no worker outlives its pool.
        self._finalizer = weakref.finalize(self, _shut_down, self._all, self._lock, self._closed, f.name)
        for _ in range(workers):
            self._start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether a worker is ready to compile within `timeout_s` (a server's warm-up)."""
        try:
            worker = self._idle.get(timeout=timeout_s)
        except queue.Empty:
            return False
        self._idle.put(worker)
        return True

    def idle(self) -> int:
        """Workers ready and not compiling now."""
        return self._idle.qsize()

    def _admit(self, worker: _Worker) -> None:
        """Hand `worker` compiles once it says it is ready (on a thread of its own)."""
        from flashspec_core.constrained.compile_worker import READY

        try:
            ready = worker.conn.poll(STARTUP_LIMIT_S) and worker.conn.recv() == READY
        except (EOFError, OSError):
            ready = False
        if ready and not self._closed.is_set():
            self._idle.put(worker)
        else:
            self._stop(worker)

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, str(theirs.fileno()), self._info_path, str(self._cache_limit)],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
        worker = _Worker(process, Connection(ours.detach()))
        with self._lock:
            self._all.add(worker)
        threading.Thread(target=self._admit, args=(worker,), name="flashspec-grammar-start", daemon=True).start()

    def _stop(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        _kill(worker)

    def pids(self) -> list[int]:
        """The worker processes' ids (for checks that a killed compile is gone)."""
        with self._lock:
            return [w.process.pid for w in self._all]

    def compile(self, kind: str, text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        try:
            worker = self._idle.get(timeout=timeout_s)
        except queue.Empty:
            raise CompileBusy(f"every grammar worker stayed busy for {timeout_s:g} s") from None
        done = finished = False
        try:
            worker.conn.send((kind, text))
            finished = worker.conn.poll(max(0.0, deadline - time.monotonic()))
            if finished:
                status, payload = worker.conn.recv()
                done = True
        except (EOFError, ConnectionError):  # the worker died (killed from outside, out of memory)
            raise ValueError("json_schema: the grammar compiler's process ended while compiling this schema") from None
        finally:
            if done:
                self._idle.put(worker)
            else:  # past the limit or dead: nothing goes on computing it; a new worker takes its place
                self._stop(worker)
                if not self._closed.is_set():
                    self._start()
        if not finished:
            raise TimeoutError(f"the compile took longer than {timeout_s:g} s")
        if status == "error":
            raise ValueError(payload)
        return str(payload)

    def close(self) -> None:
        """Kill every worker (a compile in progress ends as if past its limit)."""
        self._finalizer()


def _kill(worker: _Worker) -> None:
    """Kill a worker and close its socket; twice is harmless (its starter thread may race a close)."""
    worker.process.kill()
    worker.process.wait()
    with contextlib.suppress(OSError):
        worker.conn.close()


def _shut_down(workers: set[_Worker], lock: threading.Lock, closed: threading.Event, info_path: str) -> None:
    closed.set()
    with lock:
        stopping = list(workers)
        workers.clear()
    for worker in stopping:
        _kill(worker)
    Path(info_path).unlink(missing_ok=True)
