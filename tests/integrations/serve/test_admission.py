"""Back-pressure, the planning time limit and the health probe, without Ray or a model."""
from __future__ import annotations

import asyncio
import gc
import threading
import types

import pytest

from flashspec_integrations.serve import admission as admission_module
from flashspec_integrations.serve.admission import Admission, DrainRate
from flashspec_integrations.serve.health import EngineActivity, EngineUnhealthy, HealthProbe
from flashspec_integrations.serve.planning import Planner
from flashspec_integrations.serve.protocol import APIError


def test_past_the_limit_a_request_gets_a_429_with_retry_after_and_a_freed_slot_admits_again():
    admission = Admission(limit=2, timeout_s=60)
    a, b = admission.admit(), admission.admit()
    with pytest.raises(APIError) as err:
        admission.admit()
    assert (err.value.status == 429 and "limit of 2 requests" in err.value.message
            and "--max-in-flight" in err.value.message)
    assert int(err.value.headers["Retry-After"]) >= 1 and err.value.body()["error"]["type"] == "rate_limit_error"
    a.release()
    a.release()  # idempotent: a reply and its stream's end may both release
    assert admission.in_flight == 1
    c = admission.admit()
    assert admission.info() == {"in_flight": 2, "max_in_flight": 2, "admitted": 3, "refused": 1}
    b.release(), c.release()
    assert admission.in_flight == 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def drained(completions: int, over_s: float, window_s: float = 30.0) -> DrainRate:
    """A DrainRate that saw `completions` spread evenly over the last `over_s` seconds."""
    clock = Clock()
    rate = DrainRate(window_s=window_s, clock=clock)
    for _ in range(completions):
        clock.now += over_s / completions
        rate.record()
    return rate


def test_retry_after_is_the_backlog_over_the_recent_drain_rate_in_whole_seconds_within_1_to_60():
    fast, slow = drained(30, 30.0), drained(6, 30.0)  # 1/s and 0.2/s
    assert fast.per_second() == pytest.approx(1.0) and slow.per_second() == pytest.approx(0.2)
    assert [fast.retry_after(n) for n in (0, 4, 9)] == [1, 5, 10]  # (ahead + this one) / rate
    assert [slow.retry_after(n) for n in (0, 4, 9)] == [5, 25, 50]
    assert slow.retry_after(100) == 60 and drained(300, 30.0).retry_after(0) == 1  # bounded both ways
    waits = [slow.retry_after(n) for n in range(20)]
    assert waits == sorted(waits) and all(isinstance(w, int) for w in waits)  # never falls as the queue grows
    assert all(slow.retry_after(n) >= fast.retry_after(n) for n in range(20))
    young = drained(4, 2.0)  # a replica 2 s old that completed 4: 2 per second, not 4 / 30
    assert young.retry_after(3) == 2
    assert DrainRate().retry_after(0) == 60  # nothing completed: the longest wait


def test_completions_older_than_the_window_stop_counting():
    rate = drained(30, 30.0, window_s=10.0)  # 1/s; the window keeps the last 10 s
    assert rate.per_second() == pytest.approx(1.0)
    rate._clock.now += 5  # nothing completes for 5 s: half the window's completions age out
    assert rate.per_second() == pytest.approx(0.5) and rate.retry_after(1) == 4
    rate._clock.now += 10
    assert rate.per_second() == 0 and rate.retry_after(0) == 60


def test_an_admission_retry_after_uses_the_engines_queue_and_its_completions():
    queue = [0]
    admission = Admission(limit=1, timeout_s=60, queued=lambda: queue[0])
    assert admission.retry_after() == 1  # nothing in flight: a slot is free now
    admission.drain = drained(10, 30.0)  # 1/3 per second
    held = admission.admit()
    assert admission.retry_after() == 3
    queue[0] = 5
    with pytest.raises(APIError) as err:
        admission.admit()
    assert err.value.headers["Retry-After"] == "18" and "retry after 18 s" in err.value.message
    held.release()


