"""One chat input, three front ends, one engine call: LangChain's ChatFlashSpec, LlamaIndex's
FlashSpecLLM and the server's planner all go through `plan.plan_chat`, so the same messages,
tools, tool choice and response format reach the engine as the same request (prompt, stops,
budget, sampling, domain, schema), and the same reply reads back as the same tool calls."""
from __future__ import annotations

import json

import pytest
from fakes import ScriptedEngine, tiny_engine
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock

from flashspec_integrations.langchain import ChatFlashSpec
from flashspec_integrations.llama_index import FlashSpecLLM
from flashspec_integrations.serve.protocol import parse_request
from flashspec_integrations.serve.translate import plan_call, reply_message

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
SHOUT = {"type": "function", "function": {
    "name": "shout", "description": "Upper-case a text.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 3?"}]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

CASES = {  # name: (tools, tool_choice, response_format)
    "plain": ((), None, None),
    "auto": ((ADD, SHOUT), "auto", None),
    "named": ((ADD, SHOUT), {"type": "function", "function": {"name": "shout"}}, None),
    "required, one tool": ((ADD,), "required", None),
    "none": ((ADD, SHOUT), "none", None),
    "json schema": ((), None, JSON_FORMAT),
    "json object": ((), None, {"type": "json_object"}),
}


def _langchain(engine, tools, choice, fmt) -> None:
    model = ChatFlashSpec(engine=engine, max_tokens=32, temperature=0.0)
    bound = model.bind_tools(list(tools), tool_choice=choice) if tools else model
    if fmt is not None:
        bound = bound.bind(response_format=fmt)
    bound.invoke([(m["role"], m["content"]) for m in MESSAGES])


def _llama_index(engine, tools, choice, fmt) -> None:
    if fmt is not None:
        pytest.skip("LlamaIndex asks for structured output through a forced tool call, not a response format")
    llm = FlashSpecLLM(engine=engine, max_tokens=32, temperature=0.0)
    kwargs = {"tools": list(tools), "tool_choice": choice, "allow_parallel_tool_calls": True} if tools else {}
    llm.chat([ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES], **kwargs)


def _server_plan(engine, tools, choice, fmt):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 32, "temperature": 0.0}
    if tools:
        body.update(tools=list(tools), tool_choice=choice)
    if fmt is not None:
        body["response_format"] = fmt
    return plan_call(engine, parse_request(json.dumps(body).encode()), default_max_tokens=32)


@pytest.fixture(scope="module")
def server_engine():
    return tiny_engine()  # the same byte tokenizer and template as ScriptedEngine; the plan decodes nothing


def _request(call: dict) -> dict:
    return {k: call[k] for k in ("prompt", "stop", "max_new_tokens", "sampling", "domain", "hint", "json_schema")}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("front_end", [_langchain, _llama_index])
def test_the_front_ends_make_the_servers_engine_call(server_engine, front_end, case):
    tools, choice, fmt = CASES[case]
    engine = ScriptedEngine(["ok"])
    front_end(engine, tools, choice, fmt)
    plan = _server_plan(server_engine, tools, choice, fmt)
    served = {"prompt": server_engine.tokenizer.decode(plan.prompt_ids), **vars(plan.options())}
    served["stop"] = list(plan.stop)
    served["json_schema"] = plan.json_schema  # the server hands the engine this schema compiled
    assert _request(engine.calls[0]) == _request(served)
    if tools and choice != "none":
        assert engine.calls[0]["json_schema"] is not None, "tools in play are decoded under a grammar"


