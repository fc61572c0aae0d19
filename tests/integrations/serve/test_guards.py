"""The HTTP guards without Ray: the API key and the body's limits as ASGI middlewares on a small app,
the key's sources and the warning for listening beyond loopback without one."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

starlette = pytest.importorskip("starlette", reason="needs the 'serve' extra")
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from flashspec_integrations.serve import errors
from flashspec_integrations.serve.command import exposure_warning
from flashspec_integrations.serve.guards import APIKeyMiddleware, BodyLimits, resolve_api_key

KEY = "s3cret"
BODY_TIMEOUT_S = 0.3
handled: list[int] = []  # the body sizes the route saw


async def echo(request: Request) -> JSONResponse:
    handled.append(len(await request.body()))
    return JSONResponse({"bytes": handled[-1]})


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


def make_app(api_key: str | None = KEY, max_body_bytes: int | None = 1000) -> Starlette:
    app = Starlette(routes=[Route("/v1/echo", echo, methods=["POST", "GET"]), Route("/health", health)])
    app.add_middleware(BodyLimits)
    app.add_middleware(APIKeyMiddleware)
    app.state.api_key, app.state.max_body_bytes, app.state.body_timeout_s = api_key, max_body_bytes, BODY_TIMEOUT_S
    return app


def make_client(api_key: str | None = KEY, max_body_bytes: int | None = 1000) -> TestClient:
    return TestClient(make_app(api_key, max_body_bytes))


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers, words", [
    ({}, "no API key was given"),
    (auth("wrong"), "not this server's"),
    (auth(KEY + "x"), "not this server's"),
    ({"authorization": KEY}, "not this server's"),  # the scheme is required
    ({"authorization": f"Basic {KEY}"}, "not this server's"),
])
def test_every_route_but_health_needs_the_key(headers, words):
    client = make_client()
    res = client.post("/v1/echo", content=b"{}", headers=headers)
    error = res.json()["error"]
    assert res.status_code == 401 and words in error["message"] and error["code"] == "invalid_api_key"
    assert res.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/echo", headers=headers).status_code == 401
    assert client.get("/health").json() == {"status": "ok"}  # no key needed
    assert client.post("/v1/echo", content=b"{}", headers=auth(KEY)).json() == {"bytes": 2}
    assert client.post("/v1/echo", content=b"{}", headers={"authorization": f"bearer  {KEY} "}).status_code == 200


def test_without_a_key_everything_passes():
    assert make_client(api_key=None).post("/v1/echo", content=b"{}").status_code == 200


def test_a_body_over_the_limit_is_a_413_declared_or_streamed():
    client = make_client()
    assert client.post("/v1/echo", content=b"x" * 1000, headers=auth(KEY)).json() == {"bytes": 1000}
    res = client.post("/v1/echo", content=b"x" * 1001, headers=auth(KEY))
    assert res.status_code == 413 and "limit of 1000 bytes" in res.json()["error"]["message"]

    def chunks():  # no Content-Length: the middleware counts what arrives and stops at the limit
        for _ in range(100):
            yield b"y" * 100

    res = client.post("/v1/echo", content=chunks(), headers=auth(KEY))
    assert res.status_code == 413 and res.json()["error"]["code"] == "request_too_large"
    assert client.post("/v1/echo", content=b"x" * 5000).status_code == 401  # the key is checked first


async def post_slowly(pieces: list[bytes], gap_s: float) -> tuple[list[dict], float]:
    """The ASGI messages the app sends for a POST whose body comes in `pieces`, `gap_s` apart, the
    last never ending it (the client stalls); and the seconds until the response ended."""
    sent: list[dict] = []
    queue = list(pieces)

    async def receive() -> dict:
        if queue:
            await asyncio.sleep(gap_s)
            return {"type": "http.request", "body": queue.pop(0), "more_body": True}
        await asyncio.Event().wait()  # stalled for good
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/echo", "raw_path": b"/v1/echo", "query_string": b"", "root_path": "",
             "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-length", b"1000")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    start = time.monotonic()
    await asyncio.wait_for(make_app()(scope, receive, send), 10)
    return sent, time.monotonic() - start


@pytest.mark.parametrize("pieces, gap_s", [
    ([b'{"model": '], 0.0),  # stalls after a few bytes
    ([b"x"] * 40, 0.02),  # trickles a byte at a time, each well within the limit, the whole past it
])
def test_a_body_not_received_within_the_timeout_is_a_408_that_closes_the_connection(pieces, gap_s):
    handled.clear()
    sent, took = asyncio.run(post_slowly(pieces, gap_s))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    assert start["status"] == 408 and (b"connection", b"close") in start["headers"]
    assert b"request_timeout" in body and b"--body-timeout-s" in body
    assert BODY_TIMEOUT_S <= took < BODY_TIMEOUT_S + 2 and handled == []  # the route never ran


class ProxyDroppedTheRequest(Exception):
    """As Ray Serve's TaskCancelledError: the replica's channel to its proxy, once the client left."""


def test_a_client_leaving_mid_stream_is_one_info_line_and_the_stream_is_closed(caplog):
    closed = asyncio.Event()

    async def tokens():
        try:
            while True:
                yield "data: token\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.set()  # the server's stream frees its slot and row here

    async def stream(request: Request) -> StreamingResponse:
        await request.body()
        return StreamingResponse(tokens(), media_type="text/event-stream")

    app = pytest.importorskip("fastapi").FastAPI()
    app.post("/v1/stream")(stream)
    errors.install(app)  # what would report the channel's failure as a 500 with a traceback
    app.add_middleware(BodyLimits)
    app.state.max_body_bytes, app.state.body_timeout_s = 1000, BODY_TIMEOUT_S
    sent: list[dict] = []

    async def scenario() -> None:
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            while len(sent) < 4:  # the client reads a few chunks, then leaves
                await asyncio.sleep(0.01)
            raise ProxyDroppedTheRequest("Task: 5e2d was cancelled.")

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/stream", "raw_path": b"/v1/stream", "query_string": b"",
                 "root_path": "", "headers": [(b"x-request-id", b"req-77")], "client": ("127.0.0.1", 5000),
                 "server": ("127.0.0.1", 8000)}
        await asyncio.wait_for(app(scope, receive, send), 10)
        await asyncio.wait_for(closed.wait(), 2)

    with caplog.at_level(logging.INFO, logger="flashspec.serve"):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if r.name == "flashspec.serve"]
    assert [(r.levelno, r.getMessage(), r.exc_info) for r in lines] == [
        (logging.INFO, "request req-77: the client disconnected before its reply ended", None)]
    assert sent[0]["status"] == 200 and closed.is_set()


def test_the_key_comes_from_the_setting_else_the_environment(monkeypatch):
    monkeypatch.delenv("FLASHSPEC_API_KEY", raising=False)
    assert resolve_api_key(None) is None and resolve_api_key("a") == "a"
    monkeypatch.setenv("FLASHSPEC_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("a") == "a"
    with pytest.raises(ValueError, match="api_key: an empty key"):
        resolve_api_key("  ")


@pytest.mark.parametrize("host, key, warned", [
    ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
    ("0.0.0.0", None, True), ("10.1.2.3", None, True), ("my-host.example", None, True), ("0.0.0.0", KEY, False),
])
def test_listening_beyond_loopback_without_a_key_warns(host, key, warned):
    warning = exposure_warning(host, key)
    assert (warning is not None) == warned
    if warned:
        assert host in warning and "--api-key" in warning and "FLASHSPEC_API_KEY" in warning
