"""ChatFlashSpec contract: rendering, structured output, domains, streaming, async, batching, bad
input (tool calls: test_langchain_tools.py)."""
from __future__ import annotations

import asyncio
import json
import time

import pydantic.v1
import pytest
from fakes import LoopWatchingEngine, ScriptedEngine, tiny_engine
from helpers import hold_prefills_until, step_rows
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from flashspec_integrations import settings
from flashspec_integrations.engines import EngineSettings
from flashspec_integrations.langchain import ChatFlashSpec


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


class PersonV1(pydantic.v1.BaseModel):
    name: str
    age: int


class Person(BaseModel):
    """A person."""

    name: str = Field(description="full name")
    age: int


def chat(script, **kw) -> tuple[ChatFlashSpec, ScriptedEngine]:
    engine = ScriptedEngine(script)
    return ChatFlashSpec(engine=engine, **kw), engine


def test_invoke_reports_usage_metadata_and_stats():
    model, engine = chat(["Paris is the capital."])
    msg = model.invoke([SystemMessage("Be brief."), HumanMessage("Capital of France?")])
    assert msg.content == "Paris is the capital."
    prompt = engine.calls[0]["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>") and prompt.endswith("<|im_start|>assistant\n")
    n_prompt = len(engine.tokenizer(prompt, add_special_tokens=False).input_ids)
    n_out = len(engine.tokenizer(msg.content, add_special_tokens=False).input_ids)
    assert msg.usage_metadata == {"input_tokens": n_prompt, "output_tokens": n_out, "total_tokens": n_prompt + n_out}
    meta = msg.response_metadata
    assert (meta["model_name"], meta["finish_reason"]) == ("scripted", "stop")
    assert meta["flashspec"]["domain"] == engine.calls[0]["label"]
    assert meta["flashspec"]["domain_source"] == "classifier"


def test_construction_is_lazy_and_resolves_the_engine_once(monkeypatch):
    built = []
    monkeypatch.setattr(settings, "engine_for", lambda s: built.append(s) or ScriptedEngine(["ok"]))
    model = ChatFlashSpec(max_tokens=5)
    assert built == []
    model.invoke("hi")
    model.invoke("hi again")
    assert built == [EngineSettings()]
    ChatFlashSpec(model="some/other-model").invoke("hi")
    assert built[-1] == EngineSettings(target="some/other-model")


def test_the_model_is_named_for_what_decodes():
    """With engine= or target=, traces and responses name that model, not the default one."""
    model = ChatFlashSpec(engine=ScriptedEngine(["ok"], model_name="org/my-target"))
    assert model._get_ls_params()["ls_model_name"] == "org/my-target"
    assert model.invoke("x").response_metadata["model_name"] == "org/my-target"
    assert ChatFlashSpec(target="org/other-model")._get_ls_params()["ls_model_name"] == "org/other-model"
    assert ChatFlashSpec(model="org/other-model").model_name == "org/other-model"
    assert ChatFlashSpec()._get_ls_params()["ls_model_name"] == "SmolLM2-135M-Instruct"
    assert ChatFlashSpec()._get_ls_params(model="override")["ls_model_name"] == "override"
    with pytest.raises(ValueError, match="model="):  # a call cannot switch the target
        model.invoke("x", model="another")


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_with_structured_output(method):
    body = '{"name": "Ada Lovelace", "age": 36}'
    reply = f'{{"name": "Person", "arguments": {body}}}' if method == "function_calling" else f"Here: {body}"
    model, engine = chat([reply])
    schema = Person if method != "json_mode" else None
    out = model.with_structured_output(schema, method=method).invoke("Who wrote the first program?")
    expected = Person(name="Ada Lovelace", age=36)
    assert (out == expected) if method != "json_mode" else (out == expected.model_dump())
    assert engine.calls[0]["label"] == "json"
    if method == "json_schema":
        assert '"age"' in engine.calls[0]["prompt"] and "JSON" in engine.calls[0]["prompt"]
    if method == "json_mode":  # no schema to show: a printed {"type": "object"} reads as an example
        assert "JSON object" in engine.calls[0]["prompt"] and '"type"' not in engine.calls[0]["prompt"]


