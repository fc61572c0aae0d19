"""Run the blocking engine off the event loop, for the adapter's async methods.

Decoding is CPU/GPU-bound and holds no await points, so calling it inside a coroutine would
freeze every other task (an agent's tool calls, a server's other requests) for the whole
generation. One-shot calls go to the default thread pool through `asyncio.to_thread`; streams
get a producer thread each that hands chunks to the loop through a queue, because the engine's
stream must be iterated by one thread from start to end (it holds the engine's lock meanwhile).
Both copy the caller's context variables, so instrumentation tags and template hints set by
the caller are seen by the worker.
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import AsyncIterator, Callable, Iterator, TypeVar

T = TypeVar("T")

_ITEM, _DONE, _ERROR = "item", "done", "error"


async def run_in_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` in a worker thread, with the caller's context variables."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Iterate a blocking iterator in a dedicated thread and yield its items on the event loop.

    If the consumer stops early (break, aclose, cancellation), the producer stops before the
    next item and closes the iterator in its own thread, which releases the engine.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stopped = threading.Event()
    context = contextvars.copy_context()

    def post(kind: str, value: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            stopped.set()

    def produce() -> None:
        try:
            iterator = make_iterator()
            try:
                for item in iterator:
                    if stopped.is_set():
                        break
                    post(_ITEM, item)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
            post(_DONE, None)
        except BaseException as exc:  # handed to the consumer, who re-raises it
            post(_ERROR, exc)

    thread = threading.Thread(target=context.run, args=(produce,), name="flashspec-astream", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == _DONE:
                return
            if kind == _ERROR:
                raise value  # type: ignore[misc]
            yield value  # type: ignore[misc]
    finally:
        stopped.set()
