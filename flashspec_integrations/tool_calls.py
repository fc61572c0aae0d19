"""Tool calls read back for both adapters and the server: one lenient parser, one streamer.

Calls are written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (`prompts.py`;
`tool_choice.py` decides what a reply is decoded under) and read with `parse_tool_calls` (streams:
`ToolCallStreamer`) into framework-neutral `ParsedCall`s, so a reply means the same everywhere.
Lenient where the intent is clear (fences, trailing commas, single quotes, bare keys via
`dirtyjson`, Python literals, missing closing brackets, `parameters`/`args`/`input`, arguments as a
JSON string, OpenAI's `function` nesting, a name's case); honest where it is not: a call cut off,
nameless, of an unbound tool, or with non-object or undeclared arguments is invalid, with a reason.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dirtyjson

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ARGUMENT_KEYS = ("arguments", "parameters", "args", "input", "kwargs")
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")
_FENCED_OBJECT = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.S)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')


@dataclass(frozen=True)
class ParsedCall:
    """One call read from a reply. arguments is None, and error says why, for an invalid call."""

    id: str
    name: str | None
    arguments: dict | None
    raw: str
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.error is None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _close_brackets(text: str) -> str:
    """`text` with its unclosed brackets closed; ValueError when it ends inside a string (the value
    itself is cut there, and no repair can know what was meant)."""
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


def _repaired(text: str) -> Any:
    candidates = [text]
    try:
        candidates.append(_close_brackets(text))
    except ValueError:
        pass
    for candidate in candidates:
        try:
            return json.loads(json.dumps(dirtyjson.loads(candidate)))  # plain dicts, not dirtyjson's
        except (ValueError, TypeError, IndexError, KeyError, RecursionError):
            pass
        try:
            value = ast.literal_eval(candidate)
            json.dumps(value)  # JSON's types only: a set or bytes literal is not a call
            return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    raise ValueError("no repair applies")


def loads_lenient(raw: str, closed: bool = True) -> Any:
    """JSON from a model: strict first; then, only for text the model ended itself (`closed`),
    repaired. Raises ValueError saying what is wrong."""
    text = _FENCE.sub("", raw.strip())
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if not closed:
            raise ValueError(f"incomplete JSON (the output ended inside it): {exc.msg}") from exc
        try:
            return _repaired(text)
        except ValueError:
            raise ValueError(f"not valid JSON: {exc.msg} at char {exc.pos}") from exc


def first_json_object(text: str) -> Any:
    """The first JSON object of a reply (code fences and prose around it allowed). Raises ValueError."""
    start = text.find("{")
    if start < 0:
        raise ValueError("the reply holds no JSON object")
    try:
        return json.JSONDecoder().raw_decode(text[start:])[0]
    except json.JSONDecodeError:
        return loads_lenient(text[start:].split("```")[0], closed=True)


def _known(name: Any, names: Iterable[str]) -> str | None:
    """`name` as one of `names` (case folded), or None when it is not one of them."""
    if not isinstance(name, str) or not name.strip():
        return None
    name = name.strip()
    return name if name in names else {n.lower(): n for n in names}.get(name.lower())


def _call(raw: str, closed: bool, names: Sequence[str] | Mapping[str, Any]) -> ParsedCall:
    """The call in the JSON text of one `<tool_call>` block (valid, or invalid with the reason).
    names: the bound tools' names, or a mapping of each to its parameters schema, against which
    the argument names are then checked."""
    call_id = new_call_id()
    try:
        obj = loads_lenient(raw, closed)
    except ValueError as exc:
        match = _NAME.search(raw)
        return ParsedCall(call_id, match.group(1) if match else None, None, raw.strip(), str(exc))
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):  # OpenAI's nesting
        obj = obj["function"]
    written = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(written, str) or not written.strip():
        return ParsedCall(call_id, None, None, raw.strip(), 'the call has no "name" string')
    name = _known(written, names) if names else written.strip()
    if name is None:
        return ParsedCall(call_id, written, None, raw.strip(), f"unknown tool {written!r}; the tools are {list(names)}")
    key = next((k for k in ARGUMENT_KEYS if k in obj), None)
    args = obj[key] if key else {}
    if isinstance(args, str):
        try:
            args = loads_lenient(args, closed=True) if args.strip() else {}
        except ValueError:
            pass
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParsedCall(call_id, name, None, raw.strip(), "the arguments are not a JSON object")
    unknown, known = _unknown_arguments(args, names.get(name) if isinstance(names, Mapping) else None)
    if unknown:
        return ParsedCall(call_id, name, None, raw.strip(),
                          f"unknown arguments {unknown}; {name} takes {known}")
    return ParsedCall(call_id, name, args, raw.strip())


def _unknown_arguments(args: dict, parameters: Any) -> tuple[list[str], list[str]]:
    """(the argument names `parameters` does not declare, the ones it does); none unknown when it
    declares no properties or allows others (`additionalProperties`), as the call grammar's
    strict mode reads a schema."""
    if not isinstance(parameters, Mapping) or not isinstance(parameters.get("properties"), Mapping) \
            or parameters.get("additionalProperties", False) not in (False, None):
        return [], []
    known = list(parameters["properties"])
    return [k for k in args if k not in known], known


def _bare_call(text: str, names: Sequence[str] | Mapping[str, Any], finished: bool) -> tuple[int, ParsedCall] | None:
    """A call written without tags (a fenced or bare JSON object), where it starts; only a known
    tool's name makes such an object a call, so an ordinary JSON answer is not mistaken for one."""
    candidates = [(m.start(), m.group(1)) for m in _FENCED_OBJECT.finditer(text)]
    start = text.find("{")
    if start >= 0:
        body = text[start:]
        try:  # the first object only: prose may follow it
            body = json.dumps(json.JSONDecoder().raw_decode(body)[0])
        except json.JSONDecodeError:
            pass
        candidates.append((start, body))
    for where, body in candidates:
        try:
            obj = loads_lenient(body, finished)
            obj = obj["function"] if isinstance(obj, dict) and isinstance(obj.get("function"), dict) else obj
            named = obj.get("name") if isinstance(obj, dict) else None
        except ValueError:
            match = _NAME.search(body)
            named = match.group(1) if match else None
        if _known(named, names) is not None:
            return where, _call(body, finished, names)
    return None


