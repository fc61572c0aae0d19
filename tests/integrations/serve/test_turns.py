"""Each client's turn at the grammar compilers (`turns`), without Ray or a model."""
from __future__ import annotations

import asyncio

import pytest

from flashspec_integrations.serve.protocol import APIError
from flashspec_integrations.serve.turns import CompileTurns


def test_a_clients_requests_past_its_limit_wait_their_turn_and_others_go_at_once():
    async def scenario() -> list[str]:
        turns, order = CompileTurns(limit=2, timeout_s=5), []

        async def request(client: str, name: str, hold: asyncio.Event) -> None:
            async with turns.turn(client, retry_after=1):
                order.append(name)
                await hold.wait()

        hold_a, hold_b = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(request("a", f"a{i}", hold_a)) for i in range(3)]
        tasks.append(asyncio.create_task(request("b", "b0", hold_b)))
        await asyncio.sleep(0.05)
        assert sorted(order) == ["a0", "a1", "b0"] and turns.clients() == 2  # a2 waits for one of a's turns
        hold_b.set()
        await asyncio.sleep(0.05)
        assert "a2" not in order  # b's ending frees none of a's turns
        hold_a.set()
        await asyncio.gather(*tasks)
        assert turns.clients() == 0  # no entry is kept for a client with nothing in progress
        return order

    assert asyncio.run(scenario())[-1] == "a2"


def test_a_turn_that_does_not_come_in_time_is_a_429_with_retry_after_and_frees_nothing_it_never_held():
    async def scenario() -> None:
        turns = CompileTurns(limit=1, timeout_s=0.1)
        release = asyncio.Event()

        async def holder() -> None:
            async with turns.turn("a", retry_after=1):
                await release.wait()

        task = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as err:
            async with turns.turn("a", retry_after=7):
                raise AssertionError("a second turn while the first is held")
        assert (err.value.status, err.value.headers) == (429, {"Retry-After": "7"})
        assert "--max-compiles-per-client" in err.value.message
        release.set()
        await task
        async with turns.turn("a", retry_after=1):  # the refused wait took no turn with it
            assert turns.clients() == 1
        assert turns.clients() == 0
        with pytest.raises(ValueError, match="max_compiles_per_client"):
            CompileTurns(limit=0, timeout_s=1)

    asyncio.run(scenario())


@pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")
def test_the_replica_takes_a_turn_for_requests_with_a_schema_only_keyed_by_the_clients_address():
    pytest.importorskip("ray", reason="needs the 'serve' extra")
    import json
    from types import SimpleNamespace

    from flashspec_integrations.serve.deployment import FlashSpecServer
    from flashspec_integrations.serve.protocol import parse_request

    server = object.__new__(FlashSpecServer.func_or_class)  # without Ray: what `_turn` reads
    server.turns = CompileTurns(limit=1, timeout_s=1)
    request = SimpleNamespace(client=SimpleNamespace(host="10.0.0.9"))
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

    async def clients_inside(extra: dict) -> int:
        async with server._turn(request, parse_request(json.dumps({**base, **extra}).encode()), 1):
            return server.turns.clients()

    async def scenario() -> list[int]:
        return [await clients_inside(extra) for extra in (
            {}, {"response_format": {"type": "text"}}, {"response_format": {"type": "json_object"}}, {"tools": [tool]})]

    assert asyncio.run(scenario()) == [0, 0, 1, 1]
