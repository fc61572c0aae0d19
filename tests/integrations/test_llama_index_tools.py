"""Tool calling in the LlamaIndex adapter: lenient parsing, forced calls, history rendering."""
from __future__ import annotations

import asyncio
import inspect

import jsonschema
import pytest
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel
from test_llama_index_support import ScriptedEngine, char_tokenizer

from flashspec_integrations.llama_index import FlashSpecLLM
from flashspec_integrations.llama_index._messages import render_chat, to_template_messages
from flashspec_integrations.llama_index._responses import PARTIAL
from flashspec_integrations.llama_index._tools import (
    CALL_CLOSE,
    constraint_kwargs,
    forced_call_schema,
    forced_prefix,
    forced_tool,
    loads_lenient,
    parse_tool_calls,
    tool_spec,
)


def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b."""
    return a * b


def lookup(city: str) -> str:
    """Look up facts about a city."""
    return f"{city} is nice"


TOOLS = [FunctionTool.from_defaults(multiply), FunctionTool.from_defaults(lookup)]
SPECS = [tool_spec(t) for t in TOOLS]


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"a": 1, "b": [1, 2],}', {"a": 1, "b": [1, 2]}),
        ("{'a': 'x', 'ok': True}", {"a": "x", "ok": True}),
        ('{"a": 6, "b": {"c": "cut', {"a": 6, "b": {"c": "cut"}}),
        ('Sure! {"a": 2} is the call', {"a": 2}),
    ],
)
def test_lenient_json_repairs_what_small_models_write(text, expected):
    assert loads_lenient(text) == expected


@pytest.mark.parametrize("text", ["no json here", "{1, 2}", "{'a': {1, 2}}", "{b'x': 1}"])
def test_lenient_json_rejects_what_is_not_json(text):
    with pytest.raises(ValueError):
        loads_lenient(text)


def test_tagged_calls_are_parsed_with_the_text_before_them():
    text = 'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>' \
           '<tool_call>{"name": "Lookup", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    before, calls = parse_tool_calls(text, ["multiply", "lookup"])
    assert before == "Let me compute."
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("multiply", {"a": 6, "b": 7}), ("lookup", {"city": "Oslo"})]
    assert len({c.tool_call_id for c in calls}) == 2


def test_untagged_json_is_a_call_only_when_it_names_a_known_tool():
    fenced = 'Calling:\n```json\n{"name": "multiply", "parameters": {"a": 2, "b": 3}}\n```'
    assert [(c.tool_name, c.tool_kwargs) for c in parse_tool_calls(fenced, ["multiply"])[1]] == [("multiply", {"a": 2, "b": 3})]
    openai_style = '{"function": {"name": "multiply", "arguments": {"a": 1, "b": 1}}}'
    assert parse_tool_calls(openai_style, ["multiply"])[1][0].tool_name == "multiply"
    answer = '{"name": "Ada", "arguments": "none"}'
    assert parse_tool_calls(answer, ["multiply"]) == (answer, [])
    assert parse_tool_calls(fenced, None) == (fenced, [])


def test_a_cut_off_call_keeps_its_name():
    _, calls = parse_tool_calls('<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b', ["multiply"])
    assert [c.tool_name for c in calls] == ["multiply"]


def test_forced_tool_from_llama_index_arguments():
    assert forced_tool(SPECS, "lookup", False) == (True, "lookup")
    assert forced_tool(SPECS, {"type": "function", "function": {"name": "multiply"}}, False) == (True, "multiply")
    assert forced_tool(SPECS, None, True) == (True, None)
    assert forced_tool(SPECS[:1], "required", False) == (True, "multiply")
    assert forced_tool(SPECS, "auto", False) == (False, None)
    with pytest.raises(ValueError, match="tool_choice"):
        forced_tool(SPECS, "divide", False)


def test_forced_call_schema_accepts_only_calls_of_the_forced_tools():
    one = forced_call_schema(SPECS, "multiply")
    jsonschema.validate({"name": "multiply", "arguments": {"a": 1, "b": 2}}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "lookup", "arguments": {"city": "x"}}, one)
    either = forced_call_schema(SPECS, None)
    jsonschema.validate({"name": "lookup", "arguments": {"city": "x"}}, either)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "lookup", "arguments": {}}, either)


def test_constraint_seam_follows_the_engine_signature():
    class WithSchema:
        def generate(self, prompt, max_new_tokens=1, json_schema=None):
            pass

    class Plain:
        def generate(self, prompt, max_new_tokens=1):
            pass

    assert constraint_kwargs(WithSchema(), {"type": "object"}) == {"json_schema": {"type": "object"}}
    assert constraint_kwargs(Plain(), {"type": "object"}) == {}
    assert forced_prefix("multiply", constrained=True) == "<tool_call>\n"
    assert forced_prefix("multiply", constrained=False).endswith('"name": "multiply", "arguments": {')
    lookup_params = SPECS[1]["function"]["parameters"]
    assert forced_prefix("lookup", constrained=False, parameters=lookup_params).endswith('"arguments": {"city": "')


def test_history_renders_calls_and_results_as_the_instructions_describe():
    call = ToolCallBlock(tool_call_id="c1", tool_name="multiply", tool_kwargs={"a": 6, "b": 7})
    history = [
        ChatMessage(role="user", content="6*7?"),
        ChatMessage(role="assistant", blocks=[call]),
        ChatMessage(role="tool", content="42", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role="assistant", content="", additional_kwargs={
            "tool_calls": [{"id": "c2", "function": {"name": "lookup", "arguments": '{"city": "Oslo"}'}}]}),
    ]
    dicts = to_template_messages(history)
    assert dicts[1] == {"role": "assistant", "content": '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'}
    assert dicts[2] == {"role": "tool", "content": "<tool_response>\n42\n</tool_response>"}
    assert '"name": "lookup", "arguments": {"city": "Oslo"}' in dicts[3]["content"]


def test_a_template_without_a_tool_role_gets_results_as_user_turns():
    tok = char_tokenizer()
    original = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('bad role') }}{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    )
    try:
        text = render_chat(tok, [{"role": "tool", "content": "<tool_response>\n1\n</tool_response>"}])
    finally:
        tok.chat_template = original
    assert text.startswith("user: <tool_response>")


def _tool_llm(script, **kwargs):
    engine = ScriptedEngine(script)
    return FlashSpecLLM(engine=engine, max_new_tokens=400, **kwargs), engine


def test_tool_required_prefills_the_call_and_parses_the_model_continuation():
    llm, engine = _tool_llm(['"a": 6, "b": 7}}\n</tool_call> trailing'])
    res = llm.chat_with_tools(TOOLS[:1], user_msg="What is 6 times 7?", tool_required=True)
    call = engine.calls[0]
    assert call["prompt"].endswith('<tool_call>\n{"name": "multiply", "arguments": {')
    assert CALL_CLOSE in call["stop"] and call["hint"] == "json"
    assert '"name": "multiply"' in call["prompt"].split("<|im_start|>user")[0]  # tools listed in the system turn
    selections = llm.get_tool_calls_from_response(res)
    assert [(s.tool_name, s.tool_kwargs) for s in selections] == [("multiply", {"a": 6, "b": 7})]
    assert res.raw["flashspec"]["domain"] == "json"


def test_auto_tool_calls_are_parsed_and_single_call_is_enforced():
    two = '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>' \
          '<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2}}</tool_call>'
    llm, engine = _tool_llm([two, two])
    single = llm.chat_with_tools(TOOLS, user_msg="Oslo?")
    assert [s.tool_name for s in llm.get_tool_calls_from_response(single)] == ["lookup"]
    assert engine.calls[0]["hint"] == "tool" and CALL_CLOSE in engine.calls[0]["stop"]
    parallel = llm.chat_with_tools(TOOLS, user_msg="Oslo?", allow_parallel_tool_calls=True)
    assert [s.tool_name for s in llm.get_tool_calls_from_response(parallel)] == ["lookup", "multiply"]


def test_no_tool_call_raises_only_when_asked_to():
    llm, _ = _tool_llm(["Just an answer."])
    res = llm.chat_with_tools(TOOLS, user_msg="hi")
    assert res.message.content == "Just an answer."
    assert llm.get_tool_calls_from_response(res, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(res)


def test_partial_streamed_chunks_yield_no_calls_and_the_last_chunk_does():
    llm, _ = _tool_llm(['<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>'])

    async def run():
        return [c async for c in await llm.astream_chat_with_tools(TOOLS, user_msg="Oslo?")]

    chunks = asyncio.run(run())
    assert len(chunks) > 2
    for chunk in chunks[:-1]:
        assert chunk.additional_kwargs[PARTIAL]
        assert llm.get_tool_calls_from_response(chunk, error_on_no_tool_call=True) == []
    assert [s.tool_kwargs for s in llm.get_tool_calls_from_response(chunks[-1])] == [{"city": "Oslo"}]


def test_tool_choice_none_hides_the_tools():
    llm, engine = _tool_llm(['<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'])
    res = llm.chat(messages=[ChatMessage(role="user", content="hi")], tools=SPECS, tool_choice="none")
    assert "<tools>" not in engine.calls[0]["prompt"]
    assert not any(isinstance(b, ToolCallBlock) for b in res.message.blocks)


def test_unreadable_forced_arguments_still_name_the_forced_tool():
    llm, _ = _tool_llm(["@@@"])
    res = llm.chat_with_tools(TOOLS, user_msg="x", tool_choice="multiply")
    (selection,) = llm.get_tool_calls_from_response(res)
    assert selection.tool_name == "multiply" and selection.tool_kwargs == {}


def test_a_forced_single_parameter_call_only_needs_the_value():
    llm, engine = _tool_llm(['Oslo"}}'])
    res = llm.chat_with_tools(TOOLS, user_msg="Tell me about Oslo", tool_choice="lookup")
    assert engine.calls[0]["prompt"].endswith('"arguments": {"city": "')
    assert [s.tool_kwargs for s in llm.get_tool_calls_from_response(res)] == [{"city": "Oslo"}]


def test_constrained_engines_get_the_call_schema_and_a_short_prefix():
    class ConstrainedScripted(ScriptedEngine):
        def generate(self, prompt, max_new_tokens=128, sampling=None, stop=None, domain=None, hint=None, json_schema=None):
            self.schemas.append(json_schema)
            return super().generate(prompt, max_new_tokens, sampling, stop, domain, hint)

    engine = ConstrainedScripted(['{"name": "lookup", "arguments": {"city": "Rome"}}'])
    engine.schemas = []
    llm = FlashSpecLLM(engine=engine)
    assert "json_schema" in inspect.signature(engine.generate).parameters
    res = llm.chat_with_tools(TOOLS, user_msg="Rome?", tool_choice="lookup")
    assert engine.schemas == [forced_call_schema(SPECS, "lookup")]
    assert engine.calls[0]["prompt"].endswith("<|im_start|>assistant\n<tool_call>\n")
    assert [s.tool_kwargs for s in llm.get_tool_calls_from_response(res)] == [{"city": "Rome"}]


def test_predict_and_call_runs_the_tool():
    llm, _ = _tool_llm(['"a": 3, "b": 5}}'])
    out = llm.predict_and_call(TOOLS[:1], user_msg="3 times 5", tool_required=True)
    assert out.response == "15"


def test_structured_predict_goes_through_a_forced_call():
    class Person(BaseModel):
        name: str
        age: int

    llm, engine = _tool_llm(['"name": "Ada", "age": 36}}'])
    person = llm.structured_predict(Person, PromptTemplate("Extract the person: {text}"), text="Ada is 36.")
    assert person == Person(name="Ada", age=36)
    assert engine.calls[0]["hint"] == "json"
    assert engine.calls[0]["prompt"].endswith('{"name": "Person", "arguments": {')
