"""A short seeded soak of the served replicas (`benchmarks/soak.py --target serve` runs the long
one, with a replica killed): a few dozen concurrent requests with random settings, stop strings,
schemas and tools, streams left after a few chunks, clients that give up, malformed and oversized
bodies. Every request must end, within its client's limit, answered or refused with a 4xx, 429 or
503 in OpenAI's error shape (or left by its own client), nothing may stay in flight, and a normal
request must be answered afterwards."""
from __future__ import annotations

import asyncio
import time

import pytest

from .conftest import MODEL

pytest.importorskip("ray", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx")

from flashspec_workloads.serve_soak import soak_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[{"role": "user", "content": c}] for c in
           ("Say hi.", "List three rivers.", "Answer in JSON: what is 2 + 2?", "def add(a, b):")]
REQUESTS = 36


def replicas_idle(base: str, timeout_s: float = 60) -> bool:
    """Whether /health says nothing is in flight, twice in a row (the proxy picks a replica each time)."""
    deadline, idle = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline and idle < 4:
        body = httpx.get(base + "/health", timeout=30).json()
        idle = idle + 1 if body.get("in_flight") == 0 else 0
        time.sleep(0.2)
    return idle >= 4


def test_every_request_of_a_short_server_soak_ends_cleanly_and_the_server_answers_after(service, headers):
    url = service[0]
    start = time.monotonic()
    report = asyncio.run(soak_server(url, headers, PROMPTS, requests=REQUESTS, callers=6, seed=5, max_tokens=8,
                                     hang_s=90, model=MODEL))
    kinds = report.by_kind()
    print(f"\nserver soak: {report.requests} requests in {time.monotonic() - start:.0f} s; {kinds}")
    assert report.requests == REQUESTS and report.hung == 0, report.outcomes
    assert report.unclean == {}, report.outcomes  # nothing but answers and clean refusals
    refused = {e.status for e in report.ended if e.status not in (None, 200)}
    assert all(400 <= s < 500 or s == 503 for s in refused), report.outcomes
    malformed = [e for e in report.ended if e.kind in ("bad", "oversized")]
    assert len(malformed) >= 3 and all(e.status is not None and 400 <= e.status < 500 for e in malformed), kinds
    assert any(e.label.startswith("left") for e in report.ended if e.kind in ("disconnect", "abandon")), kinds
    assert report.outcomes["200"] > 0, report.outcomes
    assert report.answered_after
    assert replicas_idle(url.removesuffix("/v1")), "a request stayed in flight after the soak"
