"""Chat messages (OpenAI form) -> the target's chat template, with tools, calls and tool results.

Both adapters convert their framework's messages to OpenAI-form dicts and render them here, so one
conversation is one prompt whichever framework sent it. A template that renders tools itself (its
source mentions `tools`) gets the dicts and tool schemas through `apply_chat_template(tools=...)`.
Otherwise the Hermes/Qwen convention is rendered: the tool schemas and the call format in the
system message (`TOOLS_HEADER`), assistant calls as `<tool_call>{json}</tool_call>` blocks, tool
results as a user turn of `<tool_response>` blocks. `tool_calls.parse_tool_calls` reads the same
format back, so what a model reads in its history is what it is asked to write.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from flashspec_integrations.domain_rules import SYSTEM, TOOL_ROLE, normalize_role
from flashspec_integrations.tool_calls import CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN

TOOLS_HEADER = (
    "You may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)
JSON_HEADER = "Reply with one JSON object only, no other text{schema}."


def tools_instructions(tools: Sequence[Mapping]) -> str:
    """The system-prompt text that lists the tools (OpenAI-format dicts) and the call format."""
    return TOOLS_HEADER.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def json_instruction(schema: dict | None) -> str:
    """The system-prompt line asking for one JSON object (matching `schema` when it says more
    than "an object": printed, a bare {"type": "object"} reads as an example, and the model copied
    a "type" key)."""
    shown = "" if not schema or schema == {"type": "object"} else (
        f" matching this JSON schema:\n{json.dumps(schema, ensure_ascii=False)}")
    return JSON_HEADER.format(schema=shown)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the target's chat template renders tools itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def _arguments(args: Any) -> Any:
    """A call's arguments as a JSON value (OpenAI sends a JSON string; templates want the object)."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args  # kept as written: the history shows what the model wrote
    return {} if args is None else args


def _calls(message: Mapping) -> list[tuple[str, Any]]:
    out = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        out.append((str(function.get("name")), _arguments(function.get("arguments"))))
    return out


def _native(messages: Sequence[Mapping]) -> list[dict]:
    out = []
    for m in messages:
        item = {**m, "role": normalize_role(m["role"])}
        if m.get("tool_calls"):
            item["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {"name": name, "arguments": args}}
                                  for c, (name, args) in zip(m["tool_calls"], _calls(m))]
        out.append(item)
    return out


def _hermes(messages: Sequence[Mapping]) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        role, text = normalize_role(m["role"]), m.get("content") or ""
        if role == TOOL_ROLE:
            block = f"{RESPONSE_OPEN}\n{text}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
            continue
        calls = "\n".join(f"{CALL_OPEN}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{CALL_CLOSE}"
                          for n, a in _calls(m))
        if calls:
            text = f"{text}\n{calls}" if text else calls
        out.append({"role": role, "content": text})
    return [{k: v for k, v in m.items() if k != "_results"} for m in out]


def _with_system(messages: list[dict], extra: str) -> list[dict]:
    """`extra` appended to the system message, or as a new one first."""
    if not extra:
        return messages
    if messages and messages[0]["role"] == SYSTEM:
        first = messages[0].get("content") or ""
        return [{**messages[0], "content": f"{first}\n\n{extra}" if first else extra}] + messages[1:]
    return [{"role": SYSTEM, "content": extra}] + messages


def render_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping],
    tools: Sequence[Mapping] = (),
    system_extra: str = "",
) -> str:
    """The prompt text for OpenAI-form `messages`, generation prompt included.

    tools: OpenAI-format tool dicts. system_extra: an instruction appended to the system message
    (a JSON-output request); in the fallback format the tool listing goes there too.
    """
    if not messages:
        raise ValueError("messages: the list is empty; pass at least one message")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: the target's tokenizer has no chat template; pass a text prompt "
                         "(LangChain's FlashSpecLLM, or messages_to_prompt= in LlamaIndex)")
    if tools and template_supports_tools(tokenizer):
        dicts = _with_system(_native(messages), system_extra)
        return tokenizer.apply_chat_template(dicts, tools=list(tools), add_generation_prompt=True, tokenize=False)
    extra = system_extra
    if tools:
        extra = f"{tools_instructions(tools)}\n\n{extra}" if extra else tools_instructions(tools)
    dicts = _with_system(_hermes(messages), extra)
    return tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False)
