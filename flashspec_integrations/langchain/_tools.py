"""Tools for ChatFlashSpec: tool choice, the forced-call prefix, and lenient tool-call parsing.

A small model writes tool calls imperfectly, so the parser is lenient where the intent is clear
(a missing closing brace before `</tool_call>`, a trailing comma, `parameters` for `arguments`,
arguments given as a JSON string) and honest where it is not: whatever still fails goes to
`invalid_tool_calls` with the reason, never silently into `tool_calls`.

Forced calls (tool choice "any", "required" or a name) start the reply with the call's opening,
`<tool_call>\\n{"name": "` (and the name with `, "arguments": {` when it is known) and stop where
the block closes: the output is then the target's own continuation of that prefix.
Schema-constrained decoding, when the engine offers it, goes further (see
`ChatFlashSpec._output_constraint`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.utils.function_calling import convert_to_openai_tool

from flashspec_integrations.langchain._messages import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_ARG_KEYS = ("arguments", "parameters", "args", "input")
_FORCED_WORDS = ("any", "required")


def to_openai_tools(tools: Sequence[Any]) -> list[dict]:
    """OpenAI-format tool dicts from LangChain tools, pydantic models, functions or dicts."""
    if isinstance(tools, (str, dict)) or not isinstance(tools, Sequence):
        raise ValueError("tools: pass a list of tools (BaseTool, functions, pydantic models or OpenAI dicts)")
    return [convert_to_openai_tool(t) for t in tools]


def tool_names(tools: Sequence[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


@dataclass(frozen=True)
class ToolChoice:
    """A normalised tool choice: forced or not, and the tool's name when one is named."""

    forced: bool = False
    name: str | None = None
    none: bool = False  # "none": tools are listed but must not be called


def normalize_tool_choice(choice: Any, tools: Sequence[dict]) -> ToolChoice:
    """tool_choice as LangChain passes it: None/"auto", "none", "any"/"required"/True, a name or
    `{"type": "function", "function": {"name": ...}}`."""
    names = tool_names(tools)
    if choice is None or choice == "auto" or choice is False:
        return ToolChoice()
    if choice == "none":
        return ToolChoice(none=True)
    if choice is True or choice in _FORCED_WORDS:
        return ToolChoice(forced=True, name=names[0] if len(names) == 1 else None)
    if isinstance(choice, dict):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return ToolChoice(forced=True, name=choice)
    raise ValueError(
        f"tool_choice must be 'auto', 'none', 'any', 'required', True or one of the bound tools' names "
        f"{names}; got {choice!r}"
    )


