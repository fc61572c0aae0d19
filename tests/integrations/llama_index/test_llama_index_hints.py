"""Domain hints from LlamaIndex context: explicit domains, tags, tools, tool results, ReAct, RAG."""
from __future__ import annotations

import asyncio

import pytest
from fakes import ScriptedEngine
from llama_index.core.agent.react.formatter import ReActChatFormatter
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.instrumentation.dispatcher import instrument_tags
from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_REFINE_PROMPT_SEL, DEFAULT_TEXT_QA_PROMPT_SEL
from llama_index.core.tools import FunctionTool

from flashspec_integrations.llama_index import FlashSpecLLM

USER = [ChatMessage(role="user", content="Tell me a joke.")]


def _llm(script=("ok",) * 4, **kwargs):
    engine = ScriptedEngine(list(script))
    return FlashSpecLLM(engine=engine, max_new_tokens=200, **kwargs), engine


def test_plain_chat_leaves_the_domain_to_the_engine_classifier():
    llm, engine = _llm()
    res = llm.chat(USER)
    # The engine gets the classifier's label as its hint (so a batch holds one label's prompts).
    assert (engine.calls[0]["domain"], engine.calls[0]["hint"]) == (None, "chat")
    assert (res.raw["flashspec"]["hint"], res.raw["flashspec"]["domain_source"]) == (None, "classifier")
    assert res.raw["flashspec"]["domain"] == "chat"


def test_explicit_domain_beats_tags_which_beat_the_default():
    llm, engine = _llm(domain="default-domain")
    llm.chat(USER)
    with instrument_tags({"flashspec_domain": "tagged"}):
        llm.chat(USER)
        llm.chat(USER, domain="code")
    with instrument_tags({"domain": "math"}):
        asyncio.run(llm.achat(USER))  # tags cross into the worker thread
    assert [c["domain"] for c in engine.calls] == ["default-domain", "tagged", "code", "math"]
    assert all(c["hint"] is None for c in engine.calls)


def test_tool_results_in_the_history_mean_a_tool_step():
    llm, engine = _llm()
    history = [
        ChatMessage(role="user", content="6*7?"),
        ChatMessage(role="tool", content="42", additional_kwargs={"tool_call_id": "c1"}),
    ]
    llm.chat(history)
    assert engine.calls[0]["hint"] == "tool/result"
    assert "<tool_response>" in engine.calls[0]["stop"]


def test_bound_tools_mean_a_tool_step():
    llm, engine = _llm()
    tool = FunctionTool.from_defaults(lambda x: x, name="echo", description="Echo x.")
    llm.chat_with_tools([tool], user_msg="echo hi")
    assert engine.calls[0]["hint"] == "tool"


def test_a_react_header_means_a_react_step_that_starts_with_a_thought():
    llm, engine = _llm([' I need a tool.\nAction: echo\nAction Input: {"x": 1}\nObservation: made up'])
    tool = FunctionTool.from_defaults(lambda x: x, name="echo", description="Echo x.")
    messages = ReActChatFormatter.from_defaults().format([tool], chat_history=USER, current_reasoning=[])
    res = llm.chat(messages)
    call = engine.calls[0]
    assert call["hint"] == "react"
    assert call["prompt"].endswith("<|im_start|>assistant\nThought:")
    assert "\nObservation:" in call["stop"]
    assert res.message.content == 'Thought: I need a tool.\nAction: echo\nAction Input: {"x": 1}'


def test_react_prefill_can_be_switched_off():
    llm, engine = _llm(react_prefill=False)
    tool = FunctionTool.from_defaults(lambda x: x, name="echo", description="Echo x.")
    llm.chat(ReActChatFormatter.from_defaults().format([tool], chat_history=USER, current_reasoning=[]))
    assert engine.calls[0]["hint"] == "react" and engine.calls[0]["prompt"].endswith("assistant\n")


@pytest.mark.parametrize(
    "template, args",
    [
        (DEFAULT_TEXT_QA_PROMPT_SEL, {"context_str": "Rivers are long.", "query_str": "How long?"}),
        (DEFAULT_REFINE_PROMPT_SEL, {"context_msg": "More.", "query_str": "How long?", "existing_answer": "Long."}),
        # A custom wording the text rules do not know: recognised by its variables.
        (PromptTemplate("Facts: {context_str}\nAsk: {query_str}"), {"context_str": "x", "query_str": "y"}),
    ],
)
def test_synthesis_templates_mean_a_rag_step_on_every_entry_point(template, args):
    llm, engine = _llm(["answer"] * 4)
    llm.predict(template, **args)
    "".join(llm.stream(template, **args))
    asyncio.run(llm.apredict(template, **args))

    async def astream():
        return "".join([t async for t in await llm.astream(template, **args)])

    asyncio.run(astream())
    assert [c["hint"] for c in engine.calls] == ["rag"] * 4


def test_other_templates_are_not_rag():
    llm, engine = _llm()
    out = llm.predict(PromptTemplate("Write a haiku about {topic}."), topic="snow")
    assert out == "ok" and engine.calls[0]["hint"] == "chat"  # the classifier's label, not rag


def test_the_template_scope_ends_with_the_call():
    llm, engine = _llm()
    llm.predict(DEFAULT_TEXT_QA_PROMPT_SEL, context_str="a", query_str="b")
    llm.chat(USER)
    assert [c["hint"] for c in engine.calls] == ["rag", "chat"]


def test_a_formatted_synthesis_prompt_is_rag_even_without_the_template():
    llm, engine = _llm()
    text = DEFAULT_TEXT_QA_PROMPT_SEL.format(context_str="Rivers are long.", query_str="How long?")
    llm.complete(text)
    assert engine.calls[0]["hint"] == "rag"
