"""Back-pressure for one replica: a bounded number of requests in flight, each with a deadline.

A request is admitted once its body is in (before it is parsed or planned) if fewer than `limit`
are in flight on this replica, else answered at once with a 429 and a `Retry-After` estimate. An
admitted request holds its `Ticket` until its reply (or stream) ends, and must end by the ticket's
deadline: past it the server answers 504 (a stream gets an error event and is closed, which stops
its decode). `Retry-After` (every 429 and 503 of the replica) is the time the requests ahead take
to drain at the recent completion rate (`DrainRate`). The deployment sets Ray Serve's own queues a
little above `limit` so that overload reaches this count. Why: docs/serve.md, "Exposing the server".
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from flashspec_integrations.serve.protocol import APIError


class Ticket:
    """One admitted request: its deadline, and the slot it holds until `release`."""

    def __init__(self, admission: Admission, deadline: float):
        self._admission, self.deadline = admission, deadline
        self._released = False

    def remaining(self) -> float:
        """Seconds left before the deadline (0 once it has passed)."""
        return max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def release(self) -> None:
        """Free the slot (idempotent: a reply and its stream's end may both call it)."""
        if not self._released:
            self._released = True
            self._admission._release(self)


class DrainRate:
    """Requests completed per second over the last `window_s` seconds, and the whole seconds a
    backlog takes to drain at that rate (a `Retry-After`), within 1..`max_s`."""

    def __init__(self, window_s: float = 30.0, max_s: int = 60, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.max_s, self._clock = window_s, max_s, clock
        self._since = clock()  # a younger replica measures over its life so far
        self._done: deque[float] = deque()
        self._lock = threading.Lock()  # completions come from the event loop and from finalizers

    def record(self) -> None:
        """One request completed now."""
        with self._lock:
            self._done.append(self._clock())

    def per_second(self) -> float:
        now = self._clock()
        with self._lock:
            while self._done and self._done[0] <= now - self.window_s:
                self._done.popleft()
            done = len(self._done)
        return done / max(1.0, min(self.window_s, now - self._since))

    def retry_after(self, waiting: int) -> int:
        """Seconds until `waiting` requests ahead and this one's own slot have drained; `max_s`
        when none completed within the window."""
        rate = self.per_second()
        if rate == 0:
            return self.max_s
        return max(1, min(self.max_s, math.ceil((waiting + 1) / rate)))


class Admission:
    """At most `limit` requests in flight, each given `timeout_s` from its arrival to its end;
    `queued()`: the requests waiting behind those in flight (the engine's queue), for Retry-After."""

    def __init__(self, limit: int, timeout_s: float, queued: Callable[[], int] = lambda: 0):
        if limit < 1:
            raise ValueError(f"max_in_flight must be >= 1; got {limit!r}")
        if not timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds; got {timeout_s!r}")
        self.limit, self.timeout_s = limit, timeout_s
        self._lock = threading.Lock()
        self._tickets: set[Ticket] = set()
        self._queued, self.drain = queued, DrainRate()
        self.admitted = self.refused = 0

    @property
    def in_flight(self) -> int:
        return len(self._tickets)

    def retry_after(self) -> int:
        """Whole seconds until a request sent now likely finds a slot: the engine's queue drained
        at the recent completion rate, then one more completion; 1 while nothing is in flight."""
        if not self._tickets:
            return 1
        return self.drain.retry_after(self._queued())

    def admit(self) -> Ticket:
        """A ticket for a new request, or APIError(429) with `retry_after` when the replica is full."""
        with self._lock:
            if len(self._tickets) < self.limit:
                ticket = Ticket(self, time.monotonic() + self.timeout_s)
                self._tickets.add(ticket)
                self.admitted += 1
                return ticket
            self.refused += 1
        wait = self.retry_after()
        raise APIError(429, f"this replica is serving its limit of {self.limit} requests at once "
                            f"(--max-in-flight); retry after {wait} s", kind="rate_limit_error",
                       code="server_busy", headers={"Retry-After": str(wait)})

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            self._tickets.discard(ticket)
            self.drain.record()

    def deadline_error(self) -> APIError:
        return APIError(504, f"the request did not finish within this server's deadline of {self.timeout_s:g} s "
                             "(--request-timeout); ask for fewer tokens, or retry when the server is less busy",
                        kind="server_error", code="deadline_exceeded")

    def info(self) -> dict[str, int]:
        return {"in_flight": self.in_flight, "max_in_flight": self.limit,
                "admitted": self.admitted, "refused": self.refused}
