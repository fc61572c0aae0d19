"""Structural tags for tool calls the model chooses to make (tool_choice "auto"): what the grammar
accepts, that free text is never masked, and that every call that opens is valid.

The engine tests run a tiny random Llama over the byte-level tokenizer of tests/fakes.py whose
head lets out any printable ASCII character, newline and EOS, so free text can hold `<`, `{` and
quotes; "primed" prompts end with `<tool_call>\n`, the assistant turn begun with the tag.
"""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr
from fakes import byte_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.constrained import (
    HERMES,
    LLAMA3,
    Constraint,
    GrammarForcedDraft,
    compile_structural_tag,
    style_for_template,
    tool_tags,
)
from flashspec_core.drafts import ModelDraft, PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.models import LoadedModel
from flashspec_core.routing.fixed import FixedRouter

pytestmark = pytest.mark.usefixtures("torch_one_thread")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"]}}}
CLOCK = {"name": "clock", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                         "required": ["zone"]}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "clock": CLOCK["parameters"]}
OPEN = "<tool_call>\n"


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def grammar_of(tok, spec):
    return compile_structural_tag(spec, tok, len(tok), [tok.eos_token_id])


def accepts(tok, spec, text: str, end: bool = True) -> bool:
    """Whether the grammar takes `text` (and then EOS, when `end`)."""
    matcher = xgr.GrammarMatcher(grammar_of(tok, spec).compiled)
    return matcher.accept_string(text) and (not end or matcher.accept_token(tok.eos_token_id))


def test_the_styles_are_xgrammars_own_for_those_families():
    for style, family in ((HERMES, "qwen_3"), (LLAMA3, "llama")):
        builtin = xgr.get_model_structural_tag(family, tools=[WEATHER], reasoning="disabled")
        fmt = json.loads(builtin.model_dump_json())["format"]
        assert fmt["triggers"] == [style.trigger]
        assert [(t["begin"], t["end"]) for t in fmt["tags"]] == [(style.begin("get_weather"), style.end)]
        ours = tool_tags([WEATHER], style)["format"]
        assert ours["triggers"] == fmt["triggers"] and ours["tags"][0]["begin"] == fmt["tags"][0]["begin"]


def test_the_style_comes_from_the_chat_template():
    qwen = "{%- if tools %}...<tools>...</tools>... <tool_call>\\n{\"name\": <function-name>, ...}</tool_call>"
    llama = '{%- if tools %}... "parameters": dictionary ... <|python_tag|> ... ipython ...'
    assert style_for_template(qwen) is HERMES and style_for_template(llama) is LLAMA3
    with pytest.raises(ValueError, match="tool-call format this engine cannot constrain"):
        style_for_template("{%- if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]")


def test_free_text_then_valid_calls_of_bound_tools_only(tok):
    spec = tool_tags(TOOLS)
    weather = HERMES.call("get_weather", {"city": "Oslo", "days": 2})
    clock = HERMES.call("clock", {"zone": "utc"})
    assert accepts(tok, spec, "Just prose, with <tags> and {braces}.")
    assert accepts(tok, spec, f"Let me check. {weather} and {clock} done.")
    for bad in ['<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>',  # unbound tool
                '<tool_call>\n{"name": "clock", "arguments": {"zone": "pst"}}\n</tool_call>',  # not in the enum
                '<tool_call>\n{"name": "clock", "arguments": {"zone": "utc", "x": 1}}\n</tool_call>',  # extra key
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": "2"}}\n</tool_call>',
                '<tool_call>\n{"name": "clock", "arguments": { "zone": "utc"}}\n</tool_call>',  # compact JSON
                '<tool_call>{"name": "clock", "arguments": {"zone": "utc"}}</tool_call>']:  # Hermes' newlines
        assert not accepts(tok, spec, bad, end=False), bad
    assert not accepts(tok, spec, '<tool_call>\n{"name": "clock", "arguments": {"zone": "utc"}}'), "EOS inside a call"


def test_a_bad_tag_is_a_value_error_naming_json_schema(tok):
    bad = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}
    with pytest.raises(ValueError, match="json_schema: xgrammar cannot compile a schema inside the structural tag"):
        grammar_of(tok, tool_tags([bad]))
    with pytest.raises(ValueError, match="json_schema: xgrammar cannot compile this structural tag"):
        grammar_of(tok, {"type": "structural_tag", "format": {"type": "no_such_format"}})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        grammar_of(tok, {"type": "structural_tag", "format": {"type": "const_string", "value": object()}})


