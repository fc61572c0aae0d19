"""What a reply with tools in play is decoded under, for both adapters and the server: the tool
choice, the grammar, the stop strings, and a forced call's opening for engines without grammars.

`reply_constraint` gives the grammar, passed as `json_schema=` to engines whose `constrains` is
true (the real engine's is): a call forced to one tool (its name, or "any"/"required"/True with one
tool bound, LlamaIndex's `tool_required`) is decoded under the call's JSON schema, a bare call
object; "auto", or "required" among several tools, under a structural tag (free text until a call
opens, then a valid call of a bound tool). Every call that opens parses. Engines without
`json_schema=` get a forced call's opening written for them (`forced_prefix`), output parsed.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashspec_core.constrained.tool_schema import tool_call_schema
from flashspec_core.constrained.tool_tags import HERMES, style_for_template, tool_tags
from flashspec_integrations.tool_calls import CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN

_FORCING = ("any", "required")


def tool_name(spec: Mapping) -> str:
    """The name of an OpenAI-format tool dict."""
    return str(spec["function"]["name"])


@dataclass(frozen=True)
class ToolChoice:
    """A normalised tool choice: whether a call is forced, the tool's name when one is named, and
    "none" (tools listed nowhere and never called)."""

    forced: bool = False
    name: str | None = None
    none: bool = False


def normalize_tool_choice(choice: Any, tools: Sequence[Mapping], required: bool = False) -> ToolChoice:
    """Both frameworks' spellings: None/"auto"/False, "none", "any"/"required"/True (or
    `required=True`, LlamaIndex's `tool_required`), a tool's name, or
    `{"type": "function", "function": {"name": ...}}`."""
    names = [tool_name(t) for t in tools]
    if isinstance(choice, Mapping):  # OpenAI's {"function": {"name"}}, Anthropic's {"type", "name"}
        choice = (choice.get("function") or {}).get("name") or choice.get("name") or choice.get("type")
    if choice == "none":
        return ToolChoice(none=True)
    if isinstance(choice, str) and choice not in ("auto", *_FORCING):
        if choice not in names:
            raise ValueError(f"tool_choice must be 'auto', 'none', 'any', 'required', True or one of the "
                             f"tools' names {names}; got {choice!r}")
        return ToolChoice(forced=True, name=choice)
    if choice is True or choice in _FORCING or (required and names):
        return ToolChoice(forced=True, name=names[0] if len(names) == 1 else None)
    if choice in (None, False, "auto"):
        return ToolChoice()
    raise ValueError(f"tool_choice must be 'auto', 'none', 'any', 'required', True or a tool's name; got {choice!r}")


def reply_stops(tools_in_play: bool, single_call: bool, hermes: bool, constrained: bool = False) -> tuple[str, ...]:
    """Stop strings of a reply with tools in play: the model never writes a tool's result itself
    (the framework supplies it), and a free reply of one call stops where the call closes. Under a
    grammar the grammar ends the call (and the reply, when one call is allowed); a stop string
    there would also cut a call whose argument string holds `</tool_call>`."""
    if not tools_in_play:
        return ()
    closes = single_call and hermes and not constrained
    return (RESPONSE_OPEN, RESPONSE_CLOSE, CALL_CLOSE) if closes else (RESPONSE_OPEN, RESPONSE_CLOSE)


def reply_constraint(tools: Sequence[Mapping], choice: ToolChoice, native_template: str | None,
                     parallel: bool) -> dict | None:
    """What a reply with `tools` shown is decoded under (`json_schema=`), or None with no tools.

    A call forced to one tool: that call's JSON schema (the reply is the bare call object). The
    model's choice ("auto"), or a call required of one of several tools: the structural tag of
    calls in the prompt's format, the Hermes `<tool_call>` blocks of `prompts.TOOLS_HEADER` unless
    the target's template renders tools itself (`native_template`, its source), whose format it
    reads (ValueError when it is not one the engine can constrain). parallel: more than one call.
    """
    if not tools or choice.none:
        return None
    if choice.forced and choice.name is not None:
        return tool_call_schema([dict(t) for t in tools], choice.name)
    style = HERMES if native_template is None else style_for_template(native_template)
    return tool_tags([dict(t) for t in tools], style, required=choice.forced, parallel=parallel)


def reads_untagged_calls(choice: ToolChoice, native_template: str | None, constrained: bool) -> bool:
    """Whether a JSON object naming a tool outside the call tags reads as a call. Not under the
    Hermes structural tag (the model's choice, or a call required of several tools, decoded under a
    grammar): there a call is only what the grammar decoded after the trigger, so the reader and
    the grammar agree on what a call is. Everywhere else, yes: a forced call of one tool is decoded
    as a bare object, Llama 3's calls are bare objects (the grammar's trigger), and an engine
    without grammars is read leniently."""
    if not constrained or (choice.forced and choice.name is not None):
        return True
    return native_template is not None and style_for_template(native_template) is not HERMES


def forced_prefix(choice: ToolChoice, constrained: bool) -> str:
    """The reply's opening for a forced call in the Hermes format. Under a grammar, none: it writes
    the call itself (for one tool the bare call object: with the tag written first, the 135M
    default model rambled inside the JSON strings until the token limit, langchain-tests' pydantic
    Joke ran to 128 tokens instead of 49). Unconstrained, the tag and the call as far as the
    tool's name."""
    if not choice.forced or constrained:
        return ""
    if choice.name is None:
        return f'{CALL_OPEN}\n{{"name": "'
    return f'{CALL_OPEN}\n{{"name": {json.dumps(choice.name)}, "arguments": {{'
