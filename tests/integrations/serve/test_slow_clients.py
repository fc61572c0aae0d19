"""Clients that stall inside their request body, against the real server: Ray Serve's proxy hands
a request to a replica once its headers are in, so each stalled body is waited on by a replica.
What must hold: while they stall, other clients' chat and /health are answered as usual (a body
still arriving holds no in-flight slot), and each stalled request gets a 408 once the body timeout
passes (the fixture's `body_timeout_s`), which frees its place on the replica."""
from __future__ import annotations

import select
import socket
import time
from urllib.parse import urlsplit

import pytest

from .conftest import API_KEY, BODY_TIMEOUT_S, MODEL

pytest.importorskip("ray", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# More than the two replicas would take with Ray's headroom for them at 32 (2 x (4 + 32)), and 25
# times what they admit at once.
STALLED = 100


def stalled_posts(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` connections that send a chat request's headers (Content-Length: 1000) and the first
    bytes of its body, then nothing more."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=10)
        sock.sendall(head + b'{"model": "')
        sockets.append(sock)
    return sockets


def what_comes_back(sock: socket.socket, until: float) -> tuple[bytes, bool]:
    """The bytes the server sends on `sock` before `until` (a monotonic time), and whether it closed it."""
    data = b""
    while (left := until - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            break
        if not piece:
            return data, True
        data += piece
    return data, False


def test_stalled_bodies_leave_chat_and_health_answered_and_end_in_a_408(service):
    base = service[0]
    url = urlsplit(base)
    auth = {"authorization": f"Bearer {API_KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        assert http.post(base + "/chat/completions", json=chat, headers=auth).status_code == 200  # warm
        stalled = stalled_posts(url.hostname, url.port, STALLED)
        sent = time.monotonic()
        try:
            health = http.get(f"{url.scheme}://{url.netloc}/health")
            reply = http.post(base + "/chat/completions", json=chat, headers=auth)
            answered = time.monotonic() - sent
            readable, _, _ = select.select(stalled, [], [], 0)
            assert health.status_code == 200 and health.json()["in_flight"] == 0, health.text
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"], reply.text
            assert answered < BODY_TIMEOUT_S and readable == [], (
                f"chat and /health took {answered:.1f} s beside {STALLED} stalled bodies; "
                f"{len(readable)} of those were answered meanwhile")

            outcomes = [what_comes_back(sock, sent + BODY_TIMEOUT_S + 30) for sock in stalled]
            waited = time.monotonic() - sent
        finally:
            for sock in stalled:
                sock.close()
    statuses = [data.split(b"\r\n", 1)[0] for data, _ in outcomes]
    assert all(status.startswith(b"HTTP/1.1 408") for status in statuses), statuses
    assert all(b'"code":"request_timeout"' in data for data, _ in outcomes), outcomes[0]
    assert all(closed for _, closed in outcomes), "a 408 for a body not read whole must close its connection"
    assert BODY_TIMEOUT_S <= waited < BODY_TIMEOUT_S + 30
    print(f"\n{STALLED} stalled bodies: chat and /health answered in {answered:.2f} s beside them; "
          f"all got 408 and were closed {waited:.1f} s after they stalled (body timeout {BODY_TIMEOUT_S:g} s)")
