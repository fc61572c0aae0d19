"""Tool calling in the LlamaIndex adapter: forced calls, parallel calls, history rendering, and
structured output (streamed too)."""
from __future__ import annotations

import asyncio

import pytest
from fakes import ScriptedEngine, UnconstrainedEngine
from llama_index.core import __version__ as llama_index_version
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.program import FunctionCallingProgram
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from packaging.version import Version
from pydantic import BaseModel

from flashspec_integrations.llama_index import FlashSpecLLM
from flashspec_integrations.llama_index._responses import PARTIAL
from flashspec_integrations.tool_calls import CALL_CLOSE


def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b."""
    return a * b


def lookup(city: str) -> str:
    """Look up facts about a city."""
    return f"{city} is nice"


class Person(BaseModel):
    """A person."""

    name: str
    age: int


TOOLS = [FunctionTool.from_defaults(multiply), FunctionTool.from_defaults(lookup)]
# llama-index-core passes a program's tool_choice through stream_call from 0.14.16 on.
PROGRAM_STREAMS_TOOL_CHOICE = Version(llama_index_version) >= Version("0.14.16")
PERSON_CALL = '{"name": "Person", "arguments": {"name": "Ada", "age": 36}}'


def _tool_llm(script, engine_cls=ScriptedEngine, **kwargs):
    engine = engine_cls(script)
    return FlashSpecLLM(engine=engine, max_tokens=400, **kwargs), engine


def test_tool_required_is_decoded_under_the_call_schema():
    llm, engine = _tool_llm(['{"name": "multiply", "arguments": {"a": 6, "b": 7}}'])
    res = llm.chat_with_tools(TOOLS[:1], user_msg="What is 6 times 7?", tool_required=True)
    call = engine.calls[0]
    assert call["prompt"].endswith("<|im_start|>assistant\n") and call["hint"] == "json"
    assert call["json_schema"]["properties"]["name"] == {"const": "multiply"}
    assert '"name": "multiply"' in call["prompt"].split("<|im_start|>user")[0]  # tools listed in the system turn
    selections = llm.get_tool_calls_from_response(res)
    assert [(s.tool_name, s.tool_kwargs) for s in selections] == [("multiply", {"a": 6, "b": 7})]
    assert res.raw["flashspec"]["domain"] == "json"


def test_an_engine_without_schemas_gets_the_call_opening_written_for_it():
    llm, engine = _tool_llm(['"a": 6, "b": 7}}\n</tool_call> trailing'], UnconstrainedEngine)
    res = llm.chat_with_tools(TOOLS, user_msg="6*7?", tool_choice="multiply")
    assert engine.calls[0]["prompt"].endswith('<tool_call>\n{"name": "multiply", "arguments": {')
    assert CALL_CLOSE in engine.calls[0]["stop"]
    assert [s.tool_kwargs for s in llm.get_tool_calls_from_response(res)] == [{"a": 6, "b": 7}]


def test_auto_tool_calls_are_parsed_and_single_call_is_enforced():
    two = '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>' \
          '<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2}}</tool_call>'
    llm, engine = _tool_llm([two])
    single = llm.chat_with_tools(TOOLS, user_msg="Oslo?")
    assert [s.tool_name for s in llm.get_tool_calls_from_response(single)] == ["lookup"]
    assert engine.calls[0]["hint"] == "tool" and CALL_CLOSE not in engine.calls[0]["stop"]  # the grammar ends it
    parallel = llm.chat_with_tools(TOOLS, user_msg="Oslo?", allow_parallel_tool_calls=True)
    assert [s.tool_name for s in llm.get_tool_calls_from_response(parallel)] == ["lookup", "multiply"]
    assert CALL_CLOSE not in engine.calls[1]["stop"]
    free, free_engine = _tool_llm([two], UnconstrainedEngine)
    assert len(free.get_tool_calls_from_response(free.chat_with_tools(TOOLS, user_msg="Oslo?"))) == 1
    assert CALL_CLOSE in free_engine.calls[0]["stop"]


def test_auto_calls_are_decoded_under_the_tools_structural_tag():
    reply = '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>'
    llm, engine = _tool_llm([reply])
    res = llm.chat_with_tools(TOOLS, user_msg="Oslo?")
    assert ([(s.tool_name, s.tool_kwargs) for s in llm.get_tool_calls_from_response(res)]
            == [("lookup", {"city": "Oslo"})])
    llm.chat_with_tools(TOOLS, user_msg="Oslo?", allow_parallel_tool_calls=True)
    llm.chat_with_tools(TOOLS, user_msg="Oslo?", tool_required=True)
    single, parallel, required = (c["json_schema"]["format"] for c in engine.calls)
    assert [t["begin"].split('"')[3] for t in single["tags"]] == ["multiply", "lookup"]
    assert (single["at_least_one"], single["stop_after_first"]) == (False, True), "one call unless parallel"
    assert (parallel["at_least_one"], parallel["stop_after_first"]) == (False, False)
    assert (required["at_least_one"], required["stop_after_first"]) == (True, True)
    assert [c["hint"] for c in engine.calls] == ["tool", "tool", "json"]


def test_calls_are_also_in_additional_kwargs_for_llama_index_core():
    """llama-index-core's structured streaming looks for calls in message.additional_kwargs."""
    llm, _ = _tool_llm(['<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>'])
    res = llm.chat_with_tools(TOOLS, user_msg="Oslo?")
    (call,) = res.message.additional_kwargs["tool_calls"]
    assert call["function"] == {"name": "lookup", "arguments": '{"city": "Oslo"}'}
    assert call["id"] == next(b for b in res.message.blocks if isinstance(b, ToolCallBlock)).tool_call_id


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


