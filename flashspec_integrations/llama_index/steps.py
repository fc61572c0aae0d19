"""Record the domain and the drafts of every FlashSpecLLM call through LlamaIndex instrumentation.

A LlamaIndex event handler: it listens to the LLM end events that `FlashSpecLLM`'s callbacks
already emit and reads the FlashSpec statistics every finished response carries, so a run of
several LLM calls gives a per-step log without threading anything through the framework.

    with record_steps() as recorder:
        query_engine.query("...")
    for step in recorder.steps: print(step.describe())
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent


@dataclass
class LLMStep:
    """One finished FlashSpecLLM call: what kind of step it was and how it was drafted."""

    kind: str  # "chat" or "completion"
    domain: str
    hint: str | None
    arms: list[str] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    completion_tokens: int = 0
    tool_calls: list[str] = field(default_factory=list)
    text: str = ""

    @property
    def main_draft(self) -> str:
        """The arm the router chose most often in this call."""
        return Counter(self.arms).most_common(1)[0][0] if self.arms else "none"

    def describe(self) -> str:
        calls = f" tool_calls={self.tool_calls}" if self.tool_calls else ""
        return (
            f"[{self.kind}] domain={self.domain} draft={self.main_draft} steps={len(self.arms)} "
            f"accepted={self.accepted}/{self.drafted} tokens={self.completion_tokens}{calls}"
        )


def step_from_response(kind: str, response: Any) -> LLMStep | None:
    """The step a finished FlashSpecLLM response describes; None for other LLMs' responses."""
    raw = getattr(response, "raw", None)
    info = raw.get("flashspec") if isinstance(raw, dict) else None
    if not info:
        return None
    message = getattr(response, "message", None)
    blocks = getattr(message, "blocks", []) if message is not None else []
    text = getattr(response, "text", None) if message is None else (message.content or "")
    return LLMStep(
        kind=kind,
        domain=str(info.get("domain")),
        hint=info.get("hint"),
        arms=list(info.get("arms") or []),
        drafted=int(info.get("drafted") or 0),
        accepted=int(info.get("accepted") or 0),
        completion_tokens=int(((raw or {}).get("usage") or {}).get("completion_tokens") or 0),
        tool_calls=[b.tool_name for b in blocks if getattr(b, "block_type", None) == "tool_call"],
        text=text or "",
    )


class StepRecorder(BaseEventHandler):
    """Collects an `LLMStep` per finished FlashSpecLLM call (thread-safe: async calls run in threads)."""

    _steps: list[LLMStep] = PrivateAttr(default_factory=list)
    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "FlashSpecStepRecorder"

    @property
    def steps(self) -> list[LLMStep]:
        with self._lock:
            return list(self._steps)

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent):
            step = step_from_response("chat", event.response)
        elif isinstance(event, LLMCompletionEndEvent):
            step = step_from_response("completion", event.response)
        else:
            return
        if step is not None:
            with self._lock:
                self._steps.append(step)


@contextlib.contextmanager
def record_steps() -> Iterator[StepRecorder]:
    """Record the FlashSpecLLM steps made inside (on the root dispatcher, which sees every call)."""
    dispatcher = get_dispatcher()
    recorder = StepRecorder()
    dispatcher.add_event_handler(recorder)
    try:
        yield recorder
    finally:
        dispatcher.event_handlers = [h for h in dispatcher.event_handlers if h is not recorder]