def test_the_same_reply_reads_as_the_same_calls_everywhere(server_engine):
    reply = f"Let me add.\n{CALL}"
    engine = ScriptedEngine([reply])
    lc = ChatFlashSpec(engine=engine).bind_tools([ADD, SHOUT]).invoke("What is 2 + 3?")
    llm = FlashSpecLLM(engine=engine)
    li = llm.get_tool_calls_from_response(llm.chat([ChatMessage(role="user", content="What is 2 + 3?")],
                                                   tools=[ADD, SHOUT], allow_parallel_tool_calls=True))
    message, finish, invalid = reply_message(_server_plan(server_engine, (ADD, SHOUT), "auto", None), reply, "stop")
    served = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert [(c["name"], c["args"]) for c in lc.tool_calls] == [(s.tool_name, s.tool_kwargs) for s in li] == served
    assert served == [("add", {"a": 2, "b": 3})] and finish == "tool_calls" and not invalid
    assert lc.content == message["content"] == "Let me add."


FENCED = 'Here is the call:\n```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```'
CUT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b'


def _read_everywhere(server_engine, engine, reply: str, finish: str, stream: bool) -> dict:
    """What each front end makes of `reply` to "What is 2 + 3?" with ADD and SHOUT bound under
    "auto": (valid call names, invalid call names, finish reason)."""
    messages = [ChatMessage(role="user", content="What is 2 + 3?")]
    bound = ChatFlashSpec(engine=engine, max_tokens=len(CUT) - 4 if finish == "length" else 256).bind_tools(
        [ADD, SHOUT], tool_choice="auto")
    llm = FlashSpecLLM(engine=engine, max_tokens=len(CUT) - 4 if finish == "length" else 256)
    if stream:
        chunks = list(bound.stream("What is 2 + 3?"))
        lc = chunks[0]
        for c in chunks[1:]:
            lc = lc + c
        lc_finish = chunks[-1].response_metadata.get("finish_reason")
        li = list(llm.stream_chat(messages, tools=[ADD, SHOUT], allow_parallel_tool_calls=True))[-1]
    else:
        lc = bound.invoke("What is 2 + 3?")
        lc_finish = lc.response_metadata["finish_reason"]
        li = llm.chat(messages, tools=[ADD, SHOUT], allow_parallel_tool_calls=True)
    li_calls = [b for b in li.message.blocks if isinstance(b, ToolCallBlock)]  # raw text: invalid
    plan = _server_plan(server_engine, (ADD, SHOUT), "auto", None).replace(untagged=engine.constrains is False)
    message, served_finish, invalid = reply_message(plan, reply, finish)
    return {
        "langchain": ([c["name"] for c in lc.tool_calls], [c["name"] for c in lc.invalid_tool_calls], lc_finish),
        "llama_index": ([c.tool_name for c in li_calls if isinstance(c.tool_kwargs, dict)],
                        [c.tool_name for c in li_calls if not isinstance(c.tool_kwargs, dict)],
                        li.raw["finish_reason"]),
        "server": ([c["function"]["name"] for c in message.get("tool_calls", [])], [c["name"] for c in invalid],
                   served_finish),
    }


@pytest.mark.parametrize("stream", [False, True])
def test_under_the_call_grammar_a_call_is_only_what_it_decoded(server_engine, stream):
    # A fenced JSON object naming a bound tool, written outside the `<tool_call>` tags: under the
    # structural tag the grammar never constrained it, so no front end reads it as a call.
    engine = ScriptedEngine([FENCED])
    read = _read_everywhere(server_engine, engine, FENCED, "stop", stream)
    assert read == {front: ([], [], "stop") for front in read}
    # An engine without grammars is read leniently: there the same object is the call it names.
    engine = ScriptedEngine([FENCED])
    engine.constrains = False
    read = _read_everywhere(server_engine, engine, FENCED, "stop", stream)
    assert read == {front: (["add"], [], "tool_calls" if front != "llama_index" else "stop") for front in read}


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_the_budget_is_invalid_with_finish_reason_length(server_engine, stream):
    engine = ScriptedEngine([CUT + '": 3}}\n</tool_call>'])
    read = _read_everywhere(server_engine, engine, CUT[:-4], "length", stream)
    assert read == {front: ([], ["add"], "length") for front in read}
