"""Schema-constrained decoding (forced tool calls, structured output, JSON mode), exact under speculation.

    engine.generate(prompt, json_schema={...})      # output parses and validates against the schema
    engine.generate(prompt, json_schema={"type": "object"})   # JSON mode

grammar.py compiles schemas (xgrammar, and why); constraint.py masks the target's logits along the
draft path and commits verified tokens; forced_draft.py is the grammar-forced draft source;
tool_schema.py turns tool definitions into the schema of one forced call; tool_tags.py into the
structural tag of a reply that may call them (free text until a call opens, then a valid call).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from flashspec_core.constrained.constraint import Constraint, GrammarCursor, allowed_from_bitmask
from flashspec_core.constrained.forced_draft import GrammarForcedDraft
from flashspec_core.constrained.grammar import (
    Grammar,
    as_grammar,
    compile_json_schema,
    compile_structural_tag,
    is_structural_tag,
)
from flashspec_core.constrained.tool_schema import parse_tool_call, tool_call_schema
from flashspec_core.constrained.tool_tags import HERMES, LLAMA3, STYLES, ToolCallStyle, style_for_template, tool_tags


def constraint_for(
    json_schema: dict | str | Grammar,
    tokenizer: Any,
    vocab_size: int,
    stop_ids: Collection[int],
    prompts: Sequence[Sequence[int]],
) -> Constraint:
    """The engine's entry point: one request's Constraint from its `json_schema=` argument (a JSON
    schema, a structural tag in xgrammar's JSON form, or a Grammar)."""
    return Constraint(as_grammar(json_schema, tokenizer, vocab_size, stop_ids), prompts)


__all__ = [
    "HERMES",
    "LLAMA3",
    "STYLES",
    "Constraint",
    "Grammar",
    "GrammarCursor",
    "GrammarForcedDraft",
    "ToolCallStyle",
    "allowed_from_bitmask",
    "as_grammar",
    "compile_json_schema",
    "compile_structural_tag",
    "constraint_for",
    "is_structural_tag",
    "parse_tool_call",
    "style_for_template",
    "tool_call_schema",
    "tool_tags",
]
