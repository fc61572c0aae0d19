"""What a call may carry is the same in both adapters: a `timeout` that the engine honours at its
next step boundary (a long prefill included), and call keywords it takes, any other one refused by
name with the same message, never silently ignored."""
from __future__ import annotations

import asyncio

import pytest
from fakes import CONTEXT, ScriptedEngine, tiny_engine
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.tools import FunctionTool

from flashspec_core.prompts import ContextLengthError
from flashspec_integrations.langchain import ChatFlashSpec
from flashspec_integrations.langchain import FlashSpecLLM as LangChainLLM
from flashspec_integrations.llama_index import FlashSpecLLM

LONG = "hello there " * (CONTEXT // 24)  # a byte per token: a prefill of half the context
USER = [ChatMessage(role="user", content="hello there")]


def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def _complete(llm): return llm.complete(LONG)
def _chat(llm): return llm.chat([ChatMessage(role="user", content=LONG)])
def _stream(llm): return "".join(r.delta or "" for r in llm.stream_complete(LONG))
def _acomplete(llm): return asyncio.run(llm.acomplete(LONG))


async def _drain(gen):
    return [r async for r in await gen]


def _astream_chat(llm): return asyncio.run(_drain(llm.astream_chat([ChatMessage(role="user", content=LONG)])))


@pytest.mark.parametrize("call", [_complete, _chat, _stream, _acomplete, _astream_chat])
def test_llama_index_timeout_ends_the_call_at_the_engines_next_step(torch_one_thread, call):
    with pytest.raises(TimeoutError, match="ran past its timeout"):
        call(FlashSpecLLM(engine=tiny_engine(), max_tokens=8, timeout=1e-6))
    assert call(FlashSpecLLM(engine=tiny_engine(), max_tokens=8, timeout=60)), "a timeout not reached changes nothing"


def test_the_timeout_reaches_the_engine_as_langchain_passes_it():
    for make in (lambda e: FlashSpecLLM(engine=e, timeout=7.5), lambda e: ChatFlashSpec(engine=e, timeout=7.5)):
        engine = ScriptedEngine(["ok"])
        seen: list[float | None] = []
        submit = engine.submit
        engine.submit = lambda prompts, options, **kw: seen.append(options.timeout) or submit(prompts, options, **kw)
        model = make(engine)
        model.complete("hi") if isinstance(model, FlashSpecLLM) else model.invoke("hi")
        assert seen == [7.5]
    with pytest.raises(ValueError, match="timeout"):
        FlashSpecLLM(engine=ScriptedEngine(["ok"]), timeout=0)


@pytest.mark.parametrize("call", [lambda e: FlashSpecLLM(engine=e, max_tokens=CONTEXT).complete("hi"),
                                  lambda e: LangChainLLM(engine=e, max_tokens=CONTEXT).invoke("hi")])
def test_a_call_past_the_context_window_is_refused_at_once_naming_max_new_tokens(call):
    engine = tiny_engine()
    with pytest.raises(ContextLengthError, match=rf"max_new_tokens: the prompt has \d+ tokens.*{CONTEXT}"):
        call(engine)
    assert (engine.running, engine.queued) == (0, 0)


@pytest.mark.parametrize("call", [
    lambda m: m.complete("hi", temprature=0.5),
    lambda m: m.stream_complete("hi", temprature=0.5),
    lambda m: asyncio.run(m.acomplete("hi", temprature=0.5)),
    lambda m: m.chat(USER, temprature=0.5),
    lambda m: asyncio.run(m.astream_chat(USER, temprature=0.5)),
    lambda m: m.chat_with_tools([FunctionTool.from_defaults(get_weather)], "Weather in Oslo?", temprature=0.5),
])
def test_an_unknown_call_argument_is_refused_by_name_in_every_method(call):
    with pytest.raises(ValueError, match=r"unsupported call arguments \['temprature'\]; use .*temperature"):
        call(FlashSpecLLM(engine=ScriptedEngine(["ok"])))


def test_both_adapters_refuse_an_unknown_argument_with_the_same_message():
    messages = []
    for call in (lambda: FlashSpecLLM(engine=ScriptedEngine(["ok"])).complete("hi", top_kk=3),
                 lambda: LangChainLLM(engine=ScriptedEngine(["ok"])).invoke("hi", top_kk=3)):
        with pytest.raises(ValueError) as err:
            call()
        messages.append(str(err.value))
    assert messages[0] == messages[1] and messages[0].startswith("unsupported call arguments ['top_kk']; use ")


def test_the_arguments_llama_index_itself_passes_are_taken():
    llm = FlashSpecLLM(engine=ScriptedEngine(['{"name": "get_weather", "arguments": {"city": "Oslo"}}']))
    tool = FunctionTool.from_defaults(get_weather)
    response = llm.chat_with_tools([tool], "Weather in Oslo?", verbose=True, allow_parallel_tool_calls=False,
                                   tool_required=True, tool_choice="get_weather", temperature=0, max_tokens=64)
    assert llm.get_tool_calls_from_response(response)[0].tool_kwargs == {"city": "Oslo"}
    assert llm.complete("hi", formatted=True, stop=["x"], domain="code", frequency_penalty=0, seed=1).text
