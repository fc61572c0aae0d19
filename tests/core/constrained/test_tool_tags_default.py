"""Tool calls under the structural tag on the default model (SmolLM2-135M-Instruct), greedy.

- Free text: replies that open no call are the same tokens with the tag as without it.
- Primed calls (the assistant turn begun with `<tool_call>\\n`, the requests of the tool suite with
  their tool and another bound): every call is valid under its tool's schema and names a bound
  tool; without the tag the same prompts give invalid calls (benchmarks/auto_tool_calls.py counts
  them over all 50).
- Speculation under the tag (the grammar-forced draft) emits the tokens of plain grammar-masked
  greedy decoding.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.constrained import GrammarForcedDraft, tool_tags
from flashspec_core.constrained.tool_suite import TOOL_SUITE
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.routing.fixed import FixedRouter
from flashspec_integrations.prompts import render_prompt

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_one_thread")]
OPENED = "<tool_call>\n"
CASES = [0, 2, 26, 35]  # flat with an enum, numbers, a nested object, an array of objects
CHAT = ["Why is the sky blue?", "Who wrote Romeo and Juliet?"]


def bound(index: int) -> list[dict]:
    return [TOOL_SUITE[index]["tool"], TOOL_SUITE[(index + 1) % len(TOOL_SUITE)]["tool"]]


def prompt_ids(engine: SpecEngine, request: str, tools: list[dict], opened: str = "") -> list[int]:
    text = render_prompt(engine.tokenizer, [{"role": "user", "content": request}], tools) + opened
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def valid_call(text: str, tools: list[dict]) -> bool:
    """`text` (after the primed opening) is one call of a bound tool whose arguments validate."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    body = text.split("\n</tool_call>")[0]
    try:
        call = json.loads(body)
        jsonschema.validate(call["arguments"], schemas[call["name"]])
    except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
        return False
    return text.startswith(body + "\n</tool_call>")


@pytest.fixture(scope="module")
def plain(default_target) -> SpecEngine:
    return SpecEngine(default_target, [], router=FixedRouter(Arm(NO_DRAFT, 0)))


def test_free_text_is_the_same_with_the_tag(plain):
    tools = bound(0)
    for request in CHAT:
        ids = prompt_ids(plain, request, tools)
        free = plain.generate(ids, max_new_tokens=40)
        tagged = plain.generate(ids, max_new_tokens=40, json_schema=tool_tags(tools), hint="tool")
        assert "<tool_call>" not in free.text
        assert tagged.token_ids == free.token_ids, (request, free.text, tagged.text)


def test_every_primed_call_is_valid_and_without_the_tag_they_are_not(plain):
    invalid_without = 0
    for index in CASES:
        tools, request = bound(index), TOOL_SUITE[index]["request"]
        ids = prompt_ids(plain, request, tools, OPENED)
        call = plain.generate(ids, max_new_tokens=160, json_schema=tool_tags(tools, opened=OPENED, parallel=False))
        assert call.finish_reason == "stop" and valid_call(call.text, tools), (request, call.text)
        free = plain.generate(ids, max_new_tokens=96, stop=["</tool_call>"])
        invalid_without += not valid_call(free.text + "\n</tool_call>", tools)
    assert invalid_without >= len(CASES) // 2, f"only {invalid_without} of {len(CASES)} free calls were invalid"


def test_speculation_under_the_tag_emits_plain_masked_greedy_tokens(default_target, plain):
    """(Every draft and the router: test_tool_tags.py, on a tiny model.)"""
    engine = SpecEngine(default_target, [GrammarForcedDraft(), PromptLookupDraft()],
                        router=FixedRouter(Arm("grammar", 8)))
    tools = bound(26)
    ids = prompt_ids(plain, TOOL_SUITE[26]["request"], tools, OPENED)
    spec = tool_tags(tools, opened=OPENED)  # parallel: free text and further calls may follow the first
    expected = plain.generate(ids, max_new_tokens=96, json_schema=spec)
    got = engine.generate(ids, max_new_tokens=96, json_schema=spec)
    assert got.token_ids == expected.token_ids
    assert got.stats.steps < expected.stats.steps, "the forced draft proposes the call's fixed text"
