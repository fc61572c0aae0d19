"""The HTTP guards in front of every route: the API key, the body's size and time (ASGI middlewares).

Both read their settings from the app's state (`api_key`, `max_body_bytes`, `body_timeout_s`), set
by each replica when it starts (unset, they let everything through), and answer in OpenAI's error
shape. `APIKeyMiddleware`: every route but the health route needs `Authorization: Bearer <key>`
(compared in constant time; the `api_key` setting, else the replica's `FLASHSPEC_API_KEY`).
`BodyLimits`: a body over the limit is a 413, read only up to the limit (a declared Content-Length
over it is refused at once); one not all in within the timeout is a 408 and its connection is
closed. Bodies are read before admission, so a stalled one holds no slot. Why: docs/serve.md.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
from typing import TYPE_CHECKING

from flashspec_integrations.serve.protocol import APIError

if TYPE_CHECKING:  # Starlette is imported where a response is sent: the CLI imports this module
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_KEY_ENV = "FLASHSPEC_API_KEY"
logger = logging.getLogger("flashspec.serve")
OPEN_PATHS = frozenset({"/health"})


def resolve_api_key(configured: str | None) -> str | None:
    """The key the server requires: `configured`, else $FLASHSPEC_API_KEY, else None (no key)."""
    key = configured if configured is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"api_key: an empty key would let every client in; "
                         f"set a secret or leave it unset ({API_KEY_ENV})")
    return key


def is_loopback(host: str) -> bool:
    """True when `host` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _state(scope: Scope, name: str) -> object:
    app = scope.get("app")
    return getattr(app.state, name, None) if app is not None else None


async def _send_error(error: APIError, scope: Scope, receive: Receive, send: Send,
                      headers: dict[str, str] | None = None) -> None:
    from starlette.responses import JSONResponse

    await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)


def _path(scope: Scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class APIKeyMiddleware:
    """401 in OpenAI's shape for a request without the right Bearer key (the health route is open)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = _state(scope, "api_key")
        if scope["type"] != "http" or not isinstance(key, str) or _path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
            await self.app(scope, receive, send)
            return
        why = "no API key was given" if not header else "the API key is not this server's"
        error = APIError(401, f"{why}; send the server's key as 'Authorization: Bearer <key>' (the openai "
                              "client's api_key)", kind="invalid_request_error", code="invalid_api_key")
        await _send_error(error, scope, receive, send, {"WWW-Authenticate": "Bearer"})


class _TooLarge(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None when the client leaves first; _TooLarge once past `limit` bytes."""
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await _from_client(receive)
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > limit:
            raise _TooLarge
    return b"".join(chunks)


async def _from_client(receive: Receive) -> Message:
    """The client's next message. Ray Serve's channel to its proxy fails (TaskCancelledError)
    once the proxy has dropped a request whose client left: that is the client's disconnect too."""
    try:
        return await receive()
    except Exception:  # any failure of the channel: nobody is left to hear from
        return {"type": "http.disconnect"}


def _left(scope: Scope) -> None:
    """One line for a client that left before its reply ended (its stream's end frees its row)."""
    rid = dict(scope.get("headers") or ()).get(b"x-request-id", b"?").decode("latin-1")[:64]
    logger.info("request %s: the client disconnected before its reply ended", rid)


class BodyLimits:
    """413 in OpenAI's shape for a request body over `app.state.max_body_bytes`, and 408 for one
    not received whole within `app.state.body_timeout_s` of the request reaching this replica."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit, seconds = _state(scope, "max_body_bytes"), _state(scope, "body_timeout_s")
        timeout = float(seconds) if isinstance(seconds, (int, float)) else None
        if scope["type"] != "http" or not isinstance(limit, int):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(limit, scope, receive, send)
            return
        try:
            async with asyncio.timeout(timeout):
                body = await _read_body(receive, limit)
        except TimeoutError:
            error = APIError(408, f"the request body did not all arrive within {timeout:g} s of the request "
                                  "(--body-timeout-s); send the whole body at once", code="request_timeout")
            await _send_error(error, scope, receive, send, {"Connection": "close"})
            return
        except _TooLarge:
            await self._refuse(limit, scope, receive, send)
            return
        if body is None:  # the client went away: nobody to answer
            _left(scope)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            message = await _from_client(receive)  # after the body: only the disconnect comes
            if message["type"] == "http.disconnect":
                _left(scope)
            return message

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                              "(--max-body-bytes); send less", code="request_too_large")
        await _send_error(error, scope, receive, send)
