"""LangChain messages -> the target's chat template, with tools, tool calls and tool results.

When the target's template renders tools itself (its source mentions `tools`), messages go in the
Hugging Face tool-use format (assistant `tool_calls`, `tool` role results) and the tool schemas go
through `apply_chat_template(tools=...)`. The default model's template has no tool support, so the
fallback renders the Hermes/Qwen convention most small instruct models have seen: the tool schemas
and the call format in the system message, assistant calls as `<tool_call>{json}</tool_call>`
blocks, and tool results as a user turn of `<tool_response>` blocks. `langchain_tools` parses the
same format back, so what a model reads in its history is what it is asked to write.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_TOOLS_HEADER = (
    "You may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)
_JSON_HEADER = "Reply with one JSON object only, no other text{schema}."

# Content block types that carry text; tool-use blocks are rendered from `tool_calls` instead.
_TEXT_BLOCKS = ("text", "output_text")
_SKIPPED_BLOCKS = ("tool_use", "tool_call", "function_call", "reasoning", "thinking")


def content_text(content: Any, where: str = "messages") -> str:
    """A message's content as plain text; ValueError for media this text-only model cannot read."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _TEXT_BLOCKS:
            parts.append(str(block.get("text") or ""))
        elif kind in _SKIPPED_BLOCKS:
            continue
        else:
            raise ValueError(
                f"{where}: content blocks of type {kind!r} are not supported; the FlashSpec target "
                "reads text only, so pass text content"
            )
    return "".join(parts)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the target's chat template renders tools itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def _call_json(name: str, args: Any) -> str:
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


def _role(message: BaseMessage) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, ToolMessage):
        return "tool"
    if isinstance(message, ChatMessage):
        return message.role
    role = getattr(message, "type", None)
    if role == "function":
        return "tool"
    raise ValueError(f"messages: unsupported message type {type(message).__name__}; use LangChain chat messages")


def message_roles(messages: Sequence[BaseMessage]) -> list[str]:
    """The role of each message as the template sees it (system, user, assistant, tool, ...)."""
    return [_role(m) for m in messages]


def _native(messages: Sequence[BaseMessage]) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(messages):
        role, text = _role(m), content_text(m.content, f"messages[{i}]")
        item: dict[str, Any] = {"role": role, "content": text}
        if isinstance(m, AIMessage) and m.tool_calls:
            item["tool_calls"] = [
                {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                for c in m.tool_calls
            ]
        if isinstance(m, ToolMessage):
            item["tool_call_id"] = m.tool_call_id
            if m.name:
                item["name"] = m.name
        out.append(item)
    return out


def _fallback(messages: Sequence[BaseMessage], system_extra: str = "") -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(messages):
        role, text = _role(m), content_text(m.content, f"messages[{i}]")
        if role == "tool":
            block = f"{TOOL_RESPONSE_OPEN}\n{text}\n{TOOL_RESPONSE_CLOSE}"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if isinstance(m, AIMessage) and m.tool_calls:
            calls = "\n".join(f"{TOOL_CALL_OPEN}\n{_call_json(c['name'], c['args'])}\n{TOOL_CALL_CLOSE}" for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        out.append({"role": role, "content": text})
    for item in out:
        item.pop("_tool_results", None)
    return _with_system(out, system_extra)


def _with_system(dicts: list[dict], extra: str) -> list[dict]:
    """`extra` appended to the system message, or as a new one first."""
    if not extra:
        return dicts
    if dicts and dicts[0]["role"] == "system":
        first = dicts[0]["content"]
        return [{**dicts[0], "content": f"{first}\n\n{extra}" if first else extra}] + dicts[1:]
    return [{"role": "system", "content": extra}] + dicts


def json_instruction(schema: dict | None) -> str:
    """The system-prompt line asking for one JSON object (matching `schema` when it says more
    than "an object": printed, a bare {"type": "object"} reads as an example, and the model copied
    a "type" key)."""
    shown = "" if not schema or schema == {"type": "object"} else (
        f" matching this JSON schema:\n{json.dumps(schema, ensure_ascii=False)}")
    return _JSON_HEADER.format(schema=shown)


def render_chat(
    tokenizer: Any,
    messages: Sequence[BaseMessage],
    tools: Sequence[dict] = (),
    system_extra: str = "",
) -> str:
    """The prompt text for `messages` through the target's template, generation prompt included.

    tools: OpenAI-format tool dicts. system_extra: an instruction appended to the system message
    (a JSON-output request); the tool block is added to it in the fallback format.
    """
    if not messages:
        raise ValueError("messages: the list is empty; pass at least one message")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: the target's tokenizer has no chat template; use FlashSpecLLM with a text prompt")
    if tools and template_supports_tools(tokenizer):
        dicts = _with_system(_native(messages), system_extra)
        return tokenizer.apply_chat_template(dicts, tools=list(tools), add_generation_prompt=True, tokenize=False)
    extra = system_extra
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        header = _TOOLS_HEADER.format(tools=listing)
        extra = f"{header}\n\n{extra}" if extra else header
    return tokenizer.apply_chat_template(_fallback(messages, extra), add_generation_prompt=True, tokenize=False)
