"""One engine call as both adapters build it, what comes back, and the streamed and timed paths.

An adapter turns a framework call into an `EngineCall` (prompt ids, decoding settings, the router
decision) in the caller's context, then hands it to the batcher (`batching.py`, non-streaming
calls) or streams it here; either way it gets an `Outcome` or the engine's chunks back and turns
them into its framework's response objects.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from flashspec_core import SamplingParams
from flashspec_core.results import GenerationStats, StreamChunk
from flashspec_core.routing.domains import classify_prompt
from flashspec_integrations.context import DomainDecision


@dataclass
class EngineCall:
    """One engine request. prompt_ids: the rendered prompt with `prefix` (assistant text written
    before generation: a forced call's opening, ReAct's "Thought:") already appended."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    decision: DomainDecision
    prompt_text: str = ""  # the rendered prompt, for the classifier when the adapter decided nothing
    prefix: str = ""
    json_schema: dict | None = None

    @property
    def hint(self) -> str | None:
        """The hint the engine gets: the adapter's, else the classifier's label of this prompt, so a
        batch (which shares one domain) only holds prompts of one label."""
        if self.decision.domain is not None:
            return None
        return self.decision.hint or classify_prompt(self.prompt_text)

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens, "sampling": self.sampling, "stop": self.stop or None,
            "domain": self.decision.domain, "hint": self.hint,
        }
        if self.json_schema is not None:
            kwargs["json_schema"] = self.json_schema
        return kwargs

    def batch_key(self) -> Hashable:
        """Calls with equal keys can share one engine batch (which shares every engine argument).
        A seeded sampled call gets a key of its own: its draws must not depend on its batch-mates."""
        if self.sampling.seed is not None and not self.sampling.greedy:
            return ("alone", id(self))
        schema = json.dumps(self.json_schema, sort_keys=True) if self.json_schema is not None else None
        return (self.decision.domain, self.hint, self.max_new_tokens, self.sampling.model_dump_json(),
                tuple(self.stop), schema)


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
    batch_size: int = 1

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
            "batch_size": self.batch_size,
            "tokens_per_second": round(self.completion_tokens / self.seconds, 3) if self.seconds else 0.0,
        }


def stream_call(engine: Any, call: EngineCall, timeout: float | None = None) -> Iterator[StreamChunk]:
    """The engine's chunks for one call; TimeoutError once `timeout` seconds have passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks = engine.stream(call.prompt_ids, **call.engine_kwargs())
    try:
        for chunk in chunks:
            yield chunk
            if deadline is not None and chunk.finish_reason is None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"generation took longer than timeout={timeout} s; raise timeout or lower max_tokens")
    finally:
        chunks.close()


def run_streamed(engine: Any, call: EngineCall, timeout: float | None, max_retries: int = 0) -> Outcome:
    """Run one call to the end through the stream (so it can be timed), retrying a timed-out
    attempt up to `max_retries` times. Calls without a timeout go through the batcher instead."""
    for attempt in range(max_retries + 1):
        start = time.perf_counter()
        text, ids, last = call.prefix, [], None
        try:
            for chunk in stream_call(engine, call, timeout):
                text += chunk.text
                ids.extend(chunk.token_ids)
                last = chunk
        except TimeoutError:
            if attempt == max_retries:
                raise
            continue
        return Outcome(text, ids, last.finish_reason or "length", last.stats, len(call.prompt_ids),
                       time.perf_counter() - start, call.decision)
    raise AssertionError("unreachable")