def test_streamed_deltas_hold_no_call_markup():
    """As LangChain's and the server's streams: text deltas carry the prose, the call comes whole."""
    reply = 'Let me look. <tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call> Done.'
    llm, _ = _tool_llm([reply])
    chunks = list(llm.stream_chat_with_tools(TOOLS, user_msg="Oslo?", allow_parallel_tool_calls=True))
    deltas = "".join(c.delta for c in chunks)
    assert "<tool_call>" not in deltas and "lookup" not in deltas and deltas == "Let me look.  Done."
    assert all("tool_call" not in c.message.content for c in chunks[:-1])
    assert [s.tool_kwargs for s in llm.get_tool_calls_from_response(chunks[-1])] == [{"city": "Oslo"}]
    plain, _ = _tool_llm(["No <b>tools</b> here."])
    assert ("".join(c.delta for c in plain.stream_chat([ChatMessage(role="user", content="hi")]))
            == "No <b>tools</b> here.")


def test_tool_choice_none_hides_the_tools():
    llm, engine = _tool_llm(['<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'])
    res = llm.chat(messages=[ChatMessage(role="user", content="hi")],
                   tools=[t.metadata.to_openai_tool() for t in TOOLS], tool_choice="none")
    assert "<tools>" not in engine.calls[0]["prompt"]
    assert not any(isinstance(b, ToolCallBlock) for b in res.message.blocks)


def test_unreadable_forced_arguments_still_name_the_forced_tool():
    llm, _ = _tool_llm(["@@@"], UnconstrainedEngine)
    res = llm.chat_with_tools(TOOLS, user_msg="x", tool_choice="multiply")
    (selection,) = llm.get_tool_calls_from_response(res)
    assert selection.tool_name == "multiply" and selection.tool_kwargs == {}


def test_history_renders_calls_and_results_as_the_instructions_describe():
    llm, engine = _tool_llm(["42."])
    call = ToolCallBlock(tool_call_id="c1", tool_name="multiply", tool_kwargs={"a": 6, "b": 7})
    history = [
        ChatMessage(role="user", content="6*7?"),
        ChatMessage(role="assistant", blocks=[call]),
        ChatMessage(role="tool", content="42", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role="assistant", content="", additional_kwargs={
            "tool_calls": [{"id": "c2", "function": {"name": "lookup", "arguments": '{"city": "Oslo"}'}}]}),
        ChatMessage(role="user", content="and Oslo?"),
    ]
    llm.chat(history, tools=[t.metadata.to_openai_tool() for t in TOOLS])
    prompt = engine.calls[0]["prompt"]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n'
            '</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in prompt
    assert '{"name": "lookup", "arguments": {"city": "Oslo"}}' in prompt


def test_predict_and_call_runs_the_tool():
    llm, _ = _tool_llm(['{"name": "multiply", "arguments": {"a": 3, "b": 5}}'])
    out = llm.predict_and_call(TOOLS[:1], user_msg="3 times 5", tool_required=True)
    assert out.response == "15"


def test_structured_predict_goes_through_a_forced_call():
    llm, engine = _tool_llm([PERSON_CALL])
    person = llm.structured_predict(Person, PromptTemplate("Extract the person: {text}"), text="Ada is 36.")
    assert person == Person(name="Ada", age=36)
    assert (engine.calls[0]["hint"] == "json"
            and engine.calls[0]["json_schema"]["properties"]["name"] == {"const": "Person"})


def test_streamed_structured_output_ends_with_the_fields_filled():
    """llama-index-core reads streamed calls from additional_kwargs, and its FunctionCallingProgram
    streams without tool_required (run-llama/llama_index#19620): both ended in an object of None
    fields before. The LLM's entry points force the call; a program streamed directly takes
    tool_choice="required" (which llama-index-core passes on from 0.14.16)."""
    llm, engine = _tool_llm([PERSON_CALL])
    prompt = PromptTemplate("Extract the person: {text}")
    *_, last = llm.stream_structured_predict(Person, prompt, text="Ada is 36.")
    assert (last.name, last.age) == ("Ada", 36)
    *_, chat_last = llm.as_structured_llm(Person).stream_chat([ChatMessage(role="user", content="Ada is 36.")])
    assert chat_last.raw == Person(name="Ada", age=36)
    if PROGRAM_STREAMS_TOOL_CHOICE:
        program = FunctionCallingProgram.from_defaults(Person, prompt=prompt, llm=llm, tool_choice="required")
        *_, program_last = program.stream_call(text="Ada is 36.")
        assert program_last == Person(name="Ada", age=36)

    async def astreamed():
        return [p async for p in await llm.astream_structured_predict(Person, prompt, text="Ada is 36.")][-1]

    assert asyncio.run(astreamed()) == Person(name="Ada", age=36)
    # Every one of those calls was forced and decoded under the output's schema.
    assert [c["hint"] for c in engine.calls] == ["json"] * (4 if PROGRAM_STREAMS_TOOL_CHOICE else 3)
    assert all(c["json_schema"]["properties"]["name"] == {"const": "Person"} for c in engine.calls)
    llm.chat_with_tools(TOOLS, user_msg="hi")  # the forcing ended with the structured calls
    last = engine.calls[-1]  # the model's choice: free text or calls, not a forced call
    assert last["hint"] == "tool" and last["json_schema"]["format"]["at_least_one"] is False
