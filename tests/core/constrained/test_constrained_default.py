"""Forced tool calls on the default model: every one of the 50 suite schemas parses and validates.

Greedy, with the grammar-forced draft (forced tokens plus grammar-filtered copies, γ = 8), a
budget of MAX_NEW_TOKENS per call (the longest suite call takes ~140 tokens). All 50 calls take
~100 s of CPU, which on the shared 2-core machine was 4.5 minutes of wall time, so by default the
test runs SUBSET, 17 schemas covering every schema feature (~1.5 minutes there); set
FLASHSPEC_FULL_TOOL_SUITE=1 to run all 50. benchmarks/constrained.py always runs all 50 under
every configuration, validates each call and checks that all configurations emit identical tokens.
"""
from __future__ import annotations

import json
import os

import jsonschema
import pytest

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.constrained import GrammarForcedDraft, parse_tool_call, tool_call_schema
from flashspec_core.constrained.tool_suite import TOOL_SUITE, forced_call_messages
from flashspec_core.engine import SpecEngine
from flashspec_core.routing.fixed import FixedRouter

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_one_thread")]
MAX_NEW_TOKENS = 160
# Flat with enum (0), numbers (2), optional array (4), bounded ints with enums (8, 13), arrays of
# enums (25, 27, 34), nested objects (26, 28, 46), arrays of objects (35, 36, 49), no parameters
# (38), nullable (42), array of strings with a bounded int (48).
SUBSET = [0, 2, 4, 8, 13, 25, 26, 27, 28, 34, 35, 36, 38, 42, 46, 48, 49]
CASES = TOOL_SUITE if os.environ.get("FLASHSPEC_FULL_TOOL_SUITE") == "1" else [TOOL_SUITE[i] for i in SUBSET]


def _call(engine: SpecEngine, case: dict):
    schema = tool_call_schema([case["tool"]])
    result = engine.generate(forced_call_messages(case["tool"], case["request"]), max_new_tokens=MAX_NEW_TOKENS,
                             json_schema=schema, hint="tool")
    return schema, result


def test_the_suite_has_fifty_distinct_tools():
    names = [case["tool"]["function"]["name"] for case in TOOL_SUITE]
    assert len(names) >= 50 and len(set(names)) == len(names)
    for case in TOOL_SUITE:
        jsonschema.Draft202012Validator.check_schema(tool_call_schema([case["tool"]]))


def test_every_forced_tool_call_parses_and_validates(default_target):
    engine = SpecEngine(default_target, [GrammarForcedDraft()], router=FixedRouter(Arm("grammar", 8)))
    failures, drafted, accepted = [], 0, 0
    for case in CASES:
        schema, result = _call(engine, case)
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
        try:
            name, _ = parse_tool_call(result.text)
            jsonschema.validate(json.loads(result.text), schema)
            assert name == case["tool"]["function"]["name"] and result.finish_reason == "stop"
        except (ValueError, AssertionError, jsonschema.ValidationError) as exc:
            failures.append(f"{case['tool']['function']['name']}: {exc} in {result.text!r}")
    assert not failures, f"{len(failures)}/{len(CASES)} forced calls failed:\n" + "\n".join(failures)
    assert accepted / drafted > 0.5, "the grammar-forced draft should mostly be right on forced tool calls"


@pytest.mark.parametrize("index", [0, 46], ids=["flat", "nested"])
def test_speculative_constrained_greedy_equals_plain_constrained_greedy(default_target, index):
    """Exactness on the real model: the forced draft changes the speed, never the tokens."""
    plain = SpecEngine(default_target, [], router=FixedRouter(Arm(NO_DRAFT, 0)))
    forced = SpecEngine(default_target, [GrammarForcedDraft()], router=FixedRouter(Arm("grammar", 8)))
    expected = _call(plain, TOOL_SUITE[index])[1]
    got = _call(forced, TOOL_SUITE[index])[1]
    assert got.token_ids == expected.token_ids and got.stats.steps < expected.stats.steps


def test_a_schema_xgrammar_cannot_compile_is_a_value_error(default_target):
    engine = SpecEngine(default_target, [], router=FixedRouter(Arm(NO_DRAFT, 0)))
    with pytest.raises(ValueError, match="json_schema: xgrammar cannot compile"):
        engine.generate("hi", max_new_tokens=4, json_schema={"type": "object", "properties": {"a": {"type": "nope"}}})
