"""LlamaIndex chat messages -> OpenAI-form dicts with text content, for `flashspec_integrations.prompts`.

Tool calls come from `ToolCallBlock`s, or, from older integrations, from
`additional_kwargs["tool_calls"]` in OpenAI's shape; tool results keep their `tool_call_id`.
Content a text-only model cannot read is an error naming the message, not silently dropped.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import CachePoint, ChatMessage, TextBlock, ThinkingBlock, ToolCallBlock

from flashspec_integrations.domain_rules import TOOL_ROLE, normalize_role

_SKIPPED_BLOCKS = (ThinkingBlock, CachePoint)


def _legacy_calls(message: ChatMessage) -> list[dict]:
    """Calls stored the OpenAI way in additional_kwargs['tool_calls'] (dicts or OpenAI objects)."""
    calls = []
    for call in message.additional_kwargs.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, Mapping) else getattr(call, "function", call)
        get = function.get if isinstance(function, Mapping) else lambda k, f=function: getattr(f, k, None)
        if get("name"):
            call_id = call.get("id") if isinstance(call, Mapping) else getattr(call, "id", None)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": str(get("name")), "arguments": get("arguments")}})
    return calls


def openai_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """One message as an OpenAI-form dict; ValueError for content a text-only model cannot read."""
    if not isinstance(message, ChatMessage):
        raise ValueError(f"messages: item {index} is a {type(message).__name__}, expected a ChatMessage")
    texts, calls = [], []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolCallBlock):
            calls.append({"id": block.tool_call_id, "type": "function",
                          "function": {"name": block.tool_name, "arguments": block.tool_kwargs}})
        elif not isinstance(block, _SKIPPED_BLOCKS):
            raise ValueError(
                f"messages: message {index} has a {type(block).__name__}; FlashSpecLLM reads text only, "
                "so pass text blocks (describe images or documents in text)"
            )
    item: dict[str, Any] = {"role": normalize_role(message.role), "content": "\n".join(t for t in texts if t)}
    calls = calls or _legacy_calls(message)
    if calls:
        item["tool_calls"] = calls
    if item["role"] == TOOL_ROLE and message.additional_kwargs.get("tool_call_id"):
        item["tool_call_id"] = message.additional_kwargs["tool_call_id"]
    return item


def to_openai_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise ValueError("messages: empty; pass at least one ChatMessage")
    return [openai_message(m, i) for i, m in enumerate(messages)]
