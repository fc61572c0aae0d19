"""A short seeded soak of the default engine (benchmarks/soak.py runs the long one): four callers
for 20 s with random settings, streams abandoned, cancels, deadlines, schemas and bad input. Every
request ends as its kind expects, and nothing is left in the batch or the queue."""
from __future__ import annotations

import pytest

from flashspec_workloads.soak import soak

pytestmark = pytest.mark.slow

PROMPTS = [[{"role": "user", "content": c}] for c in
           ("Say hi.", "List three rivers.", "Answer in JSON: what is 2 + 2?", "def add(a, b):")]


def test_every_request_of_a_soak_ends_and_nothing_leaks(default_engine):
    report = soak(default_engine, PROMPTS, seconds=20, callers=4, seed=3, hang_s=60)
    assert report.hung == 0, report
    assert report.unexpected == {}, report
    assert (report.running, report.queued) == (0, 0), report
    for outcome in ("ok", "cancelled", "deadline", "bad_input"):
        assert report.outcomes[outcome] > 0, f"no request ended {outcome!r}: {report}"
