"""The scheduler survives faults: whatever raises in a step or in its bookkeeping (a draft, the
router's learning or its store writes, the runner), every request ends with a result or an error
that names what failed, no request waits forever, the next request is served, and the router's
statistics on disk are those of the steps that ran, each counted once.

Every wait is bounded (`handle.wait(timeout=...)`, and the module's pytest timeout): a request that
is never answered fails its test instead of blocking the suite.
"""
from __future__ import annotations

import sqlite3
import warnings

import pytest

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.handle import EngineFault
from flashspec_core.routing import BanditRouter, RouterStore

pytestmark = [pytest.mark.usefixtures("torch_one_thread"), pytest.mark.timeout(120)]

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 2, 8, 1, 8, 2, 8, 1, 8, 2], [6, 6, 6, 6, 1, 6, 6, 6]]
ARMS = [Arm(NO_DRAFT, 0), Arm("prompt_lookup", 2), Arm("prompt_lookup", 4)]
WAIT = 20.0  # seconds: far more than any of these requests takes; past it the request hung
NEW = 16  # tokens per request


class Injected(RuntimeError):
    """The planted failure."""


class Faults:
    """Wraps `obj.name` so that the calls numbered in `failing` (1-based; "all": every call while
    `on`) raise Injected; counts the calls that went through."""

    def __init__(self, monkeypatch, obj, name: str, failing=(1,)):
        self.real, self.failing, self.calls, self.passed, self.on = getattr(obj, name), failing, 0, [], True

        def wrapper(*args, **kwargs):
            self.calls += 1
            if self.on and (self.failing == "all" or self.calls in self.failing):
                raise Injected(f"{name} failed (planted, call {self.calls})")
            out = self.real(*args, **kwargs)
            self.passed.append(args)
            return out

        monkeypatch.setattr(obj, name, wrapper)


def store_engine(tiny_target, tmp_path) -> tuple[SpecEngine, BanditRouter, RouterStore]:
    store = RouterStore(tmp_path / "router.sqlite3")
    router = BanditRouter(ARMS, store=store, seed=0)
    engine = SpecEngine(tiny_target, [PromptLookupDraft()], router=router, verify_backend="torch")
    return engine, router, store


@pytest.fixture
def expected(tiny_target) -> list[list[int]]:
    """Each prompt's greedy output, from an engine without faults (equal to HF's: test_scheduler)."""
    engine = SpecEngine(tiny_target, [PromptLookupDraft()], router=BanditRouter(ARMS, seed=0), verify_backend="torch")
    return [engine.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS]


def outcomes(handles) -> list[object]:
    """Each request's token ids, or the error it ended with; a request not answered in WAIT fails."""
    out: list[object] = []
    for handle in handles:
        try:
            out.append(handle.wait(timeout=WAIT)[0].token_ids)
        except TimeoutError as exc:
            if "did not finish" in str(exc):
                pytest.fail(f"a request was never answered: {exc}")
            out.append(exc)
        except Exception as exc:  # the error is the outcome under test
            out.append(exc)
    return out


def three_together(engine: SpecEngine) -> list[object]:
    return outcomes([engine.submit([p], max_new_tokens=NEW) for p in PROMPTS])


def assert_served_and_consistent(engine: SpecEngine, router: BanditRouter, store: RouterStore, expected,
                                 update: Faults | None = None) -> None:
    """A new request is served exactly; then (its answer waited for the write of every statistic
    queued before it) the store holds what the router learned, each step once."""
    assert engine.generate(PROMPTS[0], max_new_tokens=NEW).token_ids == expected[0]
    disk = store.read()
    memory = router.summary()
    assert set(disk) == set(memory)
    for domain, arms in memory.items():
        for arm, seen in arms.items():
            on_disk = disk[domain].arms.get(arm)
            assert (on_disk.pulls if on_disk else 0) == seen["pulls"], (domain, arm)
            assert (on_disk.scored if on_disk else 0) == seen["scored"], (domain, arm)
    if update is not None:  # each step the router learned pulled its arm once (a first step pulls none)
        learned = sum(not record.prefilled for (record,) in update.passed)
        assert sum(a.pulls for d in disk.values() for a in d.arms.values()) == learned


# ------------------------------------------------------------------------ the router's store writes

