"""ChatFlashSpec's tool calls: auto and forced calls, what fails to parse, streaming, history, tool options."""
from __future__ import annotations

import pytest
from fakes import ScriptedEngine, UnconstrainedEngine
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from test_langchain_chat import add, chat, shout

from flashspec_integrations.langchain import ChatFlashSpec


def test_auto_tool_call_is_parsed_with_ids_and_domain_tool():
    reply = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    model, engine = chat([reply])
    msg = model.bind_tools([add, shout]).invoke("What is 2 + 3?")
    assert msg.content == "Let me add."
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert msg.tool_calls[0]["id"].startswith("call_") and msg.invalid_tool_calls == []
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert engine.calls[0]["label"] == "tool"
    assert '"name": "shout"' in engine.calls[0]["prompt"] and "<tools>" in engine.calls[0]["prompt"]


def test_auto_calls_are_decoded_under_the_tools_structural_tag():
    """The model may answer or call; a call it opens is decoded under the bound tools' schemas."""
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    model, engine = chat([reply])
    assert model.bind_tools([add, shout]).invoke("2 + 3?").tool_calls[0]["args"] == {"a": 2, "b": 3}
    model.bind_tools([add, shout], parallel_tool_calls=False).invoke("2 + 3?")
    model.bind_tools([add, shout], tool_choice="any").invoke("2 + 3?")
    auto, single, required = (c["json_schema"]["format"] for c in engine.calls)
    assert [t["begin"].split('"')[3] for t in auto["tags"]] == ["add", "shout"] and auto["triggers"] == ["<tool_call>"]
    assert auto["tags"][0]["content"]["json_schema"]["required"] == ["a", "b"]
    assert (auto["at_least_one"], auto["stop_after_first"]) == (False, False)
    assert (single["at_least_one"], single["stop_after_first"]) == (False, True)
    assert (required["at_least_one"], required["stop_after_first"]) == (True, True)
    assert engine.calls[2]["prompt"].endswith("<|im_start|>assistant\n"), "the grammar writes the opening"
    assert [c["label"] for c in engine.calls] == ["tool", "tool", "json"]
    unconstrained = UnconstrainedEngine([reply])
    ChatFlashSpec(engine=unconstrained).bind_tools([add]).invoke("2 + 3?")
    assert unconstrained.calls[0]["json_schema"] is None


def test_forced_named_call_is_prefilled_stopped_and_parsed_without_a_constraint():
    engine = UnconstrainedEngine(['"a": 1, "b": 2}}\n</tool_call>\nmore text'])
    model = ChatFlashSpec(engine=engine)
    msg = model.bind_tools([add, shout], tool_choice="add").invoke("one plus two")
    call = engine.calls[0]
    assert call["prompt"].endswith('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {')
    assert "</tool_call>" in call["stop"] and call["label"] == "json"
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 1, "b": 2})]


def test_forced_any_prefills_only_the_opening_without_a_constraint():
    engine = UnconstrainedEngine(['shout", "arguments": {"text": "hi"}}'])
    model = ChatFlashSpec(engine=engine)
    msg = model.bind_tools([add, shout], tool_choice="any").invoke("say hi loudly")
    assert engine.calls[0]["prompt"].endswith('<tool_call>\n{"name": "')
    assert msg.tool_calls[0]["name"] == "shout" and msg.tool_calls[0]["args"] == {"text": "hi"}


@pytest.mark.parametrize(
    "reply, max_tokens, error",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b"', 1000, "not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 22222222222}}', 40, "incomplete JSON"),
        ('<tool_call>{"name": "divide", "arguments": {}}</tool_call>', 1000, "unknown tool"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', 1000, "no \"name\""),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', 1000, "not a JSON object"),
    ],
)
def test_what_fails_to_parse_goes_to_invalid_tool_calls(reply, max_tokens, error):
    model, _ = chat([reply], max_tokens=max_tokens)
    msg = model.bind_tools([add]).invoke("go")
    assert msg.tool_calls == []
    assert len(msg.invalid_tool_calls) == 1 and error in msg.invalid_tool_calls[0]["error"]


def test_stream_yields_tool_call_chunks_and_usage_once():
    reply = 'Sure <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call> done'
    model, _ = chat([reply])
    chunks = list(model.bind_tools([add]).stream("2+3?"))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert not any("<tool" in c.content for c in chunks if isinstance(c.content, str))
    assert sum(c.usage_metadata is not None for c in chunks) == 1
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("add", {"a": 2, "b": 3})]
    assert full.content.replace(" ", "") == "Suredone"
    assert full.response_metadata["finish_reason"] == "tool_calls"
    assert full.usage_metadata["output_tokens"] > 0


