"""Where a request's output goes: the scheduler's thread writes, the caller reads (blocking or async).

The scheduler loop owns the device and never waits on a caller: it posts each step's text to the
request's `RequestHandle` and moves on. A caller waits on its own handle only, from a thread
(`wait`, iteration) or from an event loop (`wait_async`, async iteration) without holding a thread;
`cancel` (or a closed stream) ends a queued request at once and a running one's rows at the next
step boundary; a deadline is checked between steps, for queued requests as for running ones.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from flashspec_core.results import GenerationResult, StreamChunk


class RequestCancelled(Exception):
    """The request was cancelled before it finished (its caller closed a stream or cancelled it)."""


class EngineFault(RuntimeError):
    """A part of the engine (named in the message: a draft, the router) failed while serving this
    request; the failure is chained as its cause. The engine goes on serving its other requests."""

    @classmethod
    def of(cls, what: str, cause: BaseException) -> EngineFault:
        """`what` failed with `cause`: "<what> failed: <cause>", chained to it."""
        fault = cls(f"{what} failed: {cause!r}")
        fault.__cause__ = cause
        return fault


class RequestHandle:
    """The output channel of one request of `rows` rows; `stream` requests also get every step's chunk."""

    def __init__(self, rows: int, stream: bool = False) -> None:
        self.stream = stream
        self.results: list[GenerationResult | None] = [None] * rows
        self.error: BaseException | None = None
        self.cancelled = False
        self._chunks: deque[StreamChunk] = deque()
        self._cond = threading.Condition()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._on_cancel: Callable[[], None] | None = None  # the scheduler's: a queued request leaves at once

    # ------------------------------------------------------------------ the scheduler's side

    @property
    def done(self) -> bool:
        return self.error is not None or all(r is not None for r in self.results)

    def _notify(self) -> None:
        """Under the lock: wake blocking and async readers."""
        self._cond.notify_all()
        for loop, event in list(self._waiters):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the reader's loop is closed: it is gone
                self._waiters.discard((loop, event))

    def post(self, chunk: StreamChunk) -> None:
        """A streamed row's new text (not kept for non-streaming requests)."""
        if self.stream:
            with self._cond:
                self._chunks.append(chunk)
                self._notify()

    def finish(self, index: int, result: GenerationResult) -> None:
        """Row `index` ended with `result`."""
        with self._cond:
            self.results[index] = result
            self._notify()

    def fail(self, error: BaseException) -> None:
        """The request ended without a result: every reader gets `error`."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._notify()

    # ------------------------------------------------------------------ the caller's side

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """The scheduler's: call `callback` from the cancelling thread when the request is
        cancelled (at once if it already was), so that a request still queued ends without
        waiting for a slot."""
        with self._cond:
            self._on_cancel = callback
            already = self.cancelled
        if already:
            callback()

    def cancel(self) -> None:
        """End the request: at once if it is still queued, else its rows at the next step
        boundary; readers then get RequestCancelled."""
        with self._cond:
            self.cancelled = True
            callback = self._on_cancel
        if callback is not None:  # outside the lock: the callback takes the scheduler's, then this one
            callback()

    def _take(self) -> list[StreamChunk] | None:
        """Under the lock: the chunks posted since the last take, or None at the end of the stream."""
        if self._chunks:
            chunks = list(self._chunks)
            self._chunks.clear()
            return chunks
        if self.error is not None:
            raise self.error
        return None if self.done else []

    def _results(self) -> list[GenerationResult]:
        if self.error is not None:
            raise self.error
        return [r for r in self.results if r is not None]

    def wait(self, timeout: float | None = None) -> list[GenerationResult]:
        """Block until every row has finished; its results, or the request's error."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"the request did not finish within {timeout} s")
            return self._results()

    def __iter__(self) -> Iterator[StreamChunk]:
        """A stream's chunks as they are posted (blocking between them)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._chunks) or self.done)
                chunks = self._take()
            if chunks is None:
                return
            yield from chunks

    async def _until(self, ready: Callable[[], bool]) -> None:
        """Wait on the running event loop until `ready()` holds (checked under the lock after each post)."""
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        with self._cond:
            if ready():
                return
            self._waiters.add(waiter)
        try:
            await event.wait()
        finally:
            with self._cond:
                self._waiters.discard(waiter)

    async def wait_async(self) -> list[GenerationResult]:
        """`wait` for a coroutine: no thread is held while the rows decode."""
        while True:
            with self._cond:
                if self.done:
                    return self._results()
            await self._until(lambda: self.done)

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        while True:
            with self._cond:
                chunks = self._take()
            if chunks is None:
                return
            for chunk in chunks:
                yield chunk
            if not chunks:
                await self._until(lambda: bool(self._chunks) or self.done)