@pytest.mark.parametrize("failing", [(1,), "all"], ids=["once", "repeatedly"])
def test_a_failing_store_write_delays_no_answer_and_loses_no_statistic(tiny_target, tmp_path, monkeypatch, expected,
                                                                      failing):
    """The router's flush raises (once, or every time until the store recovers) while three rows
    decode together: all three get their exact answers, and the statistics are written later."""
    engine, router, store = store_engine(tiny_target, tmp_path)
    flush = Faults(monkeypatch, router, "flush", failing)
    update = Faults(monkeypatch, router, "update", ())
    assert three_together(engine) == expected
    assert flush.calls >= 1
    flush.on = False
    assert_served_and_consistent(engine, router, store, expected, update)


def test_a_store_made_read_only_mid_run_keeps_the_statistics_for_a_later_write(tiny_target, tmp_path, monkeypatch,
                                                                               expected):
    """The store's file turns read-only while requests run (SQLite's query_only: the write fails
    with SQLITE_READONLY as for a read-only file; root, which these tests may run as, ignores
    permission bits): answers go out, nothing is lost, and once it is writable again every step
    is on disk once."""
    engine, router, store = store_engine(tiny_target, tmp_path)
    update = Faults(monkeypatch, router, "update", ())
    assert engine.generate(PROMPTS[1], max_new_tokens=NEW).token_ids == expected[1]
    with store._lock:
        store._conn.execute("PRAGMA query_only = 1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "router store write failed", said once
        assert three_together(engine) == expected
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        store.record("probe", {})
    with store._lock:
        store._conn.execute("PRAGMA query_only = 0")
    assert_served_and_consistent(engine, router, store, expected, update)


# ------------------------------------------------------------------------ the router's learning

def test_a_router_update_failing_once_ends_that_rows_request_only(tiny_target, tmp_path, monkeypatch, expected):
    engine, router, store = store_engine(tiny_target, tmp_path)
    update = Faults(monkeypatch, router, "update", (2,))
    results = three_together(engine)
    failed = [r for r in results if isinstance(r, Exception)]
    assert len(failed) == 1 and isinstance(failed[0], EngineFault) and "router" in str(failed[0])
    assert isinstance(failed[0].__cause__, Injected)
    assert [r for r in results if not isinstance(r, Exception)] == [e for e, r in zip(expected, results)
                                                                    if not isinstance(r, Exception)]
    assert_served_and_consistent(engine, router, store, expected, update)


def test_a_router_update_failing_every_time_fails_each_request_and_the_engine_recovers(tiny_target, tmp_path,
                                                                                      monkeypatch, expected):
    engine, router, store = store_engine(tiny_target, tmp_path)
    update = Faults(monkeypatch, router, "update", "all")
    for _ in range(2):
        results = three_together(engine)
        assert all(isinstance(r, EngineFault) and "update" in str(r) for r in results), results
    update.on = False
    assert_served_and_consistent(engine, router, store, expected, update)


# ------------------------------------------------------------------------ drafts

def test_a_draft_failing_at_end_ends_that_request_and_the_loop_survives_it_failing_again(
        tiny_target, tmp_path, monkeypatch, expected):
    """A draft's `end` raises for every retiring row: each request ends with an error naming it
    (the old loop lost the retiring request, then died retiring the others), the next is served."""
    engine, router, store = store_engine(tiny_target, tmp_path)
    draft = engine.drafts["prompt_lookup"]
    end = Faults(monkeypatch, draft, "end", "all")
    results = three_together(engine)
    assert all(isinstance(r, EngineFault) and "'prompt_lookup' (end)" in str(r) for r in results), results
    end.on = False
    assert_served_and_consistent(engine, router, store, expected)


def test_a_draft_failing_at_begin_ends_that_request_only(tiny_target, tmp_path, monkeypatch, expected):
    engine, router, store = store_engine(tiny_target, tmp_path)
    Faults(monkeypatch, engine.drafts["prompt_lookup"], "begin", (2,))
    results = three_together(engine)
    assert isinstance(results[1], EngineFault) and "(begin)" in str(results[1])
    assert [results[0], results[2]] == [expected[0], expected[2]]
    assert_served_and_consistent(engine, router, store, expected)


@pytest.mark.parametrize("failing", [(1,), (2,), (4,)])
def test_a_prefix_copy_failing_ends_that_rows_request_only(tiny_target, tmp_path, monkeypatch, expected, failing):
    """`share_prefix` fails at a row's admission or at a later turn: that request ends naming it,
    the others are served exactly, and the engine serves on."""
    engine, router, store = store_engine(tiny_target, tmp_path)
    fault = Faults(monkeypatch, engine.runner, "share_prefix", failing)
    results = three_together(engine)
    failed = [r for r in results if isinstance(r, EngineFault)]
    assert len(failed) == 1 and "copying a cached prefix" in str(failed[0]), results
    assert [r for r in results if not isinstance(r, EngineFault)] == [
        e for r, e in zip(results, expected) if not isinstance(r, EngineFault)]
    fault.on = False
    assert_served_and_consistent(engine, router, store, expected)


def test_a_draft_failing_to_propose_once_costs_no_request(tiny_target, tmp_path, monkeypatch, expected):
    """A transient failure inside a step: the rows are stepped one at a time and all go on."""
    engine, router, store = store_engine(tiny_target, tmp_path)
    Faults(monkeypatch, engine.drafts["prompt_lookup"], "propose", (3,))
    assert three_together(engine) == expected
    assert_served_and_consistent(engine, router, store, expected)


# ------------------------------------------------------------------------ the runner

def test_the_runner_failing_mid_step_once_costs_no_request(tiny_target, tmp_path, monkeypatch, expected):
    engine, router, store = store_engine(tiny_target, tmp_path)
    forward = Faults(monkeypatch, engine.runner, "score_rows", (6,))  # every forward of a step or prefill
    assert three_together(engine) == expected
    assert forward.calls > 6
    assert_served_and_consistent(engine, router, store, expected)


def test_the_runner_failing_for_one_row_ends_that_request_only(tiny_target, tmp_path, monkeypatch, expected):
    engine, router, store = store_engine(tiny_target, tmp_path)
    real = engine.runner.score_rows
    poisoned = PROMPTS[1]

    def score_rows(sequences, needs):
        if any(s is not None and list(s[:len(poisoned)]) == poisoned and len(s) > len(poisoned) for s in sequences):
            raise Injected("the forward of this row fails")
        return real(sequences, needs)

    monkeypatch.setattr(engine.runner, "score_rows", score_rows)
    results = three_together(engine)
    assert isinstance(results[1], Injected) and [results[0], results[2]] == [expected[0], expected[2]]
    monkeypatch.setattr(engine.runner, "score_rows", real)
    assert_served_and_consistent(engine, router, store, expected)


# ------------------------------------------------------------------------ a failed step's finished rows

@pytest.mark.parametrize("planted", [False, pytest.param(True, marks=pytest.mark.xfail(
    strict=True, reason="planted: _isolate steps every row of the failed step again"))])
def test_a_row_that_finished_inside_a_failed_step_is_never_stepped_again(tiny_target, tmp_path, monkeypatch,
                                                                        expected, planted):
    """A step fails after its tokens were committed (as when a later row's processor raises), and
    one row finished in it: that row's answer is what it emitted, and no later step includes it."""
    engine, router, store = store_engine(tiny_target, tmp_path)
    scheduler, stepper = engine._scheduler, engine._stepper
    real = stepper.step
    stepped_after_finish: list[list[int]] = []
    failed = []

    def step(rows, slots, *feeding):
        stepped_after_finish.extend(r.prompt for r in rows if r.finished)
        new = real(rows, slots, *feeding)
        if not failed and len(rows) > 1 and any(r.finished for r in rows):
            failed.append(True)
            raise Injected("the step failed after its commit")
        return new

    monkeypatch.setattr(stepper, "step", step)
    if planted:  # the old _isolate: every row of the failed step stepped again, finished or not
        def isolate(rows, slots):
            for row in rows:
                if scheduler._slots[row.slot] is row:
                    stepper.step([row], slots)
        monkeypatch.setattr(scheduler, "_isolate", isolate)
    budgets = [NEW // 4, NEW, NEW]  # the first row finishes while the others decode
    handles = [engine.submit([p], max_new_tokens=n) for p, n in zip(PROMPTS, budgets)]
    results = outcomes(handles)
    assert failed, "no step failed with a finished row in it"
    assert not stepped_after_finish
    assert results == [expected[0][:NEW // 4], expected[1], expected[2]]
