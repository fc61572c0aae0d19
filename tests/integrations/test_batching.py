"""The batcher: concurrent calls to one engine become engine batches of compatible calls, and one
call's failure stays that call's."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fakes import ScriptedEngine, tiny_engine

from flashspec_core import SamplingParams
from flashspec_integrations.batching import arun_calls, batcher_for, run_calls
from flashspec_integrations.calls import EngineCall
from flashspec_integrations.context import DomainDecision

CHAT = DomainDecision(None, "chat", "test")


def call(engine, text="hello", decision=CHAT, max_new=8, **sampling) -> EngineCall:
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    return EngineCall(ids, max_new, SamplingParams(**sampling), [], decision, text)


def test_concurrent_threads_share_one_batch():
    engine = ScriptedEngine(["ok"])
    results = []
    threads = [threading.Thread(target=lambda i=i: results.extend(run_calls(engine, [call(engine, f"q{i}")], 0.2)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.batches == [6] and [o.batch_size for o in results] == [6] * 6
    assert sorted(c["prompt"] for c in engine.calls) == [f"q{i}" for i in range(6)]


def test_calls_group_by_every_engine_argument():
    engine = ScriptedEngine(["ok"])
    calls = [call(engine), call(engine), call(engine, max_new=4), call(engine, decision=DomainDecision("code", None, "x")),
             call(engine, temperature=0.7), call(engine, temperature=0.7, seed=1), call(engine, temperature=0.7, seed=1)]
    outcomes = run_calls(engine, calls, 0.0)
    assert [o.batch_size for o in outcomes] == [2, 2, 1, 1, 1, 1, 1]  # seeded sampled calls run alone
    assert sorted(engine.batches) == [1, 1, 1, 1, 1, 2]


def test_greedy_rows_of_a_batch_are_the_tokens_they_are_alone():
    engine = tiny_engine()
    calls = [call(engine, f"question number {i}", max_new=10) for i in range(4)]
    alone = [run_calls(engine, [c], 0.0)[0].token_ids for c in calls]
    together = run_calls(engine, calls, 0.0)
    assert [o.token_ids for o in together] == alone and {o.batch_size for o in together} == {4}


def test_a_bad_call_fails_alone():
    engine = tiny_engine()
    good = [call(engine, "fine", max_new=4), call(engine, "also fine", max_new=4)]
    too_long = call(engine, "x" * 5000, max_new=4)  # past the 4096-token context window
    futures = batcher_for(engine).submit([good[0], too_long, good[1]], 0.0)
    assert futures[0].result().token_ids and futures[2].result().token_ids
    with pytest.raises(ValueError, match="context window"):
        futures[1].result()


def test_async_callers_wait_without_threads_and_cancelled_ones_are_dropped():
    engine = ScriptedEngine(["ok"])

    async def main():
        slow = asyncio.ensure_future(arun_calls(engine, [call(engine, "dropped")], 0.3))
        await asyncio.sleep(0.05)
        slow.cancel()  # still gathering: never decoded
        done = await arun_calls(engine, [call(engine, "kept")], 0.0)
        await asyncio.sleep(0.4)
        return done

    done = asyncio.run(main())
    assert done[0].text == "ok" and len(engine.calls) == 1


def test_a_zero_window_starts_at_once():
    engine = ScriptedEngine(["ok"])
    start = time.perf_counter()
    run_calls(engine, [call(engine)], 0.0)
    assert time.perf_counter() - start < 0.1
