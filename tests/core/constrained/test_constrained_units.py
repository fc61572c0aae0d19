"""Units of constrained decoding: bitmask unpacking, masks along a draft path, cursors that restore
the grammar state, the grammar-forced draft, tool-call schemas, and the engine's argument checks.

The grammar is the tiny one of test_constrained_exactness: root ::= "{k:" item ("," item)* "}" over a
raw 16-token vocabulary with overlapping tokens ("{", "{k", "k:", "ab", "b}").
"""
from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr
from test_constrained_exactness import EBNF, EOS, VOCAB

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.constrained import (
    Constraint,
    Grammar,
    GrammarForcedDraft,
    allowed_from_bitmask,
    parse_tool_call,
    tool_call_schema,
)
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.fixed import FixedRouter
from flashspec_core.routing.router import BanditRouter

PROMPT = [13, 11, 13]
LBRACE, RBRACE, K, COLON, A, B, AB, LBRACE_K, K_COLON, COMMA, B_RBRACE = range(11)


@pytest.fixture(scope="module")
def grammar() -> Grammar:
    return Grammar.from_ebnf(EBNF, VOCAB, stop_ids=[EOS])


def allowed_set(constraint: Constraint, context) -> set[int]:
    with constraint.cursor(context) as cursor:
        return set(cursor.allowed().nonzero().flatten().tolist())


