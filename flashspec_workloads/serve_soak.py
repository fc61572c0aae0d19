"""A seeded soak of an OpenAI-compatible server over HTTP (`flashspec-agents serve`).

The HTTP counterpart of `soak.py`: callers on one event loop send one request after another, each
of a kind drawn from the seed (`plain`, `stream`, `schema`, `tools`, `abandon`, `disconnect`, `bad`,
`oversized`), until the time or the request count is up; one unanswered after `hang_s` is hung. A
request is `clean` when answered (a stream ending in `[DONE]` with no error event), refused with a
4xx, 429, 503 or 504 in OpenAI's error shape, or left by its own client; anything else is reported
with its time, so the failures a killed replica causes (`kill_at_s`) are told from the rest. The
kinds and what counts: docs/workloads.md, "Soaks".
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from flashspec_workloads.soak import DOMAINS, SCHEMA, STOPS

KINDS = ("plain", "stream", "schema", "tools", "abandon", "disconnect", "bad", "oversized")
MODEL = "SmolLM2-135M-Instruct"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CLEAN_STREAM_ERRORS = ("deadline_exceeded", "server_busy", "shutting_down")


def _malformed(model: str, messages: list[dict]) -> list[bytes | dict]:
    """Bodies the server must refuse with a 400 or 404."""
    ok = {"model": model, "messages": messages, "max_tokens": 4}
    return [b"{not json", b"", b"[1, 2, 3]", {"model": model}, {**ok, "messages": []},
            {**ok, "max_tokens": "ten"}, {**ok, "temperature": "0.5"}, {**ok, "stream": "yes"},
            {**ok, "temperature": -1}, {**ok, "top_p": 0}, {**ok, "max_tokens": 0}, {**ok, "n": 3},
            {**ok, "model": "no-such-model"}, {**ok, "surprise": True}, {**ok, "domain": "../../etc"},
            {**ok, "messages": [{"role": "wizard", "content": "hi"}]}, {**ok, "stop": ""},
            {**ok, "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            {**ok, "tools": [{"type": "function",
                              "function": {"name": "f", "parameters": {"type": "string", "pattern": "("}}}],
             "tool_choice": "required"}]


def _oversized(model: str, messages: list[dict], max_body_bytes: int) -> list[dict]:
    """Bodies past a limit: the body's size (413), the prompt's length, messages, stop strings (400)."""
    ok = {"model": model, "messages": messages, "max_tokens": 4}
    return [{**ok, "messages": [{"role": "user", "content": "x" * (max_body_bytes + 1024)}]},
            {**ok, "messages": [{"role": "user", "content": "word " * 60_000}]},
            {**ok, "messages": [{"role": "user", "content": "hi"}] * 1100},
            {**ok, "stop": [f"s{i}" for i in range(40)]},
            {**ok, "max_tokens": 10**7}]


@dataclass
class Spec:
    """One request to send: its kind, its body, and what its client does."""

    kind: str
    body: bytes | dict
    leave_after_s: float | None = None  # `disconnect`: the client's own deadline
    leave_after_chunks: int | None = None  # `abandon`


def draw(rng: random.Random, prompts: Sequence[list[dict]], kind: str, model: str = MODEL, max_tokens: int = 32,
         max_body_bytes: int = 4 << 20) -> Spec:
    """One seeded request of `kind` (see the module doc) on a prompt drawn from `prompts`."""
    messages = rng.choice(prompts)
    if kind == "bad":
        return Spec(kind, rng.choice(_malformed(model, messages)))
    if kind == "oversized":
        return Spec(kind, rng.choice(_oversized(model, messages, max_body_bytes)))
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": rng.randint(1, max_tokens)}
    if rng.random() < 0.5:
        body.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**31))
    else:
        body["temperature"] = 0
    stop, domain = rng.choice(STOPS), rng.choice(DOMAINS)
    if stop:
        body["stop"] = stop
    if domain:
        body["domain"] = domain
    if kind in ("stream", "abandon"):
        body["stream"] = True
    if kind == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    if kind == "tools":
        body.update(tools=[TOOL], tool_choice=rng.choice(["auto", "required"]))
    return Spec(kind, body, leave_after_s=rng.uniform(0.05, 3.0) if kind == "disconnect" else None,
                leave_after_chunks=rng.randint(1, 4) if kind == "abandon" else None)


@dataclass
class Ended:
    """How one request ended: `label` (e.g. "200", "400 invalid_request_error", "left"), its
    status (None without one), whether it ended cleanly, when (seconds from the soak's start)."""

    kind: str
    label: str
    status: int | None
    clean: bool
    start: float
    end: float
    pid: int | None = None  # the replica that answered
    retry_after: float | None = None  # a 429's Retry-After


def _refusal(status: int, text: str, kind: str, headers: httpx.Headers) -> Ended:
    """An HTTP error: clean when a 4xx, 503 or 504 in OpenAI's shape (`start`/`end` set by the caller)."""
    try:
        error = json.loads(text)["error"]
        shaped = isinstance(error["message"], str) and bool(error["message"]) and isinstance(error["type"], str)
    except (ValueError, KeyError, TypeError):
        error, shaped = {}, False
    label = f"{status} {error.get('code') or error.get('type')}" if shaped else f"{status} (not OpenAI's error shape)"
    try:
        retry_after = float(headers["retry-after"]) if "retry-after" in headers else None
    except ValueError:
        retry_after = None
    return Ended(kind, label, status, shaped and (400 <= status < 500 or status in (503, 504)), 0.0, 0.0,
                 retry_after=retry_after)


async def _stream(http: httpx.AsyncClient, url: str, spec: Spec) -> Ended:
    """A streamed request, read to `[DONE]` or left after `spec.leave_after_chunks` content chunks."""
    async with http.stream("POST", url, json=spec.body) as res:
        if res.status_code != 200:
            return _refusal(res.status_code, (await res.aread()).decode(errors="replace"), spec.kind, res.headers)
        chunks, pid, done = 0, None, False
        async for line in res.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                code = event["error"].get("code") or event["error"].get("type")
                return Ended(spec.kind, f"stream error {code}", 200, code in CLEAN_STREAM_ERRORS, 0.0, 0.0)
            pid = (event.get("flashspec") or {}).get("pid", pid)
            chunks += 1
            if spec.leave_after_chunks is not None and chunks > spec.leave_after_chunks:
                return Ended(spec.kind, "left (stream abandoned)", 200, True, 0.0, 0.0)
        return Ended(spec.kind, "200" if done else "200 (stream cut before [DONE])", 200, done, 0.0, 0.0, pid)


async def _post(http: httpx.AsyncClient, url: str, spec: Spec) -> Ended:
    """A plain request; a 200 must carry an assistant message, and `bad`/`oversized` must not get one."""
    content = spec.body if isinstance(spec.body, bytes) else json.dumps(spec.body).encode()
    res = await http.post(url, content=content, headers={"content-type": "application/json"})
    if res.status_code != 200:
        return _refusal(res.status_code, res.text, spec.kind, res.headers)
    answer = res.json()
    if spec.kind in ("bad", "oversized"):
        return Ended(spec.kind, "200 to bad input", 200, False, 0.0, 0.0)
    shaped = answer["choices"][0]["message"]["role"] == "assistant"
    return Ended(spec.kind, "200" if shaped else "200 without a message", 200, shaped, 0.0, 0.0,
                 answer.get("flashspec", {}).get("pid"))


async def send(http: httpx.AsyncClient, url: str, spec: Spec, hang_s: float) -> Ended:
    """Send `spec` to `url` (…/chat/completions) and say how it ended; never waits past `hang_s`."""
    go = _stream if isinstance(spec.body, dict) and spec.body.get("stream") is True else _post
    try:
        if spec.leave_after_s is not None:
            try:
                return await asyncio.wait_for(go(http, url, spec), spec.leave_after_s)
            except TimeoutError:
                return Ended(spec.kind, "left (client deadline)", None, True, 0.0, 0.0)
        return await asyncio.wait_for(go(http, url, spec), hang_s)
    except TimeoutError:
        return Ended(spec.kind, "hung", None, False, 0.0, 0.0)
    except httpx.HTTPError as exc:
        return Ended(spec.kind, f"connection error ({type(exc).__name__})", None, False, 0.0, 0.0)


@dataclass
class ServeSoakReport:
    """What a server soak saw (see the module doc)."""

    ended: list[Ended] = field(default_factory=list, repr=False)
    kill: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    answered_after: bool | None = None  # a normal request answered after the soak (and the kill)

    @property
    def requests(self) -> int:
        return len(self.ended)

    @property
    def outcomes(self) -> Counter[str]:
        return Counter(e.label for e in self.ended)

    @property
    def hung(self) -> int:
        return sum(e.label == "hung" for e in self.ended)

    def by_kind(self) -> dict[str, dict[str, int]]:
        kinds: dict[str, Counter[str]] = {}
        for e in self.ended:
            kinds.setdefault(e.kind, Counter())[e.label] += 1
        return {k: dict(v) for k, v in sorted(kinds.items())}

    def in_kill_window(self, e: Ended) -> bool:
        """Whether `e` was in flight while a killed replica was being replaced."""
        if not self.kill:
            return False
        return e.end >= self.kill["at_s"] and e.start <= self.kill.get("replaced_at_s", self.seconds)

    @property
    def unclean(self) -> Counter[str]:
        """Requests that ended neither answered nor cleanly refused, outside the kill window."""
        return Counter(e.label for e in self.ended if not e.clean and not self.in_kill_window(e))

    @property
    def server_errors_outside_kill(self) -> int:
        """5xx other than a clean 503/504, and cut connections, outside the kill window."""
        return sum(1 for e in self.ended if not self.in_kill_window(e) and not e.clean
                   and (e.status is None or e.status >= 500) and e.label != "hung")

    @property
    def in_kill_window_failed(self) -> Counter[str]:
        return Counter(e.label for e in self.ended if not e.clean and self.in_kill_window(e))


def kill_busiest(ended: Sequence[Ended]) -> int:
    """SIGKILL the replica process (on this machine) that answered most; its pid."""
    pid = Counter(e.pid for e in ended if e.pid is not None).most_common(1)[0][0]
    os.kill(pid, signal.SIGKILL)
    return pid


async def soak_server(url: str, headers: dict[str, str], prompts: Sequence[list[dict]], *, seconds: float | None = None,
                      requests: int | None = None, callers: int = 6, seed: int = 0, max_tokens: int = 32,
                      hang_s: float = 120.0, kinds: Sequence[str] = KINDS, model: str = MODEL,
                      max_body_bytes: int = 4 << 20, kill_at_s: float | None = None,
                      kill: Callable[[Sequence[Ended]], int] = kill_busiest,
                      transport: httpx.AsyncBaseTransport | None = None) -> ServeSoakReport:
    """Soak the server at `url` (its /v1 base) for `seconds` or `requests` requests (see the
    module doc); then one normal greedy request must be answered (`answered_after`).
    `kill(ended so far)` kills a replica at `kill_at_s` and returns its pid; `transport`: httpx's
    (a fake server in tests)."""
    if seconds is None and requests is None:
        raise ValueError("soak_server needs seconds or requests")
    rng = random.Random(seed)
    report = ServeSoakReport()
    start = time.monotonic()
    chat = url.rstrip("/") + "/chat/completions"
    sent = 0

    def next_spec() -> Spec | None:  # one seeded sequence, whichever caller takes each
        nonlocal sent
        if (requests is not None and sent >= requests) or (seconds is not None and time.monotonic() - start >= seconds):
            return None
        sent += 1
        return draw(rng, prompts, rng.choice(kinds), model, max_tokens, max_body_bytes)

    async def caller(http: httpx.AsyncClient) -> None:
        while (spec := next_spec()) is not None:
            began = time.monotonic() - start
            ended = await send(http, chat, spec, hang_s)
            ended.start, ended.end = began, time.monotonic() - start
            report.ended.append(ended)
            if ended.status == 429:  # as a client honouring Retry-After does (jittered, at most 10 s)
                await asyncio.sleep(min(10.0, ended.retry_after or 1.0) * rng.uniform(0.5, 1.5))
            if kill_at_s is not None and not report.kill and ended.end >= kill_at_s and ended.pid is not None:
                before = sorted({e.pid for e in report.ended if e.pid is not None})
                report.kill = {"pid": kill(report.ended), "at_s": time.monotonic() - start, "replicas_before": before}
            if report.kill and "replaced_at_s" not in report.kill and ended.pid is not None \
                    and ended.start > report.kill["at_s"] and ended.pid not in report.kill["replicas_before"]:
                report.kill.update(replaced_at_s=ended.end, replaced_by=ended.pid)

    limits = httpx.Limits(max_connections=callers + 4, max_keepalive_connections=callers)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(hang_s), limits=limits,
                                 transport=transport) as http:
        await asyncio.gather(*(caller(http) for _ in range(callers)))
        report.seconds = time.monotonic() - start
        normal = Spec("plain", {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
                                "temperature": 0})
        for _ in range(3):  # a 429 or 503 is a fair answer once; an answer must come
            after = await send(http, chat, normal, hang_s)
            if after.status not in (429, 503):
                break
            await asyncio.sleep(2.0)
        report.answered_after = after.label == "200"
    if report.kill:
        report.kill["answered_after_kill"] = sum(1 for e in report.ended
                                                 if e.label == "200" and e.start > report.kill["at_s"])
    return report