def test_json_mode_with_a_schema_decodes_under_it():
    model, engine = chat(['{"name": "Ada Lovelace", "age": 36}'])
    assert model.with_structured_output(Person, method="json_mode").invoke("x") == Person(name="Ada Lovelace", age=36)
    assert engine.calls[0]["json_schema"]["required"] == ["name", "age"]
    model.with_structured_output(None, method="json_mode").invoke("x")
    assert engine.calls[1]["json_schema"] == {"type": "object"}


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output_takes_a_pydantic_v1_model(method):
    body = '{"name": "Ada Lovelace", "age": 36}'
    reply = f'{{"name": "PersonV1", "arguments": {body}}}' if method == "function_calling" else body
    model, _ = chat([reply])
    out = model.with_structured_output(PersonV1, method=method).invoke("Who wrote the first program?")
    assert isinstance(out, PersonV1) and out.age == 36


def test_structured_output_include_raw_reports_parse_errors():
    model, _ = chat(['{"name": "Person", "arguments": {"name": 5, "age": "old"}}'])
    out = model.with_structured_output(Person, include_raw=True).invoke("x")
    assert out["parsed"] is None and out["parsing_error"] is not None and isinstance(out["raw"], AIMessage)


def test_domain_precedence_and_agent_node():
    model, engine = chat(["ok"])
    bound = model.bind_tools([add])
    bound.invoke("x", config={"metadata": {"langgraph_node": "agent"}})
    bound.invoke("x", config={"metadata": {"flashspec_domain": "Code"}})
    bound.invoke("x", domain="math", config={"metadata": {"flashspec_domain": "code"}})
    ChatFlashSpec(engine=engine, domain="rag").bind_tools([add]).invoke("x")
    ChatFlashSpec(engine=engine, domain_per_node=True).bind_tools([add]).invoke(
        "x", config={"metadata": {"langgraph_node": "agent"}})
    assert [c["label"] for c in engine.calls] == ["tool", "code", "math", "rag", "tool/agent"]
    msg = bound.invoke("x", config={"metadata": {"langgraph_node": "agent"}})
    assert msg.response_metadata["flashspec"]["agent_node"] == "agent"


def test_streaming_paths_read_the_run_context():
    """LangChain's `stream` gives `_stream` no run manager; inside a chain or graph node the run
    config travels in the runnable-config context variable, which the adapter reads."""
    model, engine = chat(["ok"])
    config = {"metadata": {"flashspec_domain": "code", "langgraph_node": "coder"}}
    chunks = list((RunnableLambda(lambda x: x) | model).stream("x", config=config))
    assert chunks[-1].response_metadata["flashspec"]["agent_node"] == "coder"

    async def astream():
        chain = RunnableLambda(lambda x: x) | model.bind_tools([add])
        return [c async for c in chain.astream("x", config={"metadata": {"flashspec_domain": "math"}})]

    asyncio.run(astream())
    list(model.stream("x", domain="rag"))  # a bare stream takes the domain as a call argument
    assert [c["label"] for c in engine.calls] == ["code", "math", "rag"]


def test_rag_prompt_gets_the_rag_hint():
    model, engine = chat(["3"])
    model.invoke("Answer the question based only on the following context:\nx is 3\n\nQuestion: what is x?")
    assert (engine.calls[0]["hint"], engine.calls[0]["label"]) == ("rag", "rag")


def test_token_counting_matches_the_rendered_prompt():
    model, engine = chat(["ok"])
    msgs = [HumanMessage("hello there")]
    model.invoke(msgs)
    assert model.get_num_tokens_from_messages(msgs) == len(engine.tokenizer(engine.calls[0]["prompt"]).input_ids)
    assert model.get_num_tokens_from_messages(msgs, tools=[add]) > model.get_num_tokens_from_messages(msgs)
    assert model.get_token_ids("abc") == engine.tokenizer("abc", add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.invoke("x", frobnicate=1), "frobnicate"),
        (lambda m: m.bind_tools([add], tool_choice="divide"), "tool_choice"),
        (lambda m: m.invoke([HumanMessage([{"type": "image", "url": "http://x"}])]), "image"),
        (lambda m: m.invoke("x", max_tokens=0), "max_tokens"),
        (lambda m: m.invoke("x", temperature=-1.0), "temperature"),
        (lambda m: m.with_structured_output(Person, method="xml"), "method"),
        (lambda m: m.invoke([]), "messages"),
    ],
)
def test_bad_input_raises_value_error_naming_it(call, match):
    model, _ = chat(["ok"])
    with pytest.raises(ValueError, match=match):
        call(model)


