"""Engine results -> LlamaIndex responses, with token usage and FlashSpec statistics.

Every finished response carries the same information in two places, because LlamaIndex code
reads both: `raw` (a dict: `usage` in the OpenAI shape that TokenCountingHandler understands, and
`flashspec` with the step domain, the arm of every step and the acceptance counts) and
`additional_kwargs` (flat token counts plus `flashspec`). Streamed chunks before the last are
marked `flashspec_partial` and carry no statistics yet: the engine reports them when it finishes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)

from flashspec_core.results import GenerationResult, GenerationStats, StreamChunk
from flashspec_integrations.llama_index._tools import parse_tool_calls

PARTIAL = "flashspec_partial"


@dataclass
class Request:
    """One prepared call: the prompt the engine gets and how to read what comes back."""

    prompt_ids: list[int]
    engine_kwargs: dict[str, Any]  # max_new_tokens, sampling, stop, domain, hint (+ constraint)
    prefix: str = ""  # assistant text written before generation: the start of a forced call
    tool_names: tuple[str, ...] | None = None  # parse tool calls from the output when set
    single_call: bool = False  # keep only the first call (parallel calls not allowed)
    forced_name: str | None = None  # the tool a forced call must call, known before generation

    @property
    def hint(self) -> str | None:
        return self.engine_kwargs.get("hint")


def _final_info(req: Request, completion_tokens: int, stats: GenerationStats | None, finish_reason: str | None):
    prompt_tokens = len(req.prompt_ids)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    flashspec = dict(stats.as_dict() if stats is not None else {})
    flashspec.update(finish_reason=finish_reason, hint=req.hint)
    raw = {"usage": usage, "flashspec": flashspec, "finish_reason": finish_reason}
    return raw, {**usage, "flashspec": flashspec}


def _message(req: Request, text: str, final: bool) -> ChatMessage:
    if not final or req.tool_names is None:
        return ChatMessage(role=MessageRole.ASSISTANT, content=text)
    before, calls = parse_tool_calls(text, req.tool_names)
    if not calls and req.forced_name is not None:
        # The call was forced, so its tool is certain even when its arguments came out unreadable
        # (cut off by the token limit): report the call and let the tool reject the arguments.
        raw_args = text[len(req.prefix):].strip()
        calls = [ToolCallBlock(tool_call_id="call_forced", tool_name=req.forced_name, tool_kwargs=raw_args or {})]
    if not calls:
        return ChatMessage(role=MessageRole.ASSISTANT, content=text)
    if req.single_call:
        calls = calls[:1]
    blocks = ([TextBlock(text=before)] if before else []) + calls
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)


def completion_response(req: Request, result: GenerationResult) -> CompletionResponse:
    raw, extra = _final_info(req, len(result.token_ids), result.stats, result.finish_reason)
    return CompletionResponse(text=req.prefix + result.text, raw=raw, additional_kwargs=extra)


def chat_response(req: Request, result: GenerationResult) -> ChatResponse:
    raw, extra = _final_info(req, len(result.token_ids), result.stats, result.finish_reason)
    message = _message(req, req.prefix + result.text, final=True)
    return ChatResponse(message=message, raw=raw, additional_kwargs=extra)


def _stream_steps(req: Request, chunks: Iterable[StreamChunk]) -> Iterator[tuple[str, str, bool, tuple]]:
    """(delta, text so far, final, (raw, additional_kwargs)) per chunk; the prefix comes first."""
    text, tokens = req.prefix, 0
    if req.prefix:
        yield req.prefix, text, False, (None, {PARTIAL: True})
    for chunk in chunks:
        text += chunk.text
        tokens += len(chunk.token_ids)
        if chunk.stats is not None:
            yield chunk.text, text, True, _final_info(req, tokens, chunk.stats, chunk.finish_reason)
        else:
            yield chunk.text, text, False, (None, {PARTIAL: True})


def completion_stream(req: Request, chunks: Iterable[StreamChunk]) -> Iterator[CompletionResponse]:
    for delta, text, _, (raw, extra) in _stream_steps(req, chunks):
        yield CompletionResponse(text=text, delta=delta, raw=raw, additional_kwargs=extra)


def chat_stream(req: Request, chunks: Iterable[StreamChunk]) -> Iterator[ChatResponse]:
    for delta, text, final, (raw, extra) in _stream_steps(req, chunks):
        yield ChatResponse(message=_message(req, text, final), delta=delta, raw=raw, additional_kwargs=extra)