def _block(text: str, start: int) -> tuple[int, int, str, bool] | None:
    """The first call block at or after `start`: (where it begins, where it ends, the text inside
    the tags, whether its close tag was found). The call's JSON object is read first, so a string
    in it may hold anything, `</tool_call>` included; text that is not one JSON object ends at the
    first close tag (or at the end of `text`)."""
    begin = text.find(CALL_OPEN, start)
    if begin < 0:
        return None
    inner = begin + len(CALL_OPEN)
    obj = inner + len(text[inner:]) - len(text[inner:].lstrip())
    try:
        end = json.JSONDecoder().raw_decode(text, obj)[1]
        close = text.find(CALL_CLOSE, end)
        if close >= 0 and not text[end:close].strip():
            return begin, close + len(CALL_CLOSE), text[inner:close], True
    except json.JSONDecodeError:
        pass
    close = text.find(CALL_CLOSE, inner)
    if close < 0:
        return begin, len(text), text[inner:], False
    return begin, close + len(CALL_CLOSE), text[inner:close], True


def _blocks(text: str) -> Iterator[tuple[int, int, str, bool]]:
    at = 0
    while (block := _block(text, at)) is not None:
        yield block
        at = block[1]


def parse_tool_calls(text: str, names: Sequence[str] | Mapping[str, Any],
                     finished: bool = True, untagged: bool = True) -> tuple[str, list[ParsedCall]]:
    """Split a reply into (content, calls): `<tool_call>` blocks, else one untagged JSON call.

    names: the bound tools' names, or a mapping of each to its parameters schema: then a call with
    an argument its tool does not declare is invalid, as the call grammar makes it impossible.

    finished: the model ended the reply itself (EOS or a stop string), so a last block left open
    is complete, not cut off by the token limit.

    untagged: a JSON object naming a bound tool outside the tags is a call too. False where the
    reply was decoded under the calls' structural tag: a call is then only what the grammar
    decoded (the tagged blocks), and an object elsewhere in the text stays text.
    """
    if CALL_OPEN in text:
        blocks = list(_blocks(text))
        calls = [_call(inner, finished or closed, names) for _, _, inner, closed in blocks]
        bounds = [0] + [i for begin, end, _, _ in blocks for i in (begin, end)] + [len(text)]
        content = "".join(text[bounds[i]:bounds[i + 1]] for i in range(0, len(bounds), 2))
        return content.strip(), calls
    found = _bare_call(text, names, finished) if names and untagged else None
    if found is None:
        return text, []
    where, call = found
    return text[:where].strip(), [call]


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class ToolCallStreamer:
    """Splits streamed text into content deltas and whole calls, as `parse_tool_calls` splits the
    whole text.

    Text outside call blocks streams through at once, except a tail that could still be the start
    of `<tool_call>`; a block is held until its JSON object and `</tool_call>` have come (or, for
    a block that is not plain JSON, until the end) and then comes out as one `ParsedCall`. Where
    `untagged` calls are read, everything from the first `{` or code fence on is held to the end,
    as it may be one.
    """

    def __init__(self, names: Sequence[str] | Mapping[str, Any], untagged: bool = True):
        self.names = dict(names) if isinstance(names, Mapping) else list(names)
        self.untagged = untagged
        self._buffer = ""
        self._bare = False

    def _opening(self) -> int:
        """Where the held part of the buffer begins: a call tag, or (untagged) a `{` or a fence."""
        marks = [self._buffer.find(CALL_OPEN)]
        if self.untagged:
            marks += [self._buffer.find("{"), self._buffer.find("```")]
        return min((m for m in marks if m >= 0), default=-1)

    def _partial_tail(self) -> int:
        """The length of the buffer's tail that could still grow into an opening."""
        openings = (CALL_OPEN, "```") if self.untagged else (CALL_OPEN,)
        return max((n for o in openings for n in range(min(len(o) - 1, len(self._buffer)), 0, -1)
                    if self._buffer.endswith(o[:n])), default=0)

    def feed(self, delta: str) -> Iterator[tuple[str, ParsedCall | None]]:
        """(content delta, call or None) pairs for newly streamed text."""
        self._buffer += delta
        while not self._bare:
            start = self._opening()
            if start < 0:
                cut = len(self._buffer) - self._partial_tail()
                if cut:
                    yield self._buffer[:cut], None
                    self._buffer = self._buffer[cut:]
                return
            if start:
                yield self._buffer[:start], None
                self._buffer = self._buffer[start:]
            if not self._buffer.startswith(CALL_OPEN):
                self._bare = True  # may be an untagged call: read with the rest at the end
                return
            block = _block(self._buffer, 0)
            # Whole once its JSON object is followed by the close tag; text that is not one JSON
            # object waits for the end of the stream (more may still come to complete it).
            if block is None or not block[3] or not _is_json_object(block[2]):
                return
            _, end, raw, _ = block
            self._buffer = self._buffer[end:]
            yield "", _call(raw, True, self.names)

    def finish(self, finished: bool) -> Iterator[tuple[str, ParsedCall | None]]:
        """Whatever is still held once the stream has ended (`finished` as in `parse_tool_calls`)."""
        rest, self._buffer = self._buffer, ""
        if self._bare or rest.startswith(CALL_OPEN):
            content, calls = parse_tool_calls(rest, self.names, finished, self.untagged)
            if content:
                yield content, None
            for call in calls:
                yield "", call
        elif rest:
            yield rest, None
