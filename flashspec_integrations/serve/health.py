"""A replica's health: it answers, and its engine decodes.

Ray Serve calls the deployment's `check_health` every few seconds and restarts a replica that fails
it or does not answer in time; `GET /health` (no key needed) runs the same check for a load
balancer. While requests are in flight or the engine is decoding, the replica is healthy without a
decode (the replies show it works, each with a deadline), so a long batch never gets its replica
killed. While idle, a one-token decode of a tiny prompt must finish within `timeout_s`, so a wedged
or broken engine fails; a success counts for `ttl_s`, and concurrent probes share the one running.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any


class EngineUnhealthy(RuntimeError):
    pass


class EngineActivity:
    """`with activity:` around engine work; `busy` while any runs (from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0

    def __enter__(self) -> EngineActivity:
        with self._lock:
            self._running += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._running -= 1

    @property
    def busy(self) -> bool:
        return self._running > 0


class HealthProbe:
    """`await probe.check()`: None when healthy, EngineUnhealthy otherwise."""

    def __init__(self, decode_one: Callable[[], Any], busy: Callable[[], bool],
                 timeout_s: float = 20.0, ttl_s: float = 2.0):
        self._decode_one, self._busy = decode_one, busy
        self.timeout_s, self.ttl_s = timeout_s, ttl_s
        self._last_ok = float("-inf")
        self._running: asyncio.Future | None = None
        self.decodes = 0

    async def check(self) -> str:
        """'busy' or 'ok'; raises EngineUnhealthy when the one-token decode fails or hangs."""
        if self._busy():
            return "busy"
        if time.monotonic() - self._last_ok < self.ttl_s:
            return "ok"
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(asyncio.to_thread(self._decode_one))
            self.decodes += 1
        try:
            await asyncio.wait_for(asyncio.shield(self._running), self.timeout_s)
        except TimeoutError:
            raise EngineUnhealthy(f"a one-token decode took more than {self.timeout_s:g} s on an idle engine") from None
        except Exception as exc:
            raise EngineUnhealthy(f"a one-token decode failed: {type(exc).__name__}: {exc}") from exc
        self._last_ok = time.monotonic()
        return "ok"