class SlowEngine(ScriptedEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay = 0.4

    def stream(self, *args, **kwargs):
        for chunk in super().stream(*args, **kwargs):
            time.sleep(0.05)
            yield chunk


def test_timeout_raises_after_the_retries():
    engine = SlowEngine(["a" * 30])
    with pytest.raises(TimeoutError, match="timeout"):
        ChatFlashSpec(engine=engine, timeout=0.01, max_retries=2).invoke("x")
    assert len(engine.calls) == 3


def test_async_paths_do_not_block_the_event_loop():
    engine = LoopWatchingEngine(["abcdefghijklmnopqrstuvwxyz"])
    model = ChatFlashSpec(engine=engine)

    async def main():
        task = asyncio.create_task(engine.tick())
        parts = [c.content async for c in model.astream("x")]
        msg = await model.ainvoke("x")
        task.cancel()
        return "".join(parts), msg.content

    streamed, invoked = asyncio.run(main())
    assert streamed == invoked == "abcdefghijklmnopqrstuvwxyz"
    assert len(engine.calls) == 2


def test_batch_runs_side_by_side_in_the_engine_and_matches_single_calls(monkeypatch):
    engine = tiny_engine()
    model = ChatFlashSpec(engine=engine, max_tokens=40)
    prompts = [f"question {i}" for i in range(4)]
    alone = [model.invoke(p) for p in prompts]
    widths = step_rows(monkeypatch, engine)
    hold_prefills_until(monkeypatch, engine, lambda: engine.running + engine.queued == len(prompts))
    together = model.batch(prompts)
    assert [m.content for m in together] == [m.content for m in alone]
    assert max(widths) >= 2, "the calls of a batch share the engine's decode steps"


def test_real_engine_stream_matches_invoke_and_respects_stop():
    model = ChatFlashSpec(engine=tiny_engine(), max_tokens=16)
    text = model.invoke("hello").content
    assert "".join(c.content for c in model.stream("hello")) == text
    stop = text[5:8]
    assert model.invoke("hello", stop=[stop]).content == text[: text.find(stop)]
    assert json.dumps(model.invoke("hello").response_metadata["flashspec"]["arms"])


def test_chat_batch_and_concurrent_ainvoke_each_reach_the_engine_as_a_request_of_their_own():
    model, engine = chat(["ok"])
    configs = [{}, {}, {"metadata": {"flashspec_domain": "code"}}]
    assert [m.content for m in model.batch(["a", "b", "c"], config=configs)] == ["ok"] * 3
    assert engine.batches == [1, 1, 1]
    assert sorted(c["label"] for c in engine.calls) == ["chat", "chat", "code"]  # each call its own domain

    async def gathered():
        return await asyncio.gather(*(model.ainvoke(f"r{i}") for i in range(3)), model.abatch(["s0", "s1"]))

    results = asyncio.run(gathered())
    assert [m.content for m in results[:3]] + [m.content for m in results[3]] == ["ok"] * 5
    assert engine.batches == [1] * 8


def test_openai_penalties_are_accepted_at_zero_and_refused_with_the_fix_otherwise():
    model, engine = chat(["ok"])
    assert model.invoke("x", frequency_penalty=0.0, presence_penalty=0).content == "ok"
    with pytest.raises(ValueError, match="repetition_penalty"):
        model.invoke("x", frequency_penalty=0.5)
    with pytest.raises(ValueError, match="presence_penalty"):
        model.invoke("x", presence_penalty=1)
