"""A stream past its deadline, or left by its client, stops its decode and frees its slot (the
replica's stream code driven without Ray, over an engine whose steps take a set time)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="needs the 'serve' extra")
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.results import StreamChunk
from flashspec_integrations.domain_rules import DomainDecision
from flashspec_integrations.plan import CallPlan
from flashspec_integrations.serve.admission import Admission
from flashspec_integrations.serve.deployment import FlashSpecServer
from flashspec_integrations.serve.health import EngineActivity

# The replica object is made without Ray's ingress set-up, whose wrapper has an async __del__.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")

PLAN = CallPlan([1, 2, 3], "", 50, SamplingParams(), (), DomainDecision("chat", None, "explicit"))


class SlowEngine:
    """`astream` yields one chunk every `step_s` seconds, 50 in all, ends at its `timeout` with
    TimeoutError (as the engine does, at a step boundary), and records how far it got."""

    def __init__(self, step_s: float):
        self.step_s, self.steps, self.closed, self.running = step_s, 0, threading.Event(), 0

    async def astream(self, prompt_ids, options):
        start, timeout = time.monotonic(), options.timeout
        try:
            for _ in range(50):
                await asyncio.sleep(self.step_s)
                if timeout is not None and time.monotonic() - start > timeout:
                    raise TimeoutError("the request ran past its timeout")
                self.steps += 1
                yield StreamChunk("x", [7])
        finally:
            self.closed.set()


def replica(engine: SlowEngine, timeout_s: float):
    """A replica object without Ray: the attributes its stream code reads."""
    server = object.__new__(FlashSpecServer.func_or_class)
    server.engine, server.model_name, server.replica = engine, "m", "r"
    server.shared = SimpleNamespace(sync=lambda: 0, info=lambda: {})
    server.admission, server.activity = Admission(4, timeout_s), EngineActivity()
    return server


async def collect(server, ticket, limit: int | None = None) -> list[str]:
    events = server._events(PLAN, "cid", False, ticket, "rid")
    out = []
    async for event in events:
        out.append(event)
        if limit is not None and len(out) >= limit:
            break
    await events.aclose()
    return out


def test_a_stream_past_its_deadline_gets_an_error_event_and_its_decode_stops():
    engine = SlowEngine(step_s=0.05)
    server = replica(engine, timeout_s=0.3)
    ticket = server.admission.admit()
    events = asyncio.run(collect(server, ticket))
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "deadline_exceeded" and "0.3 s" in error["message"]
    assert engine.closed.wait(2) and engine.steps < 20  # stopped long before its 50 steps
    assert server.admission.in_flight == 0 and not server.activity.busy


def test_a_client_leaving_stops_the_decode_and_frees_the_slot():
    engine = SlowEngine(step_s=0.02)
    server = replica(engine, timeout_s=60)
    ticket = server.admission.admit()
    events = asyncio.run(collect(server, ticket, limit=3))  # the role chunk and two pieces
    assert len(events) == 3 and engine.closed.wait(2) and engine.steps < 10
    assert server.admission.in_flight == 0
    time.sleep(0.05)
    assert not server.activity.busy
