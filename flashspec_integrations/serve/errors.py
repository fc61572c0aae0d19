"""Errors as OpenAI's clients expect them, and nothing of the server's insides in a reply.

- Engine failures: a ValueError naming an engine argument is a 400 naming the request field
  (`engine_error`; `context_length_exceeded` when the prompt and max_tokens do not fit a row); the
  engine's back-pressure is a 429 with `Retry-After` (queue full) or a 503 (shutting down);
  anything else is a 500.
- A 500 carries only a request id (the `X-Request-ID` Ray Serve's proxy sets; a client may send its
  own); the exception and its traceback go to the replica's log under that id.
- Starlette's own errors (an unknown route, a wrong method) get OpenAI's error body too.
"""
from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from flashspec_core.prompts import ContextLengthError
from flashspec_core.scheduler import EngineBusy, EngineClosed
from flashspec_integrations.serve.protocol import CONTEXT_LENGTH_EXCEEDED, APIError

logger = logging.getLogger("flashspec.serve")

# The engine's argument names (its ValueErrors start with them) -> the request's field names.
_ENGINE_ARGUMENTS = {"max_new_tokens": "max_tokens", "prompt": "messages", "json_schema": "response_format",
                     "stop": "stop", "sampling": None}


def request_id(request: Request | None) -> str:
    """The request's id: Ray Serve's `x-request-id` header (at most 64 characters), else a new one."""
    given = request.headers.get("x-request-id", "") if request is not None else ""
    return given[:64] if given.isprintable() and given else uuid.uuid4().hex


def internal_error(rid: str, exc: BaseException) -> APIError:
    """A 500 whose body names only the request id; the exception goes to the log with that id."""
    logger.error("request %s failed: %s: %s", rid, type(exc).__name__, exc, exc_info=exc)
    return APIError(500, f"the server failed on this request (request id {rid}; its log has the details)",
                    kind="server_error", code="internal_error")


def engine_error(exc: Exception, rid: str, retry_after: int = 1) -> APIError:
    """An engine exception as an API error: its ValueErrors name the argument, so they are 400s;
    a full queue is a 429 with `Retry-After: retry_after`, a closed engine a 503."""
    if isinstance(exc, ValueError):
        code = CONTEXT_LENGTH_EXCEEDED if isinstance(exc, ContextLengthError) else None
        return APIError(400, str(exc), _ENGINE_ARGUMENTS.get(str(exc).split(":", 1)[0]), code=code)
    if isinstance(exc, EngineBusy):
        return APIError(429, f"the engine's queue is full; retry after {retry_after} s", kind="rate_limit_error",
                        code="server_busy", headers={"Retry-After": str(retry_after)})
    if isinstance(exc, EngineClosed):
        return APIError(503, "this replica is shutting down; retry on another", kind="server_error",
                        code="shutting_down", headers={"Retry-After": str(retry_after)})
    return internal_error(rid, exc)


def respond(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def install(app: FastAPI) -> None:
    """Exception handlers: OpenAI's body for Starlette's HTTP errors, a request id for the rest."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return respond(APIError(exc.status_code, message, code=str(exc.status_code)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(internal_error(request_id(request), exc))
