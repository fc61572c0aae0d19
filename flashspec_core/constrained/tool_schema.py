"""The JSON format of one forced tool call, shared by both adapters: `{"name": ..., "arguments": {...}}`.

`tool_call_schema(tools, tool_choice)` gives the schema to pass as `json_schema=` when a tool call
is forced; "name" comes first, so the grammar fixes the tool before its arguments, and with one tool
the whole `{"name": "<tool>", "arguments": {"` prefix is forced (and drafted for free).
`parse_tool_call` reads the constrained output back. Calls the model chooses to make ("auto") are
constrained from the moment they open by a structural tag instead (tool_tags.py).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}
FORCED_CHOICES = (None, "any", "required")
# Keywords whose values are data, never schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas: their keys are names, not keywords.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema: Any, pointer: str, names: bool = False) -> Any:
    """`schema` with every local `$ref` ("#", "#/$defs/x", ...) moved under `pointer`, the place the
    schema takes inside a larger document; a reference to another document is left as it is.

    A tool's parameters refer to their own root; inside the call's schema that root is
    `#/properties/arguments`, so `{"$ref": "#/$defs/node"}` must become
    `{"$ref": "#/properties/arguments/$defs/node"}` to mean the same (and `{"$ref": "#"}` must not
    come to mean the whole call).
    """
    if isinstance(schema, list):
        return [_rebased(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if names:
            out[key] = _rebased(value, pointer)
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, pointer, names=key in _SCHEMA_MAPS)
    return out


def tool_name_and_parameters(tool: Any, index: int) -> tuple[str, dict]:
    """A tool's name and parameters schema (OpenAI format or {"name", "parameters"}); ValueError
    naming `tools[index]` otherwise."""
    if not isinstance(tool, dict):
        raise ValueError(f"tools[{index}]: expected a dict (OpenAI tool format); got {type(tool).__name__}")
    spec = tool.get("function", tool) if tool.get("type") == "function" else tool
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"tools[{index}]: no tool name; pass {{'type': 'function', 'function': {{'name': ..., "
            "'parameters': {...}}}} or {'name': ..., 'parameters': {...}}"
        )
    params = spec.get("parameters") or EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise ValueError(f"tools[{index}]: 'parameters' of {name!r} must be a JSON schema dict")
    return name, params


def _chosen_name(tool_choice: Any) -> str | None:
    if tool_choice in FORCED_CHOICES:
        return None
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "none"):
            raise ValueError(
                f"tool_choice: {tool_choice!r} does not force a call, so there is nothing to constrain; "
                "parse the free output instead"
            )
        return tool_choice
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise ValueError(
        f"tool_choice: expected None, 'any', 'required', a tool name or {{'type': 'function', "
        f"'function': {{'name': ...}}}}; got {tool_choice!r}"
    )


def tool_call_schema(tools: Sequence[dict], tool_choice: Any = None) -> dict:
    """The schema of one call to one of `tools` (OpenAI format or {"name", "parameters"} dicts).

    tool_choice: None, "any" or "required" (any of the tools) or a tool's name (or OpenAI's
    {"type": "function", "function": {"name": ...}}) to force that tool.
    """
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence) or not tools:
        raise ValueError("tools: pass a non-empty list of tool definitions")
    pairs = [tool_name_and_parameters(t, i) for i, t in enumerate(tools)]
    chosen = _chosen_name(tool_choice)
    if chosen is not None:
        pairs = [p for p in pairs if p[0] == chosen]
        if not pairs:
            names = [tool_name_and_parameters(t, i)[0] for i, t in enumerate(tools)]
            raise ValueError(f"tool_choice: no tool named {chosen!r}; the tools are {names}")
    def call(name: str, params: dict, at: str) -> dict:
        return {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": _rebased(params, f"{at}/properties/arguments")},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    if len(pairs) == 1:
        return call(*pairs[0], "#")
    return {"anyOf": [call(name, params, f"#/anyOf/{i}") for i, (name, params) in enumerate(pairs)]}


def parse_tool_call(text: str) -> tuple[str, dict]:
    """(name, arguments) of a constrained tool call's text; ValueError naming `text` otherwise."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"text: not a complete JSON tool call ({exc}); was max_new_tokens too small?"
        ) from exc
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
            or not isinstance(call.get("arguments"), dict):
        raise ValueError(f"text: expected {{'name': str, 'arguments': object}}; got {text[:80]!r}")
    return call["name"], call["arguments"]