def test_bitmask_unpacking_matches_xgrammar():
    gen = torch.Generator().manual_seed(0)
    vocab = 75  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32, generator=gen)
    logits = torch.zeros(3, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(allowed_from_bitmask(bitmask, vocab), logits == 0)


def test_masks_follow_the_draft_path_and_leave_the_state_alone(grammar):
    constraint = Constraint(grammar, [PROMPT, PROMPT])
    constraint.commit(0, [LBRACE_K])  # row 0 has "{k", row 1 nothing
    draft = [[COLON, A, B_RBRACE, EOS], [LBRACE, COLON, A, A]]  # row 1: ":" after "{" is forbidden
    logits = torch.randn(2, 5, 16)
    masked = constraint.mask_logits(logits, draft, [True, True])
    allowed = masked > float("-inf")
    assert allowed[0, 0].nonzero().flatten().tolist() == [COLON]  # after "{k"
    assert set(allowed[0, 2].nonzero().flatten().tolist()) == {B, RBRACE, COMMA, B_RBRACE}  # after "{k:a"
    assert allowed[0, 3].nonzero().flatten().tolist() == [EOS]  # complete: only EOS
    assert allowed[0, 4].all(), "after EOS nothing is scored; the position stays unmasked"
    assert set(allowed[1, 0].nonzero().flatten().tolist()) == {LBRACE, LBRACE_K}
    assert allowed[1, 1].nonzero().flatten().tolist() == [K, K_COLON]
    assert allowed[1, 2:].all(), "positions after a forbidden draft token are left unmasked"
    assert torch.equal(masked[allowed], logits[allowed])
    # The matchers were rolled back: the same tokens commit again, and the states differ per row.
    constraint.commit(0, [COLON, A])
    constraint.commit(1, [LBRACE, K_COLON])
    assert constraint.output(0) == [LBRACE_K, COLON, A] and constraint.output(1) == [LBRACE, K_COLON]


def test_inactive_rows_are_not_masked(grammar):
    constraint = Constraint(grammar, [PROMPT, PROMPT])
    masked = constraint.mask_logits(torch.zeros(2, 2, 16), [[LBRACE], [LBRACE]], [False, True])
    assert (masked[0] == 0).all() and (masked[1] == float("-inf")).any()


def test_commit_refuses_a_token_the_grammar_forbids(grammar):
    constraint = Constraint(grammar, [PROMPT])
    with pytest.raises(RuntimeError, match="violates the grammar"):
        constraint.commit(0, [LBRACE, A])


def test_cursor_at_an_earlier_context_restores_the_state(grammar):
    constraint = Constraint(grammar, [PROMPT, [1, 2]])
    constraint.commit(0, [LBRACE_K, COLON, A])
    assert allowed_set(constraint, PROMPT + [LBRACE_K]) == {COLON}
    assert allowed_set(constraint, PROMPT) == {LBRACE, LBRACE_K}
    with constraint.cursor(PROMPT + [LBRACE_K, COLON]) as cursor:
        assert cursor.accept(B) and not cursor.accept(B)
    assert allowed_set(constraint, PROMPT + [LBRACE_K, COLON, A]) == {B, RBRACE, COMMA, B_RBRACE}
    with constraint.cursor([1, 2, 3]) as cursor:  # row 1's prompt, but output it never produced
        assert cursor is None
    constraint.commit(0, [RBRACE, EOS])
    assert constraint.is_terminated(0)


def test_forced_draft_proposes_what_the_grammar_forces(grammar):
    draft = GrammarForcedDraft(lookup_ngram=0)
    assert draft.propose([PROMPT], 8, SamplingParams()).tokens == [[]], "no constraint bound: nothing"
    constraint = Constraint(grammar, [PROMPT, PROMPT])
    draft.bind_constraint(constraint)
    assert draft.propose([PROMPT, PROMPT], 8, SamplingParams()).tokens == [[LBRACE_K, COLON]] * 2
    assert draft.propose([PROMPT], 1, SamplingParams()).tokens == [[LBRACE_K]]
    constraint.commit(0, [LBRACE, K, COLON, A, RBRACE])
    proposal = draft.propose([PROMPT + constraint.output(0), PROMPT], 8, SamplingParams())
    assert proposal.tokens == [[EOS], [LBRACE_K, COLON]] and proposal.probs is None
    # After the fact (the router's full-information scoring): the context before the last step.
    assert draft.propose([PROMPT + [LBRACE, K]], 8, SamplingParams()).tokens == [[COLON]]
    assert draft.propose([PROMPT + constraint.output(0)], 8, SamplingParams()).tokens == [[EOS]]
    draft.end([PROMPT], [[]])
    assert draft.propose([PROMPT], 8, SamplingParams()).tokens == [[]], "end() drops the constraint"


def test_forced_draft_copies_grammar_allowed_text_from_the_context(grammar):
    prompt = [LBRACE_K, COLON, AB, COMMA, B, RBRACE, 12]
    constraint = Constraint(grammar, [prompt])
    constraint.commit(0, [LBRACE_K, COLON])
    draft = GrammarForcedDraft(lookup_ngram=3)
    draft.bind_constraint(constraint)
    # Free choice after "{k:": copy "ab , b }" from the prompt, then the grammar forces EOS.
    assert draft.propose([prompt + [LBRACE_K, COLON]], 8, SamplingParams()).tokens == [[AB, COMMA, B, RBRACE, EOS]]


def test_router_scores_the_forced_draft_after_the_fact(tiny_target, grammar):
    """The router proposes from the previous step's context, behind the committed state: the draft
    must answer as a fresh grammar state at that context would (the cursor rolls back and restores)."""
    draft = GrammarForcedDraft(lookup_ngram=0)
    router = BanditRouter([Arm(NO_DRAFT, 0), Arm("grammar", 4)], free_drafts={"grammar": draft}, seed=0)
    engine = SpecEngine(tiny_target, [draft], router=router, verify_backend="torch")
    engine.router.select = lambda domain, unavailable=frozenset(): Arm(NO_DRAFT, 0)  # every proposal is after the fact
    calls = []
    propose = draft.propose
    draft.propose = lambda contexts, *args: calls.append((list(contexts[0]), propose(contexts, *args))) or calls[-1][1]
    result = engine.generate(PROMPT, max_new_tokens=12, json_schema=grammar)
    # Asked at the starts of grammar@4's own steps along the output (copy_scoring.py): every
    # context a prefix of the request's tokens, none asked twice.
    full = PROMPT + result.token_ids
    assert len(calls) > 3 and all(full[:len(c)] == c for c, _ in calls)
    assert sorted(len(c) for c, _ in calls) == [len(c) for c, _ in calls] == sorted({len(c) for c, _ in calls})
    assert any(p.tokens[0] for _, p in calls), "the grammar forced something along the way"
    for context, proposal in calls:
        fresh = Constraint(grammar, [PROMPT])
        fresh.commit(0, context[len(PROMPT):])
        replay = GrammarForcedDraft(lookup_ngram=0)
        replay.bind_constraint(fresh)
        assert proposal.tokens == replay.propose([context], 4, SamplingParams()).tokens
    assert router.summary()["json"]["grammar@4"]["scored"] == len(calls)


def test_a_row_without_a_grammar_is_never_offered_or_scored_the_grammar_arms(tiny_target, grammar):
    """Without a grammar the forced draft proposes nothing: its arms would be plain decoding under
    another name, explored cold at the cost of the arms that could pay. Rows with a grammar still
    get them, and are scored on them."""
    forced, lookup = GrammarForcedDraft(), PromptLookupDraft()
    arms = [Arm(NO_DRAFT, 0), Arm("grammar", 2), Arm("grammar", 6), Arm("prompt_lookup", 4)]
    router = BanditRouter(arms, free_drafts={"grammar": forced, "prompt_lookup": lookup}, seed=0)
    engine = SpecEngine(tiny_target, [forced, lookup], router=router, verify_backend="torch")
    prompts = [[(7 * i + 3 * j) % 15 for j in range(3 + i % 4)] for i in range(16)]
    free = [r for p in prompts for r in engine.generate(p, max_new_tokens=24, domain="chat").stats.records]
    assert len(free) > 40 and {r.arm.draft for r in free} <= {NO_DRAFT, "prompt_lookup"}
    assert all(r.unavailable == {"grammar"} for r in free)
    chat = router.summary()["chat"]
    assert chat["grammar@2"]["scored"] == chat["grammar@6"]["scored"] == 0 < chat["prompt_lookup@4"]["scored"]
    constrained = engine.generate(PROMPT, max_new_tokens=12, json_schema=grammar, domain="chat").stats.records
    assert all(r.unavailable == frozenset() for r in constrained)
    assert router.summary()["chat"]["grammar@6"]["scored"] > 0


def test_tool_call_schema_forces_the_name_first():
    weather = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    clock = {"name": "clock"}
    one = tool_call_schema([weather])
    assert list(one["properties"]) == ["name", "arguments"] and one["properties"]["name"] == {"const": "weather"}
    assert one["properties"]["arguments"]["required"] == ["city"]
    both = tool_call_schema([weather, clock], "required")
    assert [c["properties"]["name"]["const"] for c in both["anyOf"]] == ["weather", "clock"]
    assert both["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    chosen = tool_call_schema([weather, clock], {"type": "function", "function": {"name": "clock"}})
    assert chosen["properties"]["name"] == {"const": "clock"}
    with pytest.raises(ValueError, match="tool_choice"):
        tool_call_schema([weather], "auto")
    with pytest.raises(ValueError, match="no tool named 'nope'"):
        tool_call_schema([weather], "nope")
    with pytest.raises(ValueError, match="tools"):
        tool_call_schema([])
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        tool_call_schema([{"type": "function", "function": {}}])


TREE = {"type": "object", "properties": {"label": {"type": "string"},
                                        "children": {"type": "array", "items": {"$ref": "#"}},
                                        "next": {"$ref": "#/$defs/link"}, "const": {"const": {"$ref": "#"}}},
        "required": ["label"], "additionalProperties": False,
        "$defs": {"link": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}}


@pytest.mark.parametrize("choice", ["tree", "required"])
def test_a_forced_calls_schema_keeps_the_tools_own_references(choice):
    """A tool's `$ref`s mean its parameters' root and $defs inside the call's schema too."""
    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"name": "tree", "parameters": TREE}, {"name": "clock"}]
    schema = tool_call_schema(tools, choice)
    nested = {"label": "a", "children": [{"label": "b", "next": {"label": "c", "next": None}}]}
    jsonschema.validate({"name": "tree", "arguments": nested}, schema)
    jsonschema.validate(nested, TREE)
    as_call = {"label": "a", "children": [{"name": "tree", "arguments": {"label": "b"}}]}
    with pytest.raises(jsonschema.ValidationError):  # a child is the tool's arguments, not a whole call
        jsonschema.validate({"name": "tree", "arguments": as_call}, schema)
    arguments = (schema if choice == "tree" else schema["anyOf"][0])["properties"]["arguments"]
    assert arguments["properties"]["const"] == {"const": {"$ref": "#"}}  # data, not a reference
    xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)  # xgrammar resolves them too