def forced_prefix(choice: ToolChoice) -> str:
    """The reply's forced opening for a forced call in the fallback (Hermes) format."""
    if not choice.forced:
        return ""
    if choice.name is None:
        return f'{TOOL_CALL_OPEN}\n{{"name": "'
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(choice.name)}, "arguments": {{'


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def loads_lenient(raw: str, closed: bool) -> Any:
    """JSON from a model: strict first; then, only for a block the model closed itself, with code
    fences, trailing commas and missing closing brackets repaired. Raises ValueError."""
    text = _FENCE.sub("", raw.strip())
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if not closed:
            raise ValueError(f"incomplete JSON (the output ended inside it): {exc.msg}") from exc
        try:
            return json.loads(_close_brackets(_TRAILING_COMMA.sub(r"\1", text)))
        except (json.JSONDecodeError, ValueError):
            raise ValueError(f"not valid JSON: {exc.msg} at char {exc.pos}") from exc


def _close_brackets(text: str) -> str:
    """`text` with its unclosed brackets closed; ValueError when it ends inside a string (then the
    value itself is cut, and no repair can know what was meant)."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack and stack[-1] == ch:
            stack.pop()
    if in_string:
        raise ValueError("ends inside a string")
    return text + "".join(reversed(stack))


def first_json_value(text: str) -> Any:
    """The first JSON object in a reply (code fences and prose around it allowed). Raises ValueError."""
    start = text.find("{")
    if start < 0:
        raise ValueError("the reply holds no JSON object")
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
        return value
    except json.JSONDecodeError:
        return loads_lenient(text[start:].split("```")[0], closed=True)


def _call_from_json(raw: str, closed: bool, names: Sequence[str]) -> dict:
    """One `tool_call` or `invalid_tool_call` dict from the JSON text of one call."""
    call_id = new_call_id()
    try:
        obj = loads_lenient(raw, closed)
    except ValueError as exc:
        name = re.search(r'"name"\s*:\s*"([^"]+)"', raw)
        return invalid_tool_call(name=name.group(1) if name else None, args=raw.strip(), id=call_id, error=str(exc))
    name = obj.get("name") if isinstance(obj, dict) else None
    key = next((k for k in _ARG_KEYS if isinstance(obj, dict) and k in obj), None)
    args = obj.get(key, {}) if key else {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        return invalid_tool_call(name=None, args=raw.strip(), id=call_id, error='the call has no "name" string')
    if names and name not in names:
        return invalid_tool_call(name=name, args=raw.strip(), id=call_id, error=f"unknown tool {name!r}; bound tools: {list(names)}")
    if not isinstance(args, dict):
        return invalid_tool_call(name=name, args=raw.strip(), id=call_id, error="the arguments are not a JSON object")
    return tool_call(name=name, args=args, id=call_id)


def parse_tool_calls(text: str, names: Sequence[str], finished: bool = True) -> tuple[str, list[dict], list[dict]]:
    """Split a reply into (content, tool_calls, invalid_tool_calls).

    Calls are `<tool_call>{...}</tool_call>` blocks, or a reply that is only a JSON object with a
    name and arguments (how models without the tag format call tools). finished: the model ended
    the reply itself (EOS or a stop string), so a last block left open is complete, not truncated.
    """
    calls: list[dict] = []
    if TOOL_CALL_OPEN in text:
        for match in _BLOCK.finditer(text):
            closed = finished or match.group(0).endswith(TOOL_CALL_CLOSE)
            calls.append(_call_from_json(match.group(1), closed, names))
        content = _BLOCK.sub("", text).strip()
    else:
        stripped = _FENCE.sub("", text.strip())
        if not (stripped.startswith("{") and '"name"' in stripped and any(f'"{k}"' in stripped for k in _ARG_KEYS)):
            return text, [], []
        calls.append(_call_from_json(stripped, finished, names))
        content = ""
    valid = [c for c in calls if c.get("type") == "tool_call"]
    invalid = [c for c in calls if c.get("type") == "invalid_tool_call"]
    return content, valid, invalid


class ToolCallStreamer:
    """Splits streamed text into content deltas and tool-call chunks.

    Text outside call blocks streams through at once, except a tail that could still be the start
    of `<tool_call>`; a block is held until its `</tool_call>` (or the end) and then comes out as one
    `tool_call_chunk` with its index, id, name and the arguments as a JSON string. A reply that
    opens with `{` is held whole, as it may be a bare JSON call.
    """

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self._buffer = ""
        self._index = 0
        self._started = False
        self._bare = False

    def _chunk(self, raw: str, closed: bool) -> dict:
        call = _call_from_json(raw, closed, self.names)
        # LangChain parses chunk args with a partial-JSON parser when it aggregates chunks, which
        # would turn a truncated call into a valid one; an invalid call's raw text is therefore
        # sent as a JSON string, which that parser never reads as arguments.
        args = json.dumps(call["args"] if call["type"] == "tool_call" else str(call["args"]), ensure_ascii=False)
        chunk = tool_call_chunk(name=call["name"], args=args, id=call["id"], index=self._index)
        self._index += 1
        return chunk

    def feed(self, delta: str) -> Iterator[tuple[str, dict | None]]:
        """(content delta, tool-call chunk or None) pairs for newly streamed text."""
        self._buffer += delta
        if not self._started and self._buffer.strip():
            self._started = True
            self._bare = self._buffer.lstrip().startswith(("{", "```"))
        if self._bare:
            return
        while True:
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start < 0:
                hold = next((n for n in range(min(len(TOOL_CALL_OPEN) - 1, len(self._buffer)), 0, -1)
                             if self._buffer.endswith(TOOL_CALL_OPEN[:n])), 0)
                cut = len(self._buffer) - hold
                if cut:
                    yield self._buffer[:cut], None
                    self._buffer = self._buffer[cut:]
                return
            if start:
                yield self._buffer[:start], None
                self._buffer = self._buffer[start:]
            end = self._buffer.find(TOOL_CALL_CLOSE)
            if end < 0:
                return
            raw = self._buffer[len(TOOL_CALL_OPEN):end]
            self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE):]
            yield "", self._chunk(raw, True)

    def finish(self, closed: bool) -> Iterator[tuple[str, dict | None]]:
        """Whatever is still held once the stream has ended; `closed`: the model ended its reply
        (EOS or a stop string) rather than running out of tokens, so an open block is complete."""
        rest, self._buffer = self._buffer, ""
        if self._bare:
            content, valid, invalid = parse_tool_calls(rest, self.names)
            if not (valid or invalid):
                yield rest, None
                return
            yield content, self._chunk(_FENCE.sub("", rest.strip()), closed)
            return
        if rest.startswith(TOOL_CALL_OPEN):
            yield "", self._chunk(rest[len(TOOL_CALL_OPEN):], closed)
        elif rest:
            yield rest, None