def test_required_parallel_and_opened(tok):
    clock = HERMES.call("clock", {"zone": "cet"})
    required = tool_tags(TOOLS, required=True)
    assert accepts(tok, required, clock + " then text") and not accepts(tok, required, "text first " + clock)
    assert not accepts(tok, required, "")
    single = tool_tags(TOOLS, parallel=False)
    assert accepts(tok, single, "text " + clock) and not accepts(tok, single, clock + " more", end=False)
    opened = tool_tags(TOOLS, opened=OPEN)
    assert accepts(tok, opened, clock[len(OPEN):] + " and " + clock)
    assert not accepts(tok, opened, "prose", end=False)
    assert accepts(tok, tool_tags(TOOLS, opened=OPEN, parallel=False), clock[len(OPEN):])
    with pytest.raises(ValueError, match="opened"):
        tool_tags(TOOLS, opened="<tool_call>\n{\"name\": \"clock")  # not a prefix of get_weather's call
    llama = tool_tags(TOOLS, LLAMA3)
    assert accepts(tok, llama, 'Sure: {"name": "clock", "parameters": {"zone": "utc"}}')
    with pytest.raises(ValueError, match="style"):
        tool_tags(TOOLS, "mistral")


def test_free_text_is_never_masked_and_a_partial_trigger_is(tok):
    """Along a draft path through free text every position allows every token (the fast path
    returns the logits unchanged); once the text ends in `<tool_call`, a token that would open the
    call wrongly is forbidden; inside the call the mask is the grammar's."""
    constraint = Constraint(grammar_of(tok, tool_tags(TOOLS)), [[0, 1], [0, 1]])
    ids = lambda text: tok(text, add_special_tokens=False).input_ids
    free = ids("a <b> {c} <tool_ca")  # ends inside the trigger: the last position is free still
    logits = torch.randn(2, len(free) + 1, len(tok))
    masked = constraint.mask_logits(logits, [free, free], [True, True])
    assert torch.equal(masked, logits)
    constraint.commit(0, ids("x <tool_call"))
    masked = constraint.mask_logits(logits[:, :2], [[ids(">")[0]], [ids(">")[0]]], [True, True])
    allowed = (masked[0] > float("-inf"))
    assert allowed[0].all(), "'>' completes the trigger and may follow"
    assert not allowed[1].all() and allowed[1, ids("\n")[0]], "after the trigger only the call's opening"
    assert torch.equal(masked[1], logits[1, :2]), "row 1 is in free text"


def test_forbids_nothing_says_when_the_mask_would_change_nothing(tok):
    """The hook a fused verify path can take: True exactly where `mask_logits` returns the logits."""
    constraint = Constraint(grammar_of(tok, tool_tags(TOOLS)), [[0], [0]])
    constraint.commit(1, tok("x <tool_call>", add_special_tokens=False).input_ids)  # row 1 inside a call
    rng = random.Random(0)
    pieces = ["a", " ", "<", "tool", "_call", ">", "\n", "{", '"', "l", ">\n"]
    seen = set()
    for _ in range(60):
        paths = [[tok.convert_tokens_to_ids(c) if len(c) == 1 else tok(c, add_special_tokens=False).input_ids[0]
                  for c in rng.choices(pieces, k=rng.randrange(0, 5))] for _ in range(2)]
        paths = [[t for t in p if isinstance(t, int)] for p in paths]
        width = max(len(p) for p in paths)
        paths = [p + [tok.convert_tokens_to_ids("a")] * (width - len(p)) for p in paths]
        active = [rng.random() < 0.8, rng.random() < 0.8]
        logits = torch.randn(2, width + 1, len(tok))
        unchanged = torch.equal(constraint.mask_logits(logits, paths, active), logits)
        assert constraint.forbids_nothing(paths, active) == unchanged, (paths, active)
        seen.add(unchanged)
    assert seen == {True, False}
    assert (constraint.forbids_nothing([[], []], [True, False])
            and not constraint.forbids_nothing([[], []], [True, True]))


def ascii_engine(drafts=(), router=None, seed: int = 2) -> SpecEngine:
    """A tiny random Llama on the byte tokenizer that writes printable ASCII, newlines and EOS."""
    tok = byte_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    allowed = [tok.convert_tokens_to_ids(c) for c in tok.convert_ids_to_tokens(
        tok("".join(map(chr, range(32, 127))) + "\n", add_special_tokens=False).input_ids)]
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
        bias = torch.full((len(tok),), -30.0)
        bias[allowed] = 0.0
        bias[tok.eos_token_id] = -3.0
        model.lm_head.bias = torch.nn.Parameter(bias)
    return SpecEngine(LoadedModel(model, tok, "ascii"), list(drafts), router=router or FixedRouter(Arm(NO_DRAFT, 0)))


