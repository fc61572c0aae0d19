"""Tool calls for the LlamaIndex adapter: the prompt format, lenient parsing, forced calls.

The model is asked to write calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the Hermes/Qwen convention, which small chat models have seen most and which the core domain
classifier recognises). A small model's JSON is often slightly broken, so parsing is lenient:
trailing commas, single quotes, Python literals and a call cut off by the token limit are all
repaired where the intent is unambiguous.

Forced calls (`tool_required`, or `tool_choice` naming a tool) are steered today by writing the
fixed start of the call into the assistant turn, so the model only fills in the arguments. The
seam for schema-constrained decoding (issue 7) is `constraint_kwargs`: when the engine's
`generate` accepts a `json_schema=` argument, the schema of the forced call goes there and the
prefill shrinks to the opening tag, so the grammar owns the whole JSON.
"""
from __future__ import annotations

import ast
import inspect
import json
import re
import uuid
from typing import Any, Mapping, Sequence

from llama_index.core.base.llms.types import ToolCallBlock

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# Text the assistant must never write itself: a tool result is the framework's to supply.
TOOL_STOPS = (RESPONSE_OPEN, RESPONSE_CLOSE)
# The engine argument a constrained decoder (issue 7) is expected to take; see `constraint_kwargs`.
SCHEMA_ARGUMENT = "json_schema"
_FORCING_CHOICES = ("required", "any")
_ARGUMENT_KEYS = ("arguments", "parameters", "args", "input", "kwargs")
_CALL_TAG = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)
_FENCE = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.S)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")


def tool_spec(tool: Any) -> dict:
    """An OpenAI-style function spec from a LlamaIndex tool, or a spec dict passed through."""
    if isinstance(tool, Mapping):
        spec = dict(tool)
        if "function" not in spec and "name" in spec:
            spec = {"type": "function", "function": spec}
        if not isinstance(spec.get("function"), Mapping) or "name" not in spec["function"]:
            raise ValueError(f"tools: a tool dict needs a function name; got {str(tool)[:80]!r}")
        return spec
    metadata = getattr(tool, "metadata", None)
    if metadata is None or not hasattr(metadata, "to_openai_tool"):
        raise ValueError(f"tools: expected LlamaIndex tools or OpenAI-style dicts; got {type(tool).__name__}")
    try:
        return metadata.to_openai_tool(skip_length_check=True)
    except TypeError:
        return metadata.to_openai_tool()


def tool_name(spec: Mapping) -> str:
    return str(spec["function"]["name"])


def tools_instructions(specs: Sequence[Mapping]) -> str:
    """The system-prompt text that lists the tools and the call format."""
    listing = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in specs)
    return (
        "You can call tools. Each tool is described as a JSON schema inside <tools></tools>:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a tool, reply with the call in this exact form:\n"
        f'{CALL_OPEN}\n{{"name": "<tool name>", "arguments": {{<the arguments as JSON>}}}}\n{CALL_CLOSE}\n'
        f"A tool's result comes back inside {RESPONSE_OPEN}{RESPONSE_CLOSE}. When you have what you "
        "need, answer the user in plain text without calling a tool."
    )


def render_call(name: str, arguments: Any) -> str:
    """A call as the model is asked to write it, for replaying assistant turns in the history."""
    if isinstance(arguments, str):
        args_text = arguments
    else:
        args_text = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args_text}}}\n{CALL_CLOSE}'


def render_result(content: str) -> str:
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


# ------------------------------------------------------------------------------------ parsing


def _balanced_object(text: str) -> str | None:
    """The first {...} in `text`, closed with whatever brackets and quotes a cut-off left open."""
    start = text.find("{")
    if start < 0:
        return None
    stack: list[str] = []
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if stack and stack[-1] == ch:
                stack.pop()
            if not stack:
                return text[start : i + 1]
    tail = text[start:].rstrip()
    if in_string:
        tail += '"'
    tail = tail.rstrip(",:")
    return tail + "".join(reversed(stack))


def loads_lenient(text: str) -> Any:
    """Parse JSON the way a small model writes it; raises ValueError when nothing sensible is there."""
    candidates = [text.strip()]
    obj = _balanced_object(text)
    if obj is not None:
        candidates.append(obj)
    for candidate in candidates:
        for attempt in (candidate, _TRAILING_COMMA.sub(r"\1", candidate)):
            try:
                return json.loads(attempt)
            except (json.JSONDecodeError, ValueError):
                pass
            try:
                value = ast.literal_eval(attempt)
                json.dumps(value)  # only JSON's types: a set or bytes literal is not a call
                return value
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                pass
    raise ValueError(f"not JSON: {text[:80]!r}")


def _match_name(name: Any, known: Sequence[str] | None) -> str | None:
    if not isinstance(name, str) or not name.strip():
        return None
    name = name.strip()
    if not known or name in known:
        return name
    folded = {k.lower(): k for k in known}
    return folded.get(name.lower(), name)


