"""Iterate a blocking engine stream from a coroutine without blocking the event loop.

A stream gets a producer thread of its own that hands items to the loop through a queue (not one
of the loop's few default executor workers, which a long stream would hold); the thread mostly
waits on the engine's request handle while the engine's scheduler thread decodes. The producer
runs in a copy of the caller's context variables, so run configs, instrumentation tags and
template hints set by the caller are seen there, and it turns the engine's chunks into the
framework's. Non-streaming async calls need no thread: they await the request's handle
(`calls.arun_calls`). Why: docs/adapters.md, "Concurrent calls".
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

_ITEM, _DONE, _ERROR = "item", "done", "error"


async def aiter_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncGenerator[T, None]:
    """Yield the items of `make_iterator()` (called in the producer thread: it may load weights).

    If the consumer stops early (break, aclose, cancellation), the producer stops before the next
    item and closes the iterator in its own thread, which releases the engine.
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

    threading.Thread(target=context.run, args=(produce,), name="flashspec-astream", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == _DONE:
                return
            if kind == _ERROR:
                raise value
            yield value
    finally:
        stopped.set()
