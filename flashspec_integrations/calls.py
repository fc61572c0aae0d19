"""One engine call as both adapters build it, what comes back, and the streamed and timed paths.

An adapter turns a framework call into a `CallPlan` (`flashspec_integrations.plan`) in the
caller's context, then runs or streams it here; either way it gets an `Outcome`
or the engine's chunks back and turns them into its framework's response objects. Every call is
its own engine request: concurrent calls (LangChain's `batch`/`abatch`, LangGraph branches,
LlamaIndex's async fan-out) join the engine's running batch as they come, each with its own
settings, and leave it when done.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from flashspec_core.engine_protocol import Engine
from flashspec_core.handle import RequestHandle
from flashspec_core.results import GenerationResult, GenerationStats, StreamChunk
from flashspec_integrations.domain_rules import DomainDecision
from flashspec_integrations.plan import CallPlan


@dataclass
class Outcome:
    """A finished call: output text (prefix included), its tokens, why it ended and the engine stats."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats | None
    prompt_tokens: int
    seconds: float
    decision: DomainDecision

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def info(self) -> dict[str, Any]:
        """The FlashSpec statistics of the call: domain and the rule that chose it, arms, acceptance, speed."""
        stats = self.stats.as_dict() if self.stats is not None else {"domain": self.decision.label}
        arms = stats.get("arms", [])
        return {
            **stats,
            "draft": Counter(arms).most_common(1)[0][0] if arms else None,
            "hint": self.decision.hint,
            "domain_source": self.decision.source,
            "agent_node": self.decision.node,
            "finish_reason": self.finish_reason,
            "tokens_per_second": round(self.completion_tokens / self.seconds, 3) if self.seconds else 0.0,
        }


def _outcome(call: CallPlan, res: GenerationResult) -> Outcome:
    return Outcome(call.prefix + res.text, list(res.token_ids), res.finish_reason, res.stats, res.prompt_tokens,
                   res.stats.seconds if res.stats is not None else 0.0, call.decision)


def _submit(engine: Engine, calls: Sequence[CallPlan], timeout: float | None) -> list[RequestHandle]:
    """Each call as its own engine request (its rows join the engine's running batch); if one is
    refused (bad input, a full queue), the ones already queued are cancelled and the error raised."""
    handles: list[RequestHandle] = []
    try:
        for call in calls:
            handles.append(engine.submit([call.prompt_ids], call.options(timeout)))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


def run_calls(engine: Engine, calls: Sequence[CallPlan], timeout: float | None = None,
              max_retries: int = 0) -> list[Outcome]:
    """Run `calls` side by side in the engine and wait for all of them (the first error is raised).
    A call that runs past `timeout` seconds is tried again up to `max_retries` times."""
    handles = _submit(engine, calls, timeout)
    outcomes = []
    for call, handle in zip(calls, handles):
        for attempt in range(max_retries + 1):
            try:
                outcomes.append(_outcome(call, handle.wait()[0]))
                break
            except TimeoutError:
                if attempt == max_retries:
                    for other in handles:
                        other.cancel()
                    raise
                handle = engine.submit([call.prompt_ids], call.options(timeout))
    return outcomes


async def arun_calls(engine: Engine, calls: Sequence[CallPlan], timeout: float | None = None,
                     max_retries: int = 0) -> list[Outcome]:
    """`run_calls` for a coroutine: waits without holding a thread; cancelling it cancels the calls."""
    async def one(call: CallPlan, handle: RequestHandle) -> Outcome:
        for attempt in range(max_retries + 1):
            try:
                return _outcome(call, (await handle.wait_async())[0])
            except TimeoutError:
                if attempt == max_retries:
                    raise
                handle = engine.submit([call.prompt_ids], call.options(timeout))
        raise AssertionError("unreachable")

    handles = _submit(engine, calls, timeout)
    try:
        return list(await asyncio.gather(*(one(c, h) for c, h in zip(calls, handles))))
    finally:
        for handle in handles:
            if not handle.done:
                handle.cancel()


def stream_call(engine: Engine, call: CallPlan, timeout: float | None = None) -> Iterator[StreamChunk]:
    """The engine's chunks for one call; TimeoutError once `timeout` seconds have passed (the
    engine ends the request at its next step boundary, also during a long prefill)."""
    chunks = engine.stream(call.prompt_ids, call.options(timeout))
    try:
        yield from chunks
    finally:
        chunks.close()