@pytest.fixture(scope="module")
def ascii_model() -> SpecEngine:
    return ascii_engine()


# With seed 2 the last two continue with free text holding `<`, `{` and quotes.
PROMPTS = ["Weather in Oslo for 3 days? ", "What time is it in utc? ", '<">"\'\':z', '{x""{ y\'']


def test_free_text_under_the_tags_equals_decoding_without_them(ascii_model):
    """The model never writes the trigger here, so greedy output is token for token the
    unconstrained output (and the grammar still tracked every token: commit raises otherwise)."""
    plain = ascii_model.generate(PROMPTS, max_new_tokens=40)
    tagged = ascii_model.generate(PROMPTS, max_new_tokens=40, json_schema=tool_tags(TOOLS))
    assert [r.token_ids for r in tagged] == [r.token_ids for r in plain]
    assert all("<tool_call>" not in r.text for r in plain) and len({r.text for r in plain}) == len(PROMPTS)
    assert all(c in plain[2].text + plain[3].text for c in '<{"'), "free text with the call's characters"


def valid_call(text: str) -> bool:
    """Whether `text` (after the primed opening) is one call of a bound tool valid under its schema."""
    body = text.split("\n</tool_call>")[0]
    try:
        call = json.loads(body)
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
    except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
        return False
    return text.startswith(body + "\n</tool_call>")


def test_every_primed_call_is_valid_and_without_the_tags_none_is(ascii_model):
    primed = [p + OPEN for p in PROMPTS]
    spec = tool_tags(TOOLS, opened=OPEN, parallel=False)
    rng = random.Random(0)
    for sampled in (False, True):
        from flashspec_core import SamplingParams

        sampling = SamplingParams(temperature=1.0, seed=rng.randrange(1000)) if sampled else None
        free = ascii_model.generate(primed, max_new_tokens=120, sampling=sampling)
        calls = ascii_model.generate(primed, max_new_tokens=120, sampling=sampling, json_schema=spec)
        assert all(valid_call(r.text) and r.finish_reason == "stop" for r in calls), [r.text for r in calls]
        assert not any(valid_call(r.text) for r in free), [r.text for r in free]


@torch.no_grad()
def masked_greedy(engine: SpecEngine, prompt: str, spec: dict, n: int) -> list[int]:
    """Grammar-masked greedy decoding written out: the model's full forward each token, xgrammar's
    mask, argmax (no engine, no cache, no speculation)."""
    tok, model = engine.tokenizer, engine.target_model
    matcher = xgr.GrammarMatcher(grammar_of(tok, spec).compiled)
    bitmask = xgr.allocate_token_bitmask(1, len(tok))
    ids, out = tok(prompt, add_special_tokens=False).input_ids, []
    while len(out) < n and not matcher.is_terminated():
        logits = model(torch.tensor([ids + out])).logits[0, -1:].float()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        out.append(int(logits.argmax()))
        assert matcher.accept_token(out[-1])
    return out


@pytest.mark.parametrize("arm", [Arm(NO_DRAFT, 0), Arm("grammar", 4), Arm("prompt_lookup", 6), Arm("model", 3)],
                         ids=str)
def test_greedy_under_the_tags_equals_masked_greedy_written_out(arm):
    """Exactness: with any draft the engine gives the tokens of grammar-masked greedy decoding, from
    inside a primed call out into free text and through later calls (parallel calls allowed)."""
    drafts = [GrammarForcedDraft(), PromptLookupDraft(), ModelDraft(ascii_engine(seed=1).target_model, name="model")]
    engine = ascii_engine(drafts, FixedRouter(arm))
    for prompt, spec in [(PROMPTS[0] + OPEN, tool_tags(TOOLS, opened=OPEN)), (PROMPTS[2], tool_tags(TOOLS)),
                         (PROMPTS[3] + OPEN, tool_tags(TOOLS, opened=OPEN))]:
        got = engine.generate(prompt, max_new_tokens=60, json_schema=spec)
        expected = masked_greedy(engine, prompt, spec, 60)
        assert got.token_ids == expected[: len(got.token_ids)] and len(got.token_ids) in (60, len(expected) - 1), \
            (prompt, got.text, engine.tokenizer.decode(expected))
