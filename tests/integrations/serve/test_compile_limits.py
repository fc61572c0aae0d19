"""A schema that compiles too slowly ends at the compile limit whatever field and tool choice
carry it, and holds nothing after: no planning thread, no process still compiling it, no worker
that another request's trivial schema would wait for. Driven as the server plans a request:
`plan_call` on the planning threads (`Planner`), over the default tokenizer (no Ray)."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from helpers import alive

from flashspec_core.constrained.grammar import as_grammar, compile_workers
from flashspec_core.models import vocab_size
from flashspec_integrations.serve.planning import Planner
from flashspec_integrations.serve.protocol import APIError, parse_request
from flashspec_integrations.serve.translate import plan_call
from flashspec_integrations.serve.turns import CompileTurns

pytestmark = pytest.mark.slow

LIMIT_S = 1.0  # the compile limit under test
SLACK_S = 2.0  # what planning adds to it (template, tokenizer) on a busy CPU; the compile itself runs for minutes
PROMPT_S = 2.0  # a trivial schema's whole plan, right after
# xgrammar expands this regex for minutes: 34 bytes, no end in sight.
ENDLESS = {"type": "object", "properties": {"word": {"type": "string", "pattern": "[a-z]{1,20000}"}}}
TRIVIAL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NODE = {"type": "object", "properties": {"label": {"type": "string"}, "children": {"type": "array", "items": {
    "$ref": "#/$defs/node"}}}, "required": ["label"], "$defs": {"node": {"$ref": "#"}}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def carrying(schema: dict, how: str) -> dict:
    """Request fields that put `schema` before the compiler under one tool choice (or as the
    response format)."""
    if how == "response_format":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    tools = [tool("f", schema), tool("g", TRIVIAL)]
    choice = {"absent": {}, "auto": {"tool_choice": "auto"}, "required": {"tool_choice": "required"},
              "named": {"tool_choice": {"type": "function", "function": {"name": "f"}}}}[how]
    return {"tools": tools, **choice}


HOWS = ["absent", "auto", "required", "named", "response_format"]


@pytest.fixture(scope="module")
def engine(default_target):
    eos = default_target.model.generation_config.eos_token_id
    return SimpleNamespace(tokenizer=default_target.tokenizer, target_model=default_target.model,
                           eos_ids=frozenset([eos] if isinstance(eos, int) else eos), context_window=8192,
                           constrains=True)


@pytest.fixture
def workers(engine):
    """The compile workers, every one of them up and idle (a kill in an earlier case restarts one)."""
    pool = compile_workers(engine.tokenizer, vocab_size(engine.target_model), engine.eos_ids)
    deadline = time.monotonic() + 120
    while pool.idle() < len(pool.pids()) or not pool.pids():
        assert time.monotonic() < deadline, "the compile workers did not come up"
        time.sleep(0.1)
    return pool


def planned(engine, planner: Planner, fields: dict):
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    req = parse_request(json.dumps(body).encode())
    return planner.run(lambda: plan_call(engine, req, 64, compile_timeout_s=LIMIT_S))


@pytest.mark.parametrize("how", HOWS)
def test_a_schema_past_the_compile_limit_is_a_400_at_the_limit_and_leaves_nothing_running(engine, workers, how):
    field = "response_format" if how == "response_format" else "tools"

    async def scenario() -> None:
        planner = Planner(timeout_s=3 * LIMIT_S + PROMPT_S)  # the server's: longer than the compile limit
        try:
            before = set(workers.pids())
            start = time.perf_counter()
            with pytest.raises(APIError) as err:
                await planned(engine, planner, carrying(ENDLESS, how))
            elapsed = time.perf_counter() - start
            assert (err.value.status, err.value.param) == (400, field)
            assert f"{field}: compiling the schema took longer than {LIMIT_S:g} s" in err.value.message
            assert elapsed < LIMIT_S + SLACK_S, elapsed
            killed = before - set(workers.pids())
            assert len(killed) == 1 and not any(alive(pid) for pid in killed)  # its compile is gone with it
            # Right after: as many trivial requests as there are planning threads plan at once, so
            # no planning thread and no compile worker is still held by the slow one.
            start = time.perf_counter()
            plans = await asyncio.gather(*(planned(engine, planner, carrying(TRIVIAL, other))
                                           for other in ("named", "response_format")))
            assert time.perf_counter() - start < PROMPT_S
            assert all(p.grammar is not None for p in plans)
        finally:
            planner.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("how", HOWS)
def test_a_recursive_schema_compiles_under_every_tool_choice_as_under_response_format(engine, workers, how):
    async def scenario():
        planner = Planner(timeout_s=30)
        try:
            return await planned(engine, planner, carrying(NODE, how))
        finally:
            planner.close()

    plan = asyncio.run(scenario())
    vocab, eos = vocab_size(engine.target_model), sorted(engine.eos_ids)
    assert plan.grammar is not None and plan.grammar.vocab_size == vocab
    assert as_grammar(plan.grammar, engine.tokenizer, vocab, eos) is plan.grammar  # the engine compiles nothing more


def test_one_clients_slow_schemas_leave_another_clients_schema_a_thread_and_a_worker(engine, workers):
    """Client A sends two schemas that never compile at once, client B a trivial one: A's second
    waits for A's turn (a 429 when it does not come), so B plans at once on the thread and worker
    A leaves free, instead of waiting out A's compile limit."""
    limit_s = 4.0  # A's compile holds a thread and a worker this long

    def plan_for(fields: dict):
        body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
        req = parse_request(json.dumps(body).encode())
        return lambda: plan_call(engine, req, 64, compile_timeout_s=limit_s)

    async def scenario() -> None:
        planner, turns = Planner(timeout_s=limit_s + PROMPT_S + SLACK_S), CompileTurns(limit=1, timeout_s=1.0)
        started = time.perf_counter()

        async def client(name: str, schema: dict) -> tuple[str, float]:
            try:
                async with turns.turn(name, retry_after=3):
                    await planner.run(plan_for(carrying(schema, "response_format")))
                outcome = "planned"
            except APIError as exc:
                outcome = str(exc.status)
            return outcome, time.perf_counter() - started

        try:
            a1, a2 = client("10.0.0.1", ENDLESS), client("10.0.0.1", ENDLESS)
            (first, _), (second, refused_at), (other, other_at) = await asyncio.gather(
                a1, a2, client("10.0.0.2", TRIVIAL))
        finally:
            planner.close()
        assert (first, second, other) == ("400", "429", "planned")  # A's compile past its limit; A's second refused
        assert other_at < limit_s, f"B's trivial schema waited {other_at:.1f} s behind A's"
        assert refused_at < limit_s and turns.clients() == 0

    asyncio.run(scenario())
