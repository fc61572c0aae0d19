"""Each client's turn at the grammar compilers, so that one client's schemas cannot starve another's.

A replica prepares requests on two planning threads and compiles schemas in two worker processes,
and a slow schema holds one of each for up to `--compile-timeout-s`. So one client has at most
`limit` requests with a schema being prepared at once on a replica; its others wait their turn on
the event loop, holding no thread and no worker, and one whose turn does not come within
`timeout_s` is a 429 with Retry-After. A client is its address as Ray Serve's proxy saw it: behind
a load balancer that hides the clients' addresses they are all one client, so raise the limit
there (`--max-compiles-per-client`). Why: docs/serve.md, "Exposing the server".
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from flashspec_integrations.serve.protocol import APIError


@dataclass
class _Client:
    turns: asyncio.Semaphore
    waiting: int = field(default=0)  # requests holding or awaiting a turn: the entry goes at 0


class CompileTurns:
    """`async with turns.turn(client, retry_after):` around the planning of a request with a schema."""

    def __init__(self, limit: int, timeout_s: float):
        if limit < 1:
            raise ValueError(f"max_compiles_per_client must be >= 1; got {limit!r}")
        self.limit, self.timeout_s = limit, timeout_s
        self._clients: dict[str, _Client] = {}

    def clients(self) -> int:
        """Clients with a request holding or awaiting a turn now."""
        return len(self._clients)

    @asynccontextmanager
    async def turn(self, client: str, retry_after: int) -> AsyncIterator[None]:
        """Wait for one of `client`'s `limit` turns, at most `timeout_s`: past it APIError(429)."""
        entry = self._clients.setdefault(client, _Client(asyncio.Semaphore(self.limit)))
        entry.waiting += 1
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await entry.turns.acquire()
            except TimeoutError:
                raise APIError(429, f"this client's other requests with a schema ({self.limit} at once, "
                                    f"--max-compiles-per-client) held the grammar compilers for {self.timeout_s:g} s; "
                                    f"retry after {retry_after} s", kind="rate_limit_error", code="server_busy",
                               headers={"Retry-After": str(retry_after)}) from None
            try:
                yield
            finally:
                entry.turns.release()
        finally:
            entry.waiting -= 1
            if entry.waiting == 0:
                del self._clients[client]
