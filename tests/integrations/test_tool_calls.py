"""The one tool-call parser both adapters use: what it repairs, what it refuses, and that both
frameworks read one reply as the same calls."""
from __future__ import annotations

import pytest
from fakes import ScriptedEngine
from langchain_core.tools import tool
from llama_index.core.base.llms.types import ToolCallBlock
from llama_index.core.tools import FunctionTool

from flashspec_integrations.langchain import ChatFlashSpec
from flashspec_integrations.llama_index import FlashSpecLLM
from flashspec_integrations.tool_calls import (
    ToolCallStreamer,
    loads_lenient,
    parse_tool_calls,
)
from flashspec_integrations.tool_choice import (
    ToolChoice,
    normalize_tool_choice,
    reply_constraint,
)

NAMES = ["add", "lookup"]
SPECS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]


@pytest.mark.parametrize(
    "reply, name, args",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "add", {"a": 1, "b": 2}),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}</tool_call>', "add", {"a": 1, "b": 2}),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2,},}</tool_call>', "add", {"a": 1, "b": 2}),
        ("<tool_call>{'name': 'add', 'arguments': {'a': 1, 'ok': True}}</tool_call>", "add", {"a": 1, "ok": True}),
        ('<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>', "add", {"a": 1}),
        ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 4}"}</tool_call>', "add", {"a": 4}),
        ('<tool_call>{"function": {"name": "Lookup", "arguments": {"city": "Oslo"}}}</tool_call>', "lookup",
         {"city": "Oslo"}),
        ('```json\n{"name": "lookup", "arguments": {"city": "x"}}\n```', "lookup", {"city": "x"}),
        ('Calling it: {"name": "lookup", "arguments": {"city": "x"}} now.', "lookup", {"city": "x"}),
    ],
)
def test_lenient_where_the_intent_is_clear(reply, name, args):
    _, calls = parse_tool_calls(reply, NAMES)
    assert [(c.name, c.arguments, c.valid) for c in calls] == [(name, args, True)]


@pytest.mark.parametrize(
    "reply, finished, error",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 22', False, "incomplete JSON"),
        ('<tool_call>{"name": "add", "arguments": {"a": "cut', True, "not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b"', True, "not valid JSON"),
        ('<tool_call>{"name": "divide", "arguments": {}}</tool_call>', True, "unknown tool"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', True, 'no "name"'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', True, "not a JSON object"),
        ("<tool_call>{'name': 'add', 'arguments': {1, 2}}</tool_call>", True, "not valid JSON"),
    ],
)
def test_honest_where_it_is_not(reply, finished, error):
    _, calls = parse_tool_calls(reply, NAMES, finished)
    assert len(calls) == 1 and not calls[0].valid and calls[0].arguments is None and error in calls[0].error