def test_parse_tool_call():
    assert parse_tool_call('{"name": "f", "arguments": {"x": 1}}') == ("f", {"x": 1})
    with pytest.raises(ValueError, match="max_new_tokens"):
        parse_tool_call('{"name": "f", "argu')
    with pytest.raises(ValueError, match="text"):
        parse_tool_call('{"name": 3, "arguments": {}}')


@pytest.mark.parametrize("bad, match", [
    (["not", "a", "schema"], "json_schema: expected"),
    ("{not json", "json_schema: not valid JSON"),
    ('"a string"', "json_schema: a JSON schema is an object"),
    ("other vocabulary", "compile it with vocab_size=16"),
    # Once "token ... violates the grammar: the target's logits were not masked" (issue 15): the
    # grammar ended at its stop token 14, the row went on.
    ("other stop id", r"stop ids \[14\] must be end-of-sequence ids of the model, which are \[15\]"),
])
def test_engine_rejects_a_bad_json_schema(tiny_target, bad, match):
    engine = SpecEngine(tiny_target, [], router=FixedRouter(Arm(NO_DRAFT, 0)))
    if bad == "other vocabulary":
        bad = Grammar.from_ebnf(EBNF, VOCAB + ["pad"], stop_ids=[EOS])
    elif bad == "other stop id":
        bad = Grammar.from_ebnf(EBNF, VOCAB, stop_ids=[14])
    with pytest.raises(ValueError, match=match):
        engine.generate(PROMPT, max_new_tokens=4, json_schema=bad)
    assert engine.generate(PROMPT, max_new_tokens=2).token_ids, "the engine is still usable"


def test_stream_and_generate_agree_and_length_cuts_mid_grammar(tiny_target, grammar):
    engine = SpecEngine(tiny_target, [GrammarForcedDraft()], router=FixedRouter(Arm("grammar", 3)))
    whole = engine.generate(PROMPT, max_new_tokens=3, json_schema=grammar)
    chunks = list(engine.stream(PROMPT, max_new_tokens=3, json_schema=grammar))
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert whole.finish_reason == "length" and EOS not in whole.token_ids
    assert whole.stats.domain == "json", "a constrained request without a hint routes as json"
