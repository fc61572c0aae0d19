"""LangChain messages -> OpenAI-form dicts with text content, for `flashspec_integrations.prompts`.

langchain-core's `convert_to_openai_messages` does the conversion (roles, tool calls with their
ids, tool results, text blocks joined); this module only insists on text, since the target reads
nothing else, and says so naming the message.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage, convert_to_openai_messages

# Content blocks that carry no text for the prompt: reasoning, and tool-use blocks, whose calls
# are rendered from the message's `tool_calls`.
_SKIPPED_BLOCKS = ("reasoning", "thinking", "tool_use", "tool_call", "function_call")


def content_text(content: Any, where: str) -> str:
    """A message's content as plain text; ValueError for media this text-only model cannot read."""
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[str] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(block, str):
            parts.append(block)
        elif kind in ("text", "output_text"):
            parts.append(str(block.get("text") or ""))
        elif kind not in _SKIPPED_BLOCKS:
            raise ValueError(
                f"{where}: content blocks of type {kind!r} are not supported; the FlashSpec target reads "
                "text only, so pass text content"
            )
    return "\n".join(p for p in parts if p)


def to_openai_dicts(messages: Sequence[BaseMessage]) -> list[dict]:
    """OpenAI-form message dicts with string content."""
    if not messages:
        raise ValueError("messages: the list is empty; pass at least one message")
    try:
        dicts = convert_to_openai_messages(list(messages), text_format="string")
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise ValueError(f"messages: {exc}; pass LangChain chat messages") from exc
    for i, item in enumerate(dicts):
        item["content"] = content_text(item.get("content"), f"messages[{i}]")
    return dicts
