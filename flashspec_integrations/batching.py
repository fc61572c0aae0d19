"""Concurrent calls to one engine decoded together, as engine batches.

The engine decodes a list of prompts as one batch (it verifies the rows together, so a batch of 8
costs far less than 8 calls), but frameworks deliver concurrent work as separate calls: LangChain's
`batch` runs `invoke` in a thread pool, `abatch` and LangGraph branches run coroutines side by
side, LlamaIndex's async query engines fan out `achat`/`acomplete`. Each adapter call therefore
goes to its engine's `Batcher` instead of to the engine: a runner thread waits until no new call
has arrived for `window` seconds (the adapters' `batch_window`, 10 ms by default; at most
`MAX_GATHER_WINDOWS` windows), then decodes the waiting calls that share every engine argument
(`EngineCall.batch_key`: domain, length, sampling, stops, schema) as one `engine.generate` batch,
and repeats while calls are waiting. Calls that arrive while a batch runs wait for the next one,
so nothing is serialised one by one behind the engine's lock. When the caller knows how many
calls are coming (LangChain's `batch`/`abatch` of n inputs: `expect(n)`), the runner waits for all
n (at most `COHORT_WAIT` seconds) rather than for a quiet window, which a busy machine's thread
scheduling can stretch.

Each row of a batch has exactly the distribution it has alone (the engine's guarantee); greedy
rows are the same tokens. A seeded sampled call runs alone, so its draws do not depend on its
batch-mates. If a batch fails (a prompt too long for the context, say), each call is retried
alone, so one bad call fails alone.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
import weakref
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from flashspec_integrations.calls import EngineCall, Outcome

MAX_GATHER_WINDOWS = 10
COHORT_WAIT = 2.0


class _Cohort:
    """Calls announced together (`expect`): how many will come, how many have, until when to wait."""

    def __init__(self, size: int):
        self.size = size
        self.arrived = 0
        self.deadline = float("inf")  # set by the first arrival

    def waiting(self, now: float) -> bool:
        return self.arrived < self.size and now < self.deadline


_cohort: contextvars.ContextVar[_Cohort | None] = contextvars.ContextVar("flashspec_cohort", default=None)


@contextlib.contextmanager
def expect(n: int) -> Iterator[None]:
    """The calls submitted inside (threads and tasks started inside inherit it) come as a group of
    `n`: the batcher waits for all of them before it runs a batch."""
    token = _cohort.set(_Cohort(n) if n > 1 else None)
    try:
        yield
    finally:
        _cohort.reset(token)


@dataclass
class _Job:
    call: EngineCall
    window: float
    cohort: _Cohort | None = None
    future: Future = field(default_factory=Future)
    key: Hashable = None

    def __post_init__(self) -> None:
        self.key = self.call.batch_key()


class Batcher:
    """Gathers the calls made to one engine and runs them as engine batches (one runner at a time)."""

    def __init__(self, engine: Any):
        self._engine = weakref.ref(engine)  # the batcher must not keep its engine alive
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._running = False

    def submit(self, calls: Sequence[EngineCall], window: float) -> list[Future]:
        """Queue `calls`; each future resolves to the call's Outcome (or its exception)."""
        cohort = _cohort.get()
        jobs = [_Job(c, window, cohort) for c in calls]
        with self._cond:
            if cohort is not None:
                cohort.arrived += len(jobs)
                cohort.deadline = min(cohort.deadline, time.monotonic() + COHORT_WAIT)
            self._pending.extend(jobs)
            self._cond.notify_all()
            start = not self._running
            self._running = True
        if start:
            threading.Thread(target=self._drain, name="flashspec-batcher", daemon=True).start()
        return [j.future for j in jobs]

    def _gather(self) -> list[_Job]:
        """Under the lock: wait for announced calls to arrive and for arrivals to go quiet, then
        take the first waiting call's group."""
        window = max(j.window for j in self._pending)
        quiet_deadline = time.monotonic() + window * MAX_GATHER_WINDOWS
        while True:
            now = time.monotonic()
            cohorts = {id(j.cohort): j.cohort for j in self._pending if j.cohort is not None and j.cohort.waiting(now)}
            if cohorts:
                self._cond.wait(min(c.deadline for c in cohorts.values()) - now)
                continue
            if window <= 0 or now >= quiet_deadline:
                break
            seen = len(self._pending)
            self._cond.wait(window)
            if len(self._pending) == seen:
                break
        key = self._pending[0].key
        group = [j for j in self._pending if j.key == key]
        self._pending = [j for j in self._pending if j.key != key]
        return [j for j in group if j.future.set_running_or_notify_cancel()]  # drop cancelled callers

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._running = False
                    return
                group = self._gather()
            try:
                self._run(group)
            except BaseException as exc:  # never leave a caller waiting
                for job in group:
                    if not job.future.done():
                        job.future.set_exception(exc)

    def _run(self, group: list[_Job]) -> None:
        if not group:
            return
        calls = [j.call for j in group]
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the engine was garbage-collected while calls were waiting for it")
        try:
            results = engine.generate([c.prompt_ids for c in calls], **calls[0].engine_kwargs())
        except Exception as exc:
            if len(group) == 1:
                group[0].future.set_exception(exc)
                return
            for job in group:  # find the call that failed; the others still get their answers
                self._run([job])
            return
        for job, res in zip(group, results):
            job.future.set_result(Outcome(
                job.call.prefix + res.text, list(res.token_ids), res.finish_reason, res.stats, res.prompt_tokens,
                res.stats.seconds if res.stats is not None else 0.0, job.call.decision, batch_size=len(group),
            ))


_batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_batchers_lock = threading.Lock()


def batcher_for(engine: Any) -> Batcher:
    """The engine's batcher (one per engine object, for as long as the engine lives)."""
    with _batchers_lock:
        batcher = _batchers.get(engine)
        if batcher is None:
            batcher = _batchers[engine] = Batcher(engine)
        return batcher


def run_calls(engine: Any, calls: Sequence[EngineCall], window: float) -> list[Outcome]:
    """Run `calls` through the engine's batcher and wait for all of them (the first error is raised)."""
    return [f.result() for f in batcher_for(engine).submit(calls, window)]


async def arun_calls(engine: Any, calls: Sequence[EngineCall], window: float) -> list[Outcome]:
    """`run_calls` for a coroutine: waits without holding a thread; cancelling drops queued calls."""
    futures = batcher_for(engine).submit(calls, window)
    return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