def test_a_ticket_counts_down_to_its_deadline(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(admission_module, "time", types.SimpleNamespace(monotonic=clock))
    admission = Admission(limit=1, timeout_s=0.05)
    ticket = admission.admit()
    assert ticket.remaining() == pytest.approx(0.05) and not ticket.expired()
    clock.now += 0.03
    assert ticket.remaining() == pytest.approx(0.02) and not ticket.expired()
    clock.now += 0.03
    assert ticket.remaining() == 0 and ticket.expired()
    error = admission.deadline_error()
    assert error.status == 504 and "--request-timeout" in error.message and error.code == "deadline_exceeded"
    with pytest.raises(ValueError, match="max_in_flight"):
        Admission(0, 1)
    with pytest.raises(ValueError, match="request_timeout_s"):
        Admission(1, 0)


def test_a_slow_plan_is_a_400_and_a_plan_that_cannot_start_a_503():
    async def scenario() -> None:
        roomy = Planner(timeout_s=30, workers=1)
        assert await roomy.run(lambda: 7) == 7
        ticked = threading.Event()

        async def tick() -> None:
            for _ in range(5):
                await asyncio.sleep(0.01)
            ticked.set()

        ticker = asyncio.create_task(tick())
        # A plan's CPU work runs on its thread: the event loop ticks on meanwhile (this plan ends
        # only when it has ticked 5 times; a plan run on the loop would wait out its 10 s).
        assert await roomy.run(lambda: ticked.wait(10)) is True
        await ticker
        roomy.close()
        # A limit of 1 s: long enough for a busy machine to start a plan on the idle thread.
        planner = Planner(timeout_s=1.0, workers=1, retry_after=lambda: 17)
        assert await planner.run(lambda: 7) == 7
        release = threading.Event()
        with pytest.raises(APIError) as slow:
            await planner.run(lambda: release.wait(30))  # starts, then runs past the limit
        assert slow.value.status == 400 and "longer than 1 s to prepare" in slow.value.message
        ran = []
        with pytest.raises(APIError) as queued:  # the one thread is still busy: never starts
            await planner.run(lambda: ran.append(1))
        assert queued.value.status == 503 and queued.value.headers["Retry-After"] == "17"
        release.set()
        assert await planner.run(lambda: 8) == 8 and ran == []  # the dropped plan never ran
        planner.close()

    asyncio.run(scenario())


def test_the_probe_decodes_when_idle_skips_when_busy_and_fails_a_hung_or_broken_engine():
    async def scenario() -> None:
        busy, calls = [False], []
        probe = HealthProbe(lambda: calls.append(1), busy=lambda: busy[0], timeout_s=0.2, ttl_s=0.0)
        assert await probe.check() == "ok" and calls == [1]
        busy[0] = True
        assert await probe.check() == "busy" and calls == [1]  # a long batch never fails its replica

        hang = threading.Event()
        hung = HealthProbe(lambda: hang.wait(5), busy=lambda: False, timeout_s=0.1)
        with pytest.raises(EngineUnhealthy, match="more than 0.1 s"):
            await hung.check()
        hang.set()

        def broken() -> None:
            raise RuntimeError("CUDA error")

        with pytest.raises(EngineUnhealthy, match="RuntimeError: CUDA error"):
            await HealthProbe(broken, busy=lambda: False).check()

        cached = HealthProbe(lambda: calls.append(2), busy=lambda: False, ttl_s=60)
        await asyncio.gather(*(cached.check() for _ in range(5)))
        await cached.check()
        assert calls.count(2) == 1 and cached.decodes == 1  # concurrent probes share one decode

    asyncio.run(scenario())


def test_engine_activity_counts_work_from_any_thread():
    activity = EngineActivity()
    inside = threading.Event()
    leave = threading.Event()

    def work() -> None:
        with activity:
            inside.set()
            leave.wait(5)

    thread = threading.Thread(target=work)
    thread.start()
    inside.wait(5)
    assert activity.busy
    leave.set()
    thread.join()
    assert not activity.busy


def test_a_stream_that_never_started_frees_its_slot():
    """The server ties a stream's ticket to its generator (weakref.finalize): a response dropped
    before its first chunk (the client left) frees the slot when the generator is collected."""
    import weakref

    admission = Admission(limit=1, timeout_s=60)
    ticket = admission.admit()

    async def events():
        try:
            yield "data"
        finally:
            ticket.release()

    gen = events()
    weakref.finalize(gen, ticket.release)
    del gen
    gc.collect()
    assert admission.in_flight == 0
