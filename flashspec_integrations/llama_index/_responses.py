"""Engine outcomes -> LlamaIndex responses, with token usage and FlashSpec statistics.

Every finished response carries them in `raw` (`usage` in the OpenAI shape TokenCountingHandler
reads, and `flashspec`: the step domain, each step's arm, acceptance counts) and in
`additional_kwargs` (flat token counts plus `flashspec`); streamed chunks before the last are
marked `flashspec_partial` and carry no statistics yet. Tool calls go on the message as
`ToolCallBlock`s and in `additional_kwargs["tool_calls"]` in OpenAI's shape (where llama-index-core's
structured streaming looks). Streamed text deltas with tools in play go through the shared
`ToolCallStreamer`: call markup never reaches a delta, and the calls come whole on the last chunk.
"""
from __future__ import annotations

import json
import time
from collections.abc import Generator, Iterable, Iterator

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)

from flashspec_core.results import StreamChunk
from flashspec_integrations.calls import Outcome
from flashspec_integrations.plan import CallPlan
from flashspec_integrations.tool_calls import ParsedCall, new_call_id

PARTIAL = "flashspec_partial"


def _final_info(outcome: Outcome) -> tuple[dict, dict]:
    usage = {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }
    flashspec = outcome.info()
    raw = {"usage": usage, "flashspec": flashspec, "finish_reason": outcome.finish_reason}
    return raw, {**usage, "flashspec": flashspec}


def _calls(req: CallPlan, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
    content, calls = req.read(text, finished)
    calls = [c for c in calls if c.name]  # a call without a tool name cannot be run
    if not calls and req.forced_name is not None:
        # The call was forced, so its tool is certain even when its arguments came out unreadable
        # (cut off by the token limit): report the call and let the tool reject the arguments.
        raw = text[len(req.prefix):].strip()
        return content, [ParsedCall(new_call_id(), req.forced_name, None, raw, "unreadable arguments")]
    return content, calls


def _message(req: CallPlan, text: str, final: bool, finished: bool = True) -> ChatMessage:
    if not final or not req.parse_tools:
        return ChatMessage(role=MessageRole.ASSISTANT, content=text)
    content, calls = _calls(req, text, finished)
    if not calls:
        return ChatMessage(role=MessageRole.ASSISTANT, content=text)
    blocks = [ToolCallBlock(tool_call_id=c.id, tool_name=str(c.name),  # `_calls` keeps named calls only
                            tool_kwargs=c.arguments if c.valid and c.arguments is not None else c.raw) for c in calls]
    openai_calls = [{"id": c.id, "type": "function", "function": {
        "name": c.name, "arguments": json.dumps(c.arguments) if c.valid else c.raw}} for c in calls]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=([TextBlock(text=content)] if content else []) + blocks,
                       additional_kwargs={"tool_calls": openai_calls})


def completion_response(req: CallPlan, outcome: Outcome) -> CompletionResponse:
    raw, extra = _final_info(outcome)
    return CompletionResponse(text=outcome.text, raw=raw, additional_kwargs=extra)


def chat_response(req: CallPlan, outcome: Outcome) -> ChatResponse:
    raw, extra = _final_info(outcome)
    message = _message(req, outcome.text, final=True, finished=outcome.finish_reason != "length")
    return ChatResponse(message=message, raw=raw, additional_kwargs=extra)


def _stream_steps(req: CallPlan, chunks: Iterable[StreamChunk]) -> Iterator[tuple[str, str, Outcome | None]]:
    """(delta, text so far, the Outcome on the last chunk) per chunk; the prefix comes first."""
    call = req
    text, ids, start = call.prefix, [], time.perf_counter()
    if call.prefix:
        yield call.prefix, text, None
    for chunk in chunks:
        text += chunk.text
        ids.extend(chunk.token_ids)
        outcome = None
        if chunk.finish_reason is not None:
            outcome = Outcome(text, ids, chunk.finish_reason, chunk.stats, len(call.prompt_ids),
                              time.perf_counter() - start, call.decision)
        yield chunk.text, text, outcome


def completion_stream(req: CallPlan, chunks: Iterable[StreamChunk]) -> Generator[CompletionResponse, None, None]:
    for delta, text, outcome in _stream_steps(req, chunks):
        raw, extra = _final_info(outcome) if outcome is not None else (None, {PARTIAL: True})
        yield CompletionResponse(text=text, delta=delta, raw=raw, additional_kwargs=extra)


def chat_stream(req: CallPlan, chunks: Iterable[StreamChunk]) -> Generator[ChatResponse, None, None]:
    """Chat chunks: the text so far and its delta, with tools in play the text outside calls only."""
    streamer = req.streamer()
    shown = ""
    for delta, text, outcome in _stream_steps(req, chunks):
        if streamer is not None:
            pieces = list(streamer.feed(delta))
            if outcome is not None:
                pieces += list(streamer.finish(outcome.finish_reason != "length"))
            delta = "".join(content for content, _ in pieces)
            shown += delta
        else:
            shown = text
        if outcome is None:
            yield ChatResponse(message=_message(req, shown, False), delta=delta, additional_kwargs={PARTIAL: True})
            continue
        raw, extra = _final_info(outcome)
        message = _message(req, text, True, outcome.finish_reason != "length")
        yield ChatResponse(message=message, delta=delta, raw=raw, additional_kwargs=extra)
