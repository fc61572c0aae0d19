"""Back-pressure for one replica: a bounded number of requests in flight, each with a deadline.

A request is admitted when it arrives (before it is parsed or planned) if fewer than `limit`
are in flight on this replica; otherwise it is answered at once with a 429 and a `Retry-After`
estimate, never queued without bound. An admitted request holds its `Ticket` until its reply
(or its stream) ends, and must end by the ticket's deadline: past it the server stops waiting
and answers 504 (a stream gets an error event and is closed, which stops its decode).

Ray Serve's own queue sits in front (`max_ongoing_requests` per replica, `max_queued_requests`
per proxy, a 503 past it); the deployment sets them a little above `limit` so that overload
reaches this count and gets the 429. The engine's scheduler (a bounded queue with deadlines and
cancellation inside the engine) can later take over what this module counts: `Admission` is
the one place the server asks.
"""
from __future__ import annotations

import math
import threading
import time

from flashspec_integrations.serve.protocol import APIError


class Ticket:
    """One admitted request: its deadline, and the slot it holds until `release`."""

    def __init__(self, admission: Admission, deadline: float):
        self._admission, self.deadline = admission, deadline
        self.started = time.monotonic()
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


class Admission:
    """At most `limit` requests in flight, each given `timeout_s` from its arrival to its end."""

    def __init__(self, limit: int, timeout_s: float):
        if limit < 1:
            raise ValueError(f"max_in_flight must be >= 1; got {limit!r}")
        if not timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds; got {timeout_s!r}")
        self.limit, self.timeout_s = limit, timeout_s
        self._lock = threading.Lock()
        self._tickets: set[Ticket] = set()
        self._mean_s = 1.0  # moving average of how long an admitted request holds its slot
        self.admitted = self.refused = 0

    @property
    def in_flight(self) -> int:
        return len(self._tickets)

    def retry_after(self) -> int:
        """Whole seconds until a slot is likely free: a held slot lasts `_mean_s` on average, and
        with `limit` of them held one frees about every `_mean_s / limit` seconds."""
        return max(1, min(60, math.ceil(self._mean_s / max(1, self.in_flight))))

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
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - ticket.started)

    def deadline_error(self) -> APIError:
        return APIError(504, f"the request did not finish within this server's deadline of {self.timeout_s:g} s "
                             "(--request-timeout); ask for fewer tokens, or retry when the server is less busy",
                        kind="server_error", code="deadline_exceeded")

    def info(self) -> dict[str, int]:
        return {"in_flight": self.in_flight, "max_in_flight": self.limit,
                "admitted": self.admitted, "refused": self.refused}
