"""Schema-constrained decoding (forced tool calls, structured output, JSON mode), exact under speculation.

    engine.generate(prompt, json_schema={...})      # output parses and validates against the schema
    engine.generate(prompt, json_schema={"type": "object"})   # JSON mode

grammar.py compiles schemas (xgrammar, and why); constraint.py masks the target's logits along the
draft path and commits verified tokens; forced_draft.py is the grammar-forced draft source;
tool_schema.py turns tool definitions into the schema of one forced call.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from flashspec_core.constrained.constraint import Constraint, GrammarCursor, allowed_from_bitmask
from flashspec_core.constrained.forced_draft import GrammarForcedDraft
from flashspec_core.constrained.grammar import Grammar, as_grammar, compile_json_schema
from flashspec_core.constrained.tool_schema import parse_tool_call, tool_call_schema


def constraint_for(
    json_schema: dict | str | Grammar,
    tokenizer: Any,
    vocab_size: int,
    stop_ids: Collection[int],
    prompts: Sequence[Sequence[int]],
) -> Constraint:
    """The engine's entry point: one request's Constraint from its `json_schema=` argument."""
    return Constraint(as_grammar(json_schema, tokenizer, vocab_size, stop_ids), prompts)


__all__ = [
    "Constraint",
    "Grammar",
    "GrammarCursor",
    "GrammarForcedDraft",
    "allowed_from_bitmask",
    "as_grammar",
    "compile_json_schema",
    "constraint_for",
    "parse_tool_call",
    "tool_call_schema",
]