def test_a_broken_call_keeps_its_name_and_text():
    _, (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 6, "b', NAMES, finished=False)
    assert (call.name, call.raw) == ("add", '{"name": "add", "arguments": {"a": 6, "b')


def test_untagged_json_is_a_call_only_when_it_names_a_known_tool():
    answer = '{"name": "Ada", "arguments": "none"}'
    assert parse_tool_calls(answer, NAMES) == (answer, [])
    assert parse_tool_calls('{"name": "add", "arguments": {}}', []) == ('{"name": "add", "arguments": {}}', [])
    content, calls = parse_tool_calls('Sure <tool_call>{"name": "add", "arguments": {}}</tool_call> done', NAMES)
    assert content == "Sure  done" and calls[0].name == "add"


def test_loads_lenient_refuses_cut_text_and_non_json_values():
    assert loads_lenient('{"a": 1,}') == {"a": 1}
    with pytest.raises(ValueError, match="incomplete"):
        loads_lenient('{"a": 1,}', closed=False)
    for text in ["no json here", "{1, 2}", "{b'x': 1}"]:
        with pytest.raises(ValueError):
            loads_lenient(text)


def test_tool_choice_in_both_frameworks_spellings():
    assert normalize_tool_choice(None, SPECS) == normalize_tool_choice("auto", SPECS) == ToolChoice()
    assert normalize_tool_choice("none", SPECS) == ToolChoice(none=True)
    assert normalize_tool_choice("any", SPECS) == normalize_tool_choice(True, SPECS) == ToolChoice(forced=True)
    assert normalize_tool_choice(None, SPECS, required=True) == ToolChoice(forced=True)  # LlamaIndex's tool_required
    assert normalize_tool_choice("required", SPECS[:1]) == ToolChoice(forced=True, name="add")
    assert normalize_tool_choice({"type": "function", "function": {"name": "lookup"}}, SPECS).name == "lookup"
    assert normalize_tool_choice({"type": "tool", "name": "lookup"}, SPECS).name == "lookup"
    with pytest.raises(ValueError, match="tool_choice"):
        normalize_tool_choice("divide", SPECS)


def test_a_call_whose_argument_holds_the_close_tag_is_read_whole():
    """Under a grammar any string may hold `</tool_call>`: the call's JSON object is read first."""
    reply = ('Sure <tool_call>\n{"name": "lookup", "arguments": {"city": "a</tool_call>b"}}\n</tool_call> ok '
             '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(reply, NAMES)
    assert content == "Sure  ok" and [(c.name, c.arguments) for c in calls] == [
        ("lookup", {"city": "a</tool_call>b"}), ("add", {})]
    streamer, out = ToolCallStreamer(NAMES), []
    for i in range(0, len(reply), 7):
        out += list(streamer.feed(reply[i: i + 7]))
    out += list(streamer.finish(True))
    assert [(c.name, c.arguments) for _, c in out if c] == [(c.name, c.arguments) for c in calls]
    assert "".join(text for text, _ in out) == "Sure  ok "


def test_the_grammar_of_each_tool_choice():
    """A call forced to one tool: its schema; the model's choice, or one of several required: the
    structural tag of calls in the prompt's format (the Hermes one unless the template has its own)."""
    assert reply_constraint(SPECS, ToolChoice(none=True), None, True) is None
    forced = reply_constraint(SPECS, ToolChoice(forced=True, name="add"), None, True)
    assert forced["properties"]["name"] == {"const": "add"}
    auto = reply_constraint(SPECS, ToolChoice(), None, True)["format"]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"]
    assert [t["begin"] for t in auto["tags"]] == [f'<tool_call>\n{{"name": "{n}", "arguments": ' for n in NAMES]
    assert not auto["at_least_one"] and not auto["stop_after_first"]
    required = reply_constraint(SPECS, ToolChoice(forced=True), None, False)["format"]
    assert required["at_least_one"] and required["stop_after_first"]
    llama = reply_constraint(SPECS, ToolChoice(), "{% if tools %}...<|python_tag|>...{% endif %}", True)
    assert llama["format"]["triggers"] == ['{"name": ']
    with pytest.raises(ValueError, match="tool-call format this engine cannot constrain"):
        reply_constraint(SPECS, ToolChoice(), "{% if tools %}[AVAILABLE_TOOLS]{% endif %}", True)


def test_the_streamer_passes_text_and_holds_calls_whole():
    streamer = ToolCallStreamer(NAMES)
    out = []
    for piece in ["Let me ", "check <tool", '_call>{"name": "add", ', '"arguments": {"a": 1}}</tool_call> ok']:
        out += list(streamer.feed(piece))
    out += list(streamer.finish(True))
    assert "".join(text for text, _ in out) == "Let me check  ok"
    assert [(c.name, c.arguments) for _, c in out if c] == [("add", {"a": 1})]


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _free(engine: ScriptedEngine) -> ScriptedEngine:
    engine.constrains = False
    return engine


def _li_add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize("reply", [
    'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3,}}\n</tool_call>',
    '```json\n{"name": "add", "parameters": {"a": 2, "b": 3}}\n```',
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}</tool_call>',
])
def test_both_adapters_read_one_reply_as_the_same_calls(reply):
    # Read leniently, as from an engine without grammars (under the call grammar only the tagged
    # forms can be written: test_one_plan.py).
    lc = ChatFlashSpec(engine=_free(ScriptedEngine([reply]))).bind_tools([add]).invoke("2+3?")
    li_llm = FlashSpecLLM(engine=_free(ScriptedEngine([reply])))
    li = li_llm.get_tool_calls_from_response(
        li_llm.chat_with_tools([FunctionTool.from_defaults(_li_add, name="add")], user_msg="2+3?"))
    assert ([(c["name"], c["args"]) for c in lc.tool_calls] == [(s.tool_name, s.tool_kwargs) for s in li]
            == [("add", {"a": 2, "b": 3})])


def test_an_argument_the_tool_does_not_declare_makes_the_call_invalid_in_both_adapters():
    """As the call grammar's strict mode does: LangChain reports it in invalid_tool_calls, LlamaIndex
    never hands it to the tool as arguments (a tool of either framework may drop unknown ones)."""
    reply = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3, "c": 4}}</tool_call>'
    lc = ChatFlashSpec(engine=ScriptedEngine([reply])).bind_tools([add]).invoke("2+3?")
    assert lc.tool_calls == [] and "unknown arguments ['c']; add takes ['a', 'b']" in lc.invalid_tool_calls[0]["error"]
    li_llm = FlashSpecLLM(engine=ScriptedEngine([reply]))
    response = li_llm.chat_with_tools([FunctionTool.from_defaults(_li_add, name="add")], user_msg="2+3?")
    (block,) = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
    assert block.tool_name == "add" and isinstance(block.tool_kwargs, str), "the raw text, not arguments"
    loose = {"add": {"type": "object", "properties": {"a": {}}, "additionalProperties": True}}
    assert parse_tool_calls(reply, loose)[1][0].arguments == {"a": 2, "b": 3, "c": 4}
    assert parse_tool_calls(reply, ["add"])[1][0].valid, "names alone: no schema to check against"
