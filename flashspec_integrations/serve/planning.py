"""Request planning off the event loop, with a time limit.

Planning a request (`translate.plan_call`: the chat template, the prompt checks, the tokenizer, the
schema compile) runs on a few threads of its own, so it never stalls the replica's event loop or
its health check; the caller waits at most `timeout_s`. A plan that ran past the limit is the
request's doing (a 400); one that could not start within it, the threads being busy, is the
server's (a 503 with Retry-After). A plan past its limit finishes in the background and its result
is dropped; the schema compile, the one step that could run long, runs in a worker process killed
at its own, shorter limit (`Limits.compile_timeout_s`, flashspec_core/constrained/compile_process.py).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from flashspec_integrations.serve.protocol import APIError

T = TypeVar("T")


class Planner:
    """`await planner.run(fn)`: `fn()` on a planning thread, or APIError once `timeout_s` passes;
    `retry_after()`: the 503's Retry-After in seconds."""

    def __init__(self, timeout_s: float, workers: int = 2, retry_after: Callable[[], int] = lambda: 1):
        if not timeout_s > 0:
            raise ValueError(f"planning_timeout_s must be > 0 seconds; got {timeout_s!r}")
        self.timeout_s, self._retry_after = timeout_s, retry_after
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flashspec-plan")

    async def run(self, fn: Callable[[], T]) -> T:
        started = threading.Event()

        def job() -> T:
            started.set()
            return fn()

        future = asyncio.get_running_loop().run_in_executor(self._pool, job)
        try:
            return await asyncio.wait_for(future, self.timeout_s)  # a plan not yet started is cancelled
        except TimeoutError:
            if started.is_set():
                raise APIError(400, f"the request took longer than {self.timeout_s:g} s to prepare (chat template, "
                                    "tokenizer, JSON schema) and was dropped; send a shorter prompt or a simpler "
                                    "schema (--planning-timeout-s)", code="planning_timeout") from None
            wait = self._retry_after()
            raise APIError(503, f"the server could not start preparing the request within {self.timeout_s:g} s; "
                                f"retry after {wait} s", kind="server_error", code="server_busy",
                           headers={"Retry-After": str(wait)}) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
