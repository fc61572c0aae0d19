"""Errors in OpenAI's shape; a 500 names a request id, never the exception (which goes to the log)."""
from __future__ import annotations

import logging

import pytest

fastapi = pytest.importorskip("fastapi", reason="needs the 'serve' extra")
from fastapi.testclient import TestClient

from flashspec_core.prompts import ContextLengthError
from flashspec_core.scheduler import EngineBusy, EngineClosed
from flashspec_integrations.serve import errors


def make_client() -> TestClient:
    app = fastapi.FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret detail: /home/user/model.bin")

    return TestClient(app, raise_server_exceptions=False)


def test_an_unexpected_exception_is_a_500_with_a_request_id_and_the_details_in_the_log(caplog):
    with caplog.at_level(logging.ERROR, logger="flashspec.serve"):
        res = make_client().get("/boom", headers={"x-request-id": "req-42"})
    error = res.json()["error"]
    assert res.status_code == 500 and error["type"] == "server_error" and "req-42" in error["message"]
    assert "secret" not in res.text and "RuntimeError" not in res.text
    assert "request req-42 failed: RuntimeError: secret detail" in caplog.text


def test_unknown_routes_and_methods_get_openais_shape():
    client = make_client()
    res = client.get("/v1/nothing")
    assert res.status_code == 404 and "GET /v1/nothing: Not Found" in res.json()["error"]["message"]
    assert client.post("/boom").json()["error"]["message"].startswith("POST /boom: Method Not Allowed")


def test_engine_value_errors_name_the_field_and_others_hide_their_text(caplog):
    error = errors.engine_error(ValueError("max_new_tokens: 9000 does not fit"), "r1")
    assert (error.status, error.param, error.code) == (400, "max_tokens", None)
    error = errors.engine_error(ContextLengthError("max_new_tokens: at most 20 new tokens fit"), "r1")
    assert (error.status, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    assert error.body()["error"]["type"] == "invalid_request_error"
    with caplog.at_level(logging.ERROR, logger="flashspec.serve"):
        error = errors.engine_error(MemoryError("CUDA out of memory at 0x7f"), "r2")
    assert error.status == 500 and "0x7f" not in error.message and "r2" in error.message
    assert "CUDA out of memory" in caplog.text
    assert len(errors.request_id(None)) == 32  # made up when the proxy gave none


def test_the_engines_back_pressure_is_a_429_with_retry_after_and_a_closed_engine_a_503():
    busy = errors.engine_error(EngineBusy("256 requests are waiting"), "r3", retry_after=7)
    assert (busy.status, busy.code, busy.headers) == (429, "server_busy", {"Retry-After": "7"})
    closed = errors.engine_error(EngineClosed("the engine was closed"), "r4")
    assert (closed.status, closed.code) == (503, "shutting_down") and "Retry-After" in closed.headers
