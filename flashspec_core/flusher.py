"""The router's statistics written off the device thread, and answers handed over once they are.

The scheduler's thread owns the device and must never wait on a disk: a store write can wait
seconds for another process's lock, and a failing one must not be the device thread's failure.
So the router's queued statistics are written by this small thread, when the scheduler asks (a
request ended, or every few steps). A finished request's answer goes out through it too, after
the write that holds its steps: a caller that reads the router's store after its answer finds
them there. A failed write is logged and delays no answer (the router keeps what it held queued
for the next write): statistics never stop generation.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Flusher:
    """Calls `flush` on a thread of its own when asked, then the callbacks queued before it.

    idle: seconds without a request after which the thread ends (the next request starts another).
    """

    def __init__(self, flush: Callable[[], None], idle: float = 2.0) -> None:
        self._flush = flush
        self._idle = idle
        self._cond = threading.Condition()
        self._wanted = False
        self._after: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self.failures = 0  # flushes that raised

    def request(self, then: Callable[[], None] | None = None) -> None:
        """Ask for a flush (soon, not now: this returns at once); `then` runs after it."""
        with self._cond:
            self._wanted = True
            if then is not None:
                self._after.append(then)
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flashspec-stats", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._wanted, self._idle):
                    self._thread = None
                    return
                self._wanted = False
                after, self._after = self._after, []
            try:
                self._flush()
            except Exception:  # the statistics stay queued; the answers go out
                self.failures += 1
                logger.warning("writing the router's statistics failed; they stay queued for a later write",
                               exc_info=True)
            for then in after:
                try:
                    then()
                except Exception:  # one caller's failure is not the next one's
                    logger.exception("handing over an answer failed")
