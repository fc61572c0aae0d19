"""The server soak's own accounting, against fake servers (httpx's MockTransport, no Ray): a
server that answers or refuses cleanly leaves nothing unclean; hangs, unshaped 500s and bad input
answered 200 are counted; failures while a killed replica is replaced are told from the rest."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from flashspec_workloads.serve_soak import KINDS, MODEL, Ended, ServeSoakReport, soak_server

PROMPTS = [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "List three rivers."}]]
ANSWER_KINDS = ("plain", "stream", "schema", "tools", "abandon", "disconnect")
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def answer(body: dict, pid: int) -> httpx.Response:
    """What a well-behaved server sends for a valid request body."""
    if body.get("stream"):
        events = [{"choices": [{"delta": {"content": w}}]} for w in ("Hi", " there", "!", " Bye", ".")]
        events.append({"choices": [{"delta": {}, "finish_reason": "stop"}], "flashspec": {"pid": pid}})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "Hi"}}],
                                     "flashspec": {"pid": pid}})


def refuse(status: int = 400) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": "no", "type": "invalid_request_error", "param": None,
                                                  "code": None}})


def valid(request: httpx.Request) -> dict | None:
    """The body when it is a request this fake serves (a JSON object for MODEL with messages)."""
    try:
        body = json.loads(request.content)
    except ValueError:
        return None
    ok = isinstance(body, dict) and body.get("model") == MODEL and body.get("messages") and len(request.content) < 4096
    return body if ok else None


def run(handler: Handler, **kwargs: Any) -> ServeSoakReport:
    return asyncio.run(soak_server("http://fake/v1", {}, PROMPTS, transport=httpx.MockTransport(handler),
                                   callers=4, seed=1, hang_s=2.0, **kwargs))


def test_a_server_that_answers_or_refuses_cleanly_leaves_nothing_unclean():
    async def server(request: httpx.Request) -> httpx.Response:
        body = valid(request)
        if body is None or body.get("temperature", 0) == -1:
            return refuse()
        return answer(body, pid=7)

    report = run(server, requests=60, kinds=ANSWER_KINDS)
    assert report.requests == 60 and report.hung == 0
    assert report.unclean == {} and report.answered_after, report.outcomes
    assert report.outcomes["left (stream abandoned)"] > 0 and report.outcomes["200"] > 0


def test_hangs_unshaped_500s_and_bad_input_answered_are_counted():
    calls = 0

    async def server(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls % 7 == 3:
            await asyncio.sleep(30)  # past the client's limit
        if calls % 7 == 5:
            return httpx.Response(500, text="Internal Server Error")
        return answer({}, pid=7)  # 200 to anything, bad input included

    report = run(server, requests=40, kinds=("plain", "bad"))
    assert report.hung > 0
    assert report.unclean["500 (not OpenAI's error shape)"] > 0 and report.unclean["200 to bad input"] > 0
    assert report.server_errors_outside_kill == report.outcomes["500 (not OpenAI's error shape)"]


def test_failures_while_a_killed_replica_is_replaced_are_told_from_the_rest():
    killed: list[float] = []

    async def server(request: httpx.Request) -> httpx.Response:
        if killed and not killed[0] + 1.0 < asyncio.get_running_loop().time():
            return httpx.Response(502, text="Bad Gateway")  # the replica is gone, no other answers yet
        await asyncio.sleep(0.05)
        return answer(json.loads(request.content), pid=9 if killed else 1 + len(request.content) % 2)

    def kill(ended: Sequence[Ended]) -> int:
        killed.append(asyncio.get_running_loop().time())
        return 1

    report = run(server, seconds=3.0, kinds=("plain",), kill_at_s=0.5, kill=kill)
    assert report.kill["pid"] == 1 and report.kill["replaced_by"] == 9, report.kill
    assert report.in_kill_window_failed["502 (not OpenAI's error shape)"] > 0
    assert report.unclean == {} and report.server_errors_outside_kill == 0 and report.answered_after
    assert report.kill["answered_after_kill"] > 0


def test_every_kind_is_drawn():
    assert set(KINDS) >= set(ANSWER_KINDS) | {"bad", "oversized"}
    assert Ended("plain", "200", 200, True, 0.0, 0.0).clean
