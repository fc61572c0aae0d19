"""LlamaIndex chat messages -> the target's chat template -> prompt text.

The target model was trained on its own chat template, so messages go through
`tokenizer.apply_chat_template` rather than LlamaIndex's generic "role: content" rendering.
Tool traffic is written in the form the tool instructions describe (calls in `<tool_call>` tags,
results in `<tool_response>` tags), so a model sees its earlier calls as it was asked to write them.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)

from flashspec_integrations.llama_index._tools import render_call, render_result

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "tool",
}
_SKIPPED_BLOCKS = (ThinkingBlock, CachePoint)


def _legacy_calls(message: ChatMessage) -> list[str]:
    """Calls stored the OpenAI way in additional_kwargs['tool_calls'] (older integrations)."""
    rendered = []
    for call in message.additional_kwargs.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, Mapping) else getattr(call, "function", call)
        name = function.get("name") if isinstance(function, Mapping) else getattr(function, "name", None)
        args = function.get("arguments") if isinstance(function, Mapping) else getattr(function, "arguments", None)
        if name:
            rendered.append(render_call(str(name), args))
    return rendered


def message_text(message: ChatMessage, index: int) -> str:
    """The text of one message, tool calls written out; ValueError for content a text model cannot read."""
    parts: list[str] = []
    has_call_blocks = False
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, ToolCallBlock):
            has_call_blocks = True
            parts.append(render_call(block.tool_name, block.tool_kwargs))
        elif not isinstance(block, _SKIPPED_BLOCKS):
            raise ValueError(
                f"messages: message {index} has a {type(block).__name__}; FlashSpecLLM reads text only, "
                "so pass text blocks (describe images or documents in text)"
            )
    if not has_call_blocks:
        parts.extend(_legacy_calls(message))
    return "\n".join(p for p in parts if p)


def to_template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Role/content dicts for the chat template; tool results wrapped in `<tool_response>` tags."""
    if not messages:
        raise ValueError("messages: empty; pass at least one ChatMessage")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise ValueError(f"messages: item {i} is a {type(message).__name__}, expected a ChatMessage")
        role = _ROLES.get(message.role, str(getattr(message.role, "value", message.role)))
        text = message_text(message, i)
        out.append({"role": role, "content": render_result(text) if role == "tool" else text})
    return out


def add_system_text(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    """Append `text` to the leading system message, or start the conversation with one."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=(messages[0]["content"] + "\n\n" + text).strip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render_chat(tokenizer: Any, messages: list[dict[str, str]], assistant_prefix: str = "") -> str:
    """The prompt text: the chat template with the generation prompt, then the assistant's prefill.

    A template that rejects the `tool` role gets tool results as user turns instead (the
    `<tool_response>` tags still mark them).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the target tokenizer has no chat template; pass messages_to_prompt= to FlashSpecLLM")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2 raises its own TemplateError for unsupported roles
        if not any(m["role"] == "tool" for m in messages):
            raise ValueError(f"messages: the target's chat template rejected them: {exc}") from exc
        fallback = [dict(m, role="user") if m["role"] == "tool" else m for m in messages]
        text = tokenizer.apply_chat_template(fallback, add_generation_prompt=True, tokenize=False)
    return text + assistant_prefix

