"""Requests -> engine calls and outputs -> replies, on the default model's tokenizer (no Ray).

The server must decide a call as the in-process adapters do: same domain rules, same Hermes tool
prompt, a forced call decoded under the call's schema, and tool calls parsed back without inventing
any.
"""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from flashspec_core.constrained import tool_call_schema
from flashspec_core.constrained.grammar import compile_workers
from flashspec_core.models import vocab_size
from flashspec_integrations.serve.protocol import APIError, parse_request
from flashspec_integrations.serve.translate import DeltaStream, plan_call, reply_message

pytestmark = pytest.mark.slow

MODEL = "m"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def engine(default_target):
    """What `plan_call` reads from an engine, over the default tokenizer (no decoding here)."""
    eos = default_target.model.generation_config.eos_token_id
    return SimpleNamespace(tokenizer=default_target.tokenizer, target_model=default_target.model,
                           eos_ids=frozenset([eos] if isinstance(eos, int) else eos), context_window=8192,
                           constrains=True)


def plan(engine, **body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What's the weather in Paris?"}], **body}
    return plan_call(engine, parse_request(json.dumps(body).encode()), default_max_tokens=64)


def prompt(engine, p) -> str:
    return engine.tokenizer.decode(p.prompt_ids)


def test_domains_follow_the_adapters_rules(engine):
    assert plan(engine, tools=[WEATHER]).decision.hint == "tool"
    forced = plan(engine, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (forced.domain, forced.decision.source) == ("json", "forced_tool")
    assert forced.json_schema == tool_call_schema([WEATHER], "get_weather")
    result = plan(engine, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"}])
    assert result.domain == "tool/result"
    assert plan(engine, domain="Code").domain == "code"
    assert plan(engine, metadata={"flashspec_domain": "rag"}).decision.source == "metadata"
    assert plan(engine, tools=[WEATHER], tool_choice="none").parse_tools is False


def test_tools_without_a_forced_choice_are_decoded_under_their_structural_tag(engine):
    auto, absent = plan(engine, tools=[WEATHER], tool_choice="auto"), plan(engine, tools=[WEATHER])
    assert auto.json_schema == absent.json_schema and auto.json_schema["type"] == "structural_tag"
    fmt = auto.json_schema["format"]
    assert fmt["triggers"] == ["<tool_call>"] and not fmt["at_least_one"] and not fmt["stop_after_first"]
    assert plan(engine, tools=[WEATHER], parallel_tool_calls=False).json_schema["format"]["stop_after_first"]
    two = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    assert plan(engine, tools=two, tool_choice="required").json_schema["format"]["at_least_one"]
    assert plan(engine, tools=[WEATHER], tool_choice="none").json_schema is None
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}
    with pytest.raises(APIError) as err:
        plan(engine, tools=[bad])
    assert err.value.status == 400 and err.value.param == "tools" and "structural tag" in str(err.value)


def test_the_hermes_tool_prompt_and_history_reach_the_model(engine):
    p = plan(engine, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"}])
    text = prompt(engine, p)
    assert "<tools>" in text and '"get_weather"' in text  # the tool listing and the call format
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text


def test_response_format_and_sampling_defaults(engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    p = plan(engine, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
             stop=["\n\n"], seed=3)
    assert p.json_schema == schema and p.domain == "json" and json.dumps(schema) in prompt(engine, p)
    assert p.stop == ("\n\n",) and p.sampling.seed == 3 and p.sampling.temperature == 1.0  # OpenAI's default
    assert plan(engine, response_format={"type": "json_object"}).json_schema == {"type": "object"}
    assert plan(engine).max_new_tokens == 64 and plan(engine, max_completion_tokens=5).max_new_tokens == 5


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/defs/x"}}}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"max_tokens": 9000}, "max_tokens"),
    ({"domain": " "}, "domain"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(engine, body, param):
    with pytest.raises(APIError) as err:
        plan(engine, **body)
    assert err.value.status == 400 and err.value.param == param
    assert (err.value.code == "context_length_exceeded") == (param == "max_tokens")  # OpenAI's code for it


def test_replies_parse_tool_calls_and_never_invent_one(engine):
    p = plan(engine, tools=[WEATHER])
    message, finish, invalid = reply_message(
        p, 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "stop")
    call = message["tool_calls"][0]
    assert finish == "tool_calls" and message["content"] == "Sure." and not invalid
    assert (call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
            and call["id"].startswith("call_"))
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'  # the grammar opens a call with its tag
    message, finish, invalid = reply_message(p, cut, "length")
    assert "tool_calls" not in message and message["content"] == cut and finish == "length"
    assert invalid and "incomplete" in invalid[0]["error"]
    message, _, _ = reply_message(plan(engine), "plain text", "stop")
    assert message == {"role": "assistant", "content": "plain text"}


def test_stream_deltas_hold_a_call_until_it_closes(engine):
    stream = DeltaStream(plan(engine, tools=[WEATHER]))
    pieces = ["Let me check. <tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']
    deltas = [d for i, piece in enumerate(pieces) for d in stream.feed(piece, "stop" if i == 2 else None)]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check. "
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert stream.finish_reason("stop") == "tool_calls"


def test_a_chat_template_that_refuses_the_messages_is_a_400(engine):
    tokenizer = copy.copy(engine.tokenizer)
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation roles "
                               "must alternate user/assistant') }}{% endif %}{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}")
    strict = SimpleNamespace(**{**vars(engine), "tokenizer": tokenizer})
    with pytest.raises(APIError) as err:
        plan(strict, messages=[{"role": "assistant", "content": "hi"}])
    assert err.value.status == 400 and err.value.param == "messages"
    assert "the chat template refused them: Conversation roles must alternate" in err.value.message
    assert plan(strict).prompt_ids  # a user message renders


def test_sampling_the_engine_refuses_is_a_400_even_past_the_protocol(engine):
    req = parse_request(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode())
    req = req.model_copy(update={"temperature": 0.005})  # as if the protocol had let it through
    with pytest.raises(APIError) as err:
        plan_call(engine, req, 64)
    assert err.value.status == 400 and err.value.param == "temperature" and "below 0.01" in err.value.message


def test_compile_workers_all_busy_is_a_503_with_the_servers_retry_after(engine, monkeypatch):
    from flashspec_core.constrained.compile_process import CompileBusy
    from flashspec_integrations.serve import translate

    def busy(*args, **kwargs):
        raise CompileBusy("every worker stayed busy")

    monkeypatch.setattr(translate, "as_grammar", busy)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    with pytest.raises(APIError) as err:
        plan_call(engine, parse_request(json.dumps(body).encode()), 64, compile_timeout_s=1, retry_after=9)
    assert (err.value.status, err.value.code, err.value.headers) == (503, "server_busy", {"Retry-After": "9"})


def test_the_servers_prompt_limit_and_schema_time_limit_are_400s(engine):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 50}]}
    with pytest.raises(APIError) as err:
        plan_call(engine, parse_request(json.dumps(body).encode()), 64, max_prompt_tokens=40)
    assert err.value.param == "messages" and "this server takes at most 40 (--max-prompt-tokens)" in err.value.message
    wide = {"type": "object", "properties": {f"slow{i}": {"type": "string"} for i in range(500)}}
    assert compile_workers(engine.tokenizer, vocab_size(engine.target_model), engine.eos_ids).wait_ready(120)
    with pytest.raises(APIError) as err:
        plan_call(engine, parse_request(json.dumps({**body, "response_format": {
            "type": "json_schema", "json_schema": {"name": "w", "schema": wide}}}).encode()), 64,
                  compile_timeout_s=0.01)
    assert err.value.param == "response_format" and "took longer than 0.01 s" in err.value.message


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     'response_format: xgrammar cannot compile this schema: Unsupported type "strin"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "("}}}},
     "response_format: xgrammar cannot compile this schema: Regex parsing error at position 2: "
     "The parenthesis is not closed."),
    ({"tools": [{"type": "function",
                 "function": {"name": "f", "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}}]},
     "tools: xgrammar cannot compile a schema inside the structural tag: Invalid range: minimum greater than maximum"),
])
def test_a_schema_xgrammar_refuses_is_a_400_with_the_field_and_the_problem_only(engine, body, message):
    with pytest.raises(APIError) as err:
        plan(engine, **body)
    assert (err.value.status, err.value.param, err.value.message) == (400, next(iter(body)), message)
