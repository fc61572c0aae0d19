"""Tool calls the model chooses to make: free text until a call opens, then a valid call.

`tool_tags(tools, style)` builds xgrammar's structural tag (its JSON form) for a reply that may call
`tools` (tool_choice "auto"): free text until the style's trigger, then one of the tools' names
with arguments valid under its parameters schema, the call's end, and free text again (or nothing
more when one call is allowed). Text that never writes the trigger decodes as with no grammar.
Styles: Hermes (`<tool_call>` blocks) and Llama 3.1+ (a bare `{"name", "parameters"}` object), with
xgrammar's own begin and end strings for those families; `style_for_template` says which one a chat
template writes, or raises. The mask outside a call and the styles' templates: docs/constrained.md.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashspec_core.constrained.grammar import STRUCTURAL_TAG
from flashspec_core.constrained.tool_schema import tool_name_and_parameters


@dataclass(frozen=True)
class ToolCallStyle:
    """How a chat template writes one call: `{opening}{name}{arguments}{args object}{end}`.

    trigger: the text that opens a call (a prefix of every call's begin).
    """

    name: str
    trigger: str
    opening: str
    arguments: str
    end: str

    def begin(self, tool: str) -> str:
        """A call of `tool` up to its arguments object."""
        return f"{self.opening}{json.dumps(tool, ensure_ascii=False)[1:-1]}{self.arguments}"

    def call(self, tool: str, arguments: dict) -> str:
        """The whole text of one call, as the grammar writes it."""
        return self.begin(tool) + json.dumps(arguments, ensure_ascii=False) + self.end


HERMES = ToolCallStyle("hermes", "<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>")
LLAMA3 = ToolCallStyle("llama3", '{"name": ', '{"name": "', '", "parameters": ', "}")
STYLES = {s.name: s for s in (HERMES, LLAMA3)}

# What a chat template that renders tools holds when it writes calls in a style.
_TEMPLATE_MARKERS = ((HERMES, ("<tool_call>",)), (LLAMA3, ("<|python_tag|>", "ipython")))


def style_for_template(chat_template: str | Mapping[str, str] | None) -> ToolCallStyle:
    """The call style a chat template (one that renders tools itself; a tokenizer's named templates
    are read together) writes; ValueError when it is not one of STYLES."""
    text = " ".join(map(str, chat_template.values())) if isinstance(chat_template, Mapping) else chat_template or ""
    for style, markers in _TEMPLATE_MARKERS:
        if any(marker in text for marker in markers):
            return style
    raise ValueError(
        "tool_choice: the target's chat template renders tools in a tool-call format this engine cannot "
        f"constrain (known: {sorted(STYLES)}: Hermes <tool_call> blocks, Llama 3 JSON calls); force a "
        "call by naming its tool, or use a target whose template writes one of these"
    )


def as_style(style: ToolCallStyle | str) -> ToolCallStyle:
    if isinstance(style, ToolCallStyle):
        return style
    if style not in STYLES:
        raise ValueError(f"style: expected one of {sorted(STYLES)}; got {style!r}")
    return STYLES[style]


def tool_tags(
    tools: Sequence[dict],
    style: ToolCallStyle | str = HERMES,
    *,
    required: bool = False,
    parallel: bool = True,
    opened: str = "",
) -> dict:
    """The structural tag of a reply that may call `tools` (OpenAI format or {"name", "parameters"}).

    required: the reply opens with a call (xgrammar's `at_least_one`: no text before it).
    parallel: more calls may follow the first, with free text between them; False ends the reply
    at the first call's end (only EOS may follow it).
    opened: call text the prompt already ends with (the assistant turn begun with `<tool_call>`,
    say); it must be a prefix of every tool's call, and the reply starts inside that call.
    """
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence) or not tools:
        raise ValueError("tools: pass a non-empty list of tool definitions")
    fmt_style = as_style(style)
    tags: list[dict[str, Any]] = [
        {"type": "tag", "begin": fmt_style.begin(name), "content": {"type": "json_schema", "json_schema": params},
         "end": fmt_style.end}
        for name, params in (tool_name_and_parameters(t, i) for i, t in enumerate(tools))
    ]
    free: dict[str, Any] = {"type": "triggered_tags", "triggers": [fmt_style.trigger], "tags": tags,
                            "at_least_one": required, "stop_after_first": not parallel}
    if not opened:
        return {"type": STRUCTURAL_TAG, "format": free}
    if any(not tag["begin"].startswith(opened) or tag["begin"] == opened for tag in tags):
        raise ValueError(f"opened: {opened!r} must be a proper prefix of every call's opening "
                         f"(e.g. {tags[0]['begin']!r})")
    rest = [{**tag, "begin": tag["begin"][len(opened):]} for tag in tags]
    first: dict[str, Any] = rest[0] if len(rest) == 1 else {"type": "or", "elements": rest}
    if parallel:
        first = {"type": "sequence", "elements": [first, {**free, "at_least_one": False}]}
    return {"type": STRUCTURAL_TAG, "format": first}