def _call_from_object(obj: Any, known: Sequence[str] | None) -> ToolCallBlock | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # OpenAI style {"function": {"name", "arguments"}}
        obj = obj["function"]
    name = _match_name(obj.get("name"), known)
    if name is None:
        return None
    arguments: Any = next((obj[k] for k in _ARGUMENT_KEYS if k in obj), {})
    if isinstance(arguments, str):
        try:
            arguments = loads_lenient(arguments)
        except ValueError:
            pass
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, (dict, str)):
        arguments = json.dumps(arguments, default=str)
    return ToolCallBlock(tool_call_id=f"call_{uuid.uuid4().hex[:12]}", tool_name=name, tool_kwargs=arguments)


def _call_from_body(body: str, known: Sequence[str] | None) -> ToolCallBlock | None:
    try:
        return _call_from_object(loads_lenient(body), known)
    except ValueError:
        pass
    # The arguments are beyond repair but the name may still be readable (e.g. a forced call).
    match = re.search(r'"name"\s*:\s*"([^"]+)"', body)
    name = _match_name(match.group(1), known) if match else None
    if name is None:
        return None
    rest = body[match.end():]
    args_match = re.search(r'"(?:' + "|".join(_ARGUMENT_KEYS) + r')"\s*:\s*(.*)$', rest, re.S)
    raw = args_match.group(1).strip() if args_match else ""
    return ToolCallBlock(tool_call_id=f"call_{uuid.uuid4().hex[:12]}", tool_name=name, tool_kwargs=raw or {})


def parse_tool_calls(text: str, known: Sequence[str] | None = None) -> tuple[str, list[ToolCallBlock]]:
    """Split model output into (the text before any call, the calls it makes).

    Tagged calls are taken whatever they name (the agent reports an unknown tool to the model);
    untagged JSON (a fenced block or a bare object) counts as a call only when it names one of
    `known`, so an ordinary JSON answer is not mistaken for a call.
    """
    tagged = list(_CALL_TAG.finditer(text))
    if tagged:
        calls = [c for c in (_call_from_body(m.group(1), known) for m in tagged) if c is not None]
        return text[: tagged[0].start()].strip(), calls
    if not known:
        return text, []
    bodies: list[tuple[int, str]] = []
    fence = _FENCE.search(text)
    if fence:
        bodies.append((fence.start(), fence.group(1)))
    start = text.find("{")
    if start >= 0:
        bodies.append((start, _balanced_object(text) or ""))
    for cut, body in bodies:
        try:
            call = _call_from_object(loads_lenient(body), None)
        except ValueError:
            continue
        if call is not None and call.tool_name in known:
            return text[:cut].strip(), [call]
    return text, []


# ------------------------------------------------------------------------------ forced calls


def forced_tool(specs: Sequence[Mapping], tool_choice: Any, tool_required: bool) -> tuple[bool, str | None]:
    """(is a call forced, the tool it must call or None for any) from LlamaIndex's arguments."""
    names = [tool_name(s) for s in specs]
    if isinstance(tool_choice, Mapping):
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", *_FORCING_CHOICES):
        if tool_choice not in names:
            raise ValueError(f"tool_choice: {tool_choice!r} is not one of the tools passed: {names}")
        return True, tool_choice
    if tool_required or tool_choice in _FORCING_CHOICES:
        return True, names[0] if len(names) == 1 else None
    return False, None


def forced_prefix(name: str | None, constrained: bool, parameters: Mapping | None = None) -> str:
    """The start of the assistant turn for a forced call; the model writes the rest.

    Without a constrained decoder the prefill goes as far as a grammar would force tokens: the
    tool name, and the key of a tool's only parameter (a 135M model otherwise often invents
    keys), up to the opening quote of a string value.
    """
    if constrained:
        return CALL_OPEN + "\n"
    if name is None:
        return CALL_OPEN + '\n{"name": "'
    prefix = CALL_OPEN + "\n" + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": {'
    properties = (parameters or {}).get("properties") or {}
    if len(properties) == 1:
        key, schema = next(iter(properties.items()))
        prefix += json.dumps(key, ensure_ascii=False) + ": "
        if isinstance(schema, Mapping) and schema.get("type") == "string":
            prefix += '"'
    return prefix


def forced_call_schema(specs: Sequence[Mapping], name: str | None) -> dict:
    """JSON schema of the call object a forced call must produce: for the constrained decoder."""
    options = []
    for spec in specs:
        if name is not None and tool_name(spec) != name:
            continue
        params = spec["function"].get("parameters") or {"type": "object"}
        options.append({
            "type": "object",
            "properties": {"name": {"const": tool_name(spec)}, "arguments": params},
            "required": ["name", "arguments"],
        })
    return options[0] if len(options) == 1 else {"anyOf": options}


def constraint_kwargs(engine: Any, schema: dict) -> dict:
    """`{json_schema: schema}` when the engine can constrain decoding to a schema, else `{}`."""
    try:
        params = inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return {}
    return {SCHEMA_ARGUMENT: schema} if SCHEMA_ARGUMENT in params else {}