def test_stream_keeps_a_truncated_call_invalid():
    model, _ = chat(['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 99999999999999}}'], max_tokens=35)
    full = None
    for c in model.bind_tools([add]).stream("go"):
        full = c if full is None else full + c
    assert full.tool_calls == [] and len(full.invalid_tool_calls) == 1


def test_tool_history_renders_calls_and_results_and_reads_as_tool_result():
    model, engine = chat(["It is 5."])
    history = [
        HumanMessage("What is 2 + 3?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1"}]),
        ToolMessage("5", tool_call_id="c1", name="add"),
    ]
    model.bind_tools([add]).invoke(history)
    prompt = engine.calls[0]["prompt"]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
            '</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in prompt
    assert engine.calls[0]["label"] == "tool/result"
    # Anthropic-style list content with tool_use blocks renders the same way.
    listed = AIMessage([{"type": "text", "text": "hm"}, {"type": "tool_use", "id": "c1", "name": "add", "input": {}}],
                       tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1"}])
    model.bind_tools([add]).invoke([history[0], listed, history[2]])
    assert "hm\n<tool_call>" in engine.calls[1]["prompt"]


def test_a_forced_call_is_decoded_under_its_schema():
    model, engine = chat(['{"name": "add", "arguments": {"a": 1, "b": 2}}'])
    msg = model.bind_tools([add, shout], tool_choice="add").invoke("1+2")
    assert engine.calls[0]["prompt"].endswith("<|im_start|>assistant\n")  # the grammar writes it all
    schema = engine.calls[0]["json_schema"]
    assert schema["properties"]["name"] == {"const": "add"} and "a" in schema["properties"]["arguments"]["properties"]
    assert msg.tool_calls[0]["args"] == {"a": 1, "b": 2}
    model.invoke("plain")
    assert engine.calls[1]["json_schema"] is None


def test_a_template_with_tool_support_renders_tools_natively():
    engine = ScriptedEngine(['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'])
    engine.tokenizer.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments | tojson }})"
        "{% endfor %}\n"
        "{% endfor %}assistant:"
    )
    model = ChatFlashSpec(engine=engine)
    history = [
        HumanMessage("1+1?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 1}, "id": "c1"}]),
        ToolMessage("2", tool_call_id="c1"),
    ]
    msg = model.bind_tools([add, shout], tool_choice="add").invoke(history)
    prompt = engine.calls[0]["prompt"]
    assert prompt.startswith("TOOLS:add;shout;") and prompt.endswith("assistant:")  # no forced prefix
    assert 'CALL add({"a": 1, "b": 1})' in prompt and "tool: 2" in prompt
    assert msg.tool_calls[0]["args"] == {"a": 1, "b": 1}


def test_strict_tools_are_accepted_and_make_forced_schemas_strict():
    model, engine = chat(['{"name": "add", "arguments": {"a": 1, "b": 2}}'])
    msg = model.bind_tools([add], tool_choice="add", strict=True).invoke("1+2")
    assert msg.tool_calls[0]["args"] == {"a": 1, "b": 2}
    assert engine.calls[0]["json_schema"]["properties"]["arguments"]["additionalProperties"] is False
    model.bind_tools([add], tool_choice="add").invoke("1+2")
    assert "additionalProperties" not in engine.calls[1]["json_schema"]["properties"]["arguments"]
    model.bind_tools([add], strict=True).invoke("1+2")  # unforced: accepted, parsed as usual


def test_parallel_tool_calls_false_means_one_call():
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
           '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    model, engine = chat([two])
    assert len(model.bind_tools([add]).invoke("x").tool_calls) == 2
    assert "</tool_call>" not in engine.calls[0]["stop"]
    one = model.bind_tools([add], parallel_tool_calls=False).invoke("x")
    assert [c["args"] for c in one.tool_calls] == [{"a": 1, "b": 2}]
    # The grammar ends the reply after one call (no stop string: it would also cut a call whose
    # argument holds "</tool_call>"); a free reply stops where its call closes.
    assert (engine.calls[1]["json_schema"]["format"]["stop_after_first"]
            and "</tool_call>" not in engine.calls[1]["stop"])
    free = UnconstrainedEngine([two])
    assert len(ChatFlashSpec(engine=free).bind_tools([add], parallel_tool_calls=False).invoke("x").tool_calls) == 1
    assert "</tool_call>" in free.calls[0]["stop"]
    streamed = None
    for chunk in model.bind_tools([add]).stream("x", parallel_tool_calls=False):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["args"] for c in streamed.tool_calls] == [{"a": 1, "b": 2}]
