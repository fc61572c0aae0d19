"""FlashSpecLLM's LlamaIndex contract on a tiny real engine: every method, sync, async, streaming."""
from __future__ import annotations

import asyncio
import time

import pytest
from fakes import CONTEXT, LoopWatchingEngine, ScriptedEngine, tiny_engine
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock
from llama_index.core.callbacks import CallbackManager, CBEventType
from llama_index.core.callbacks.base_handler import BaseCallbackHandler
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM

from flashspec_integrations.llama_index import FlashSpecLLM, record_steps
from flashspec_integrations.llama_index._responses import PARTIAL

USER = [ChatMessage(role="user", content="hello there")]


@pytest.fixture
def llm(torch_one_thread) -> FlashSpecLLM:
    return FlashSpecLLM(engine=tiny_engine(), max_new_tokens=12)  # the other name of max_tokens


def _engine_text(llm: FlashSpecLLM, messages) -> str:
    """What the engine itself writes for the chat-templated messages (the reference output)."""
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    return llm.engine.generate(ids, max_new_tokens=llm.max_tokens).text


def test_construction_is_instant_and_loads_nothing():
    start = time.perf_counter()
    llm = FlashSpecLLM()
    assert time.perf_counter() - start < 0.5
    assert llm.engine is None and llm._resolved is None
    assert isinstance(llm, CustomLLM) and isinstance(llm, FunctionCallingLLM)


def test_metadata_comes_from_the_model(llm):
    meta = llm.metadata
    assert meta.context_window == CONTEXT
    assert meta.num_output == 12
    assert meta.is_chat_model and meta.is_function_calling_model
    assert meta.model_name == "tiny"
    assert FlashSpecLLM(engine=tiny_engine(), context_window=100).metadata.context_window == 100


def test_complete_uses_the_chat_template_and_reports_usage_and_stats(llm):
    res = llm.complete("hello there")
    assert res.text == _engine_text(llm, [{"role": "user", "content": "hello there"}])
    usage = res.raw["usage"]
    n = len(llm.engine.tokenizer(res.text, add_special_tokens=False).input_ids)
    assert usage["completion_tokens"] == n > 0 and usage["total_tokens"] == usage["prompt_tokens"] + n
    stats = res.raw["flashspec"]
    assert stats["steps"] == len(stats["arms"]) > 0 and stats["domain"] == "chat"
    assert res.additional_kwargs["completion_tokens"] == n and res.additional_kwargs["flashspec"] == stats


def test_formatted_completion_is_raw_text(llm):
    raw = llm.complete("hello there", formatted=True)
    ids = llm.engine.tokenizer("hello there").input_ids
    assert raw.text == llm.engine.generate(ids, max_new_tokens=12).text
    assert raw.raw["usage"]["prompt_tokens"] == len(ids)


def test_stream_complete_matches_complete(llm):
    chunks = list(llm.stream_complete("hello there"))
    assert "".join(c.delta for c in chunks) == chunks[-1].text == llm.complete("hello there").text
    assert all(c.additional_kwargs.get(PARTIAL) for c in chunks[:-1])
    assert chunks[-1].raw["flashspec"]["steps"] > 0 and PARTIAL not in chunks[-1].additional_kwargs


def test_chat_and_stream_chat_agree(llm):
    res = llm.chat(USER)
    assert res.message.role == "assistant"
    assert res.message.content == _engine_text(llm, [{"role": "user", "content": "hello there"}])
    chunks = list(llm.stream_chat(USER))
    assert "".join(c.delta for c in chunks) == chunks[-1].message.content == res.message.content
    assert chunks[-1].raw["usage"] == res.raw["usage"]


def test_async_methods_match_sync(llm):
    async def run():
        done = await llm.acomplete("hello there")
        chat = await llm.achat(USER)
        stream_c = [c async for c in await llm.astream_complete("hello there")]
        stream_m = [c async for c in await llm.astream_chat(USER)]
        return done, chat, stream_c, stream_m

    done, chat, stream_c, stream_m = asyncio.run(run())
    assert done.text == llm.complete("hello there").text == "".join(c.delta for c in stream_c)
    assert chat.message.content == llm.chat(USER).message.content == stream_m[-1].message.content
    assert stream_m[-1].raw["flashspec"]["steps"] > 0


@pytest.mark.parametrize("method", ["acomplete", "achat", "astream_chat"])
def test_async_methods_do_not_block_the_event_loop(method):
    """The engine produces each chunk and finishes each request only after the caller's event
    loop has ticked: a method that waited on the engine with the loop blocked times out."""
    engine = LoopWatchingEngine(["abcdefghijklmnopqrstuvwxyz"])
    llm = FlashSpecLLM(engine=engine, max_new_tokens=200)

    async def run():
        task = asyncio.create_task(engine.tick())
        if method == "acomplete":
            text = (await llm.acomplete("hello there")).text
        elif method == "achat":
            text = (await llm.achat(USER)).message.content
        else:
            text = "".join([c.delta async for c in await llm.astream_chat(USER)])
        task.cancel()
        return text

    assert asyncio.run(run()) == "abcdefghijklmnopqrstuvwxyz"
    assert len(engine.calls) == 1


def test_an_abandoned_async_stream_releases_the_engine(llm):
    async def run():
        stream = await llm.astream_chat(USER)
        async for _ in stream:
            break
        await stream.aclose()
        return await llm.achat(USER)  # would wait forever if the engine stayed locked

    assert asyncio.run(asyncio.wait_for(run(), timeout=60)).message.content


def test_stop_strings_cut_the_output(llm):
    full = llm.complete("hello there", max_new_tokens=30).text
    stop = full[5:7]
    cut = llm.complete("hello there", max_new_tokens=30, stop=[stop])
    assert cut.text == full[: full.index(stop)]
    assert cut.raw["finish_reason"] == "stop"
    field_stop = FlashSpecLLM(engine=tiny_engine(), max_new_tokens=30, stop=[stop])
    assert field_stop.complete("hello there").text == cut.text


def test_call_kwargs_override_generation_settings(llm):
    assert llm.complete("hello there", max_new_tokens=3).raw["usage"]["completion_tokens"] == 3
    assert llm.complete("hello there", max_tokens=4).raw["usage"]["completion_tokens"] == 4
    scripted = ScriptedEngine(["ok", "ok"])
    configured = FlashSpecLLM(engine=scripted, temperature=0.5, top_k=5, seed=1)
    configured.complete("hi")
    configured.complete("hi", temperature=0.9, top_p=0.8, seed=3)
    first, second = (c["sampling"] for c in scripted.calls)
    assert (first.temperature, first.top_k, first.top_p, first.seed) == (0.5, 5, 1.0, 1)
    assert (second.temperature, second.top_k, second.top_p, second.seed) == (0.9, 5, 0.8, 3)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.complete(""), "prompt"),
        (lambda m: m.complete("hi", max_new_tokens=0), "max_new_tokens"),
        (lambda m: m.complete("hi", temperature=-1.0), "temperature"),
        (lambda m: m.chat([]), "messages"),
        (lambda m: m.chat([ChatMessage(role="user", blocks=[ImageBlock(url="http://x/y.png")])]), "text only"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_argument(llm, call, match):
    with pytest.raises(ValueError, match=match):
        call(llm)


def test_async_bad_input_raises_at_await(llm):
    async def run():
        await llm.astream_chat([])

    with pytest.raises(ValueError, match="messages"):
        asyncio.run(run())


class _Events(BaseCallbackHandler):
    def __init__(self):
        super().__init__([], [])
        self.seen: list[tuple[str, CBEventType]] = []

    def on_event_start(self, event_type, payload=None, event_id="", parent_id="", **kwargs):
        self.seen.append(("start", event_type))
        return event_id

    def on_event_end(self, event_type, payload=None, event_id="", **kwargs):
        self.seen.append(("end", event_type))

    def start_trace(self, trace_id=None):
        pass

    def end_trace(self, trace_id=None, trace_map=None):
        pass


def test_callbacks_and_instrumentation_fire_for_every_method(llm):
    handler = _Events()
    llm.callback_manager = CallbackManager([handler])
    with record_steps() as recorder:
        llm.complete("hello there")
        list(llm.stream_complete("hello there"))
        llm.chat(USER)
        list(llm.stream_chat(USER))
        asyncio.run(llm.achat(USER))
    llm_events = [s for s in handler.seen if s[1] == CBEventType.LLM]
    assert llm_events.count(("start", CBEventType.LLM)) == llm_events.count(("end", CBEventType.LLM)) == 5
    assert [s.kind for s in recorder.steps] == ["completion", "completion", "chat", "chat", "chat"]
    assert all(s.arms and s.domain == "chat" for s in recorder.steps)


def test_system_prompt_goes_into_the_template(llm):
    with_system = FlashSpecLLM(engine=tiny_engine(), max_new_tokens=12, system_prompt="Be brief.")
    expected = _engine_text(llm, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "hello there"}])
    assert with_system.complete("hello there").text == expected


def test_custom_messages_to_prompt_replaces_the_template():
    seen = []

    def to_prompt(messages):
        seen.append(len(messages))
        return "Q: " + messages[-1].content + "\nA:"

    llm = FlashSpecLLM(engine=tiny_engine(), max_new_tokens=6, messages_to_prompt=to_prompt)
    res = llm.chat([ChatMessage(role="user", blocks=[TextBlock(text="hi")])])
    assert seen == [1]
    assert res.raw["usage"]["prompt_tokens"] == len(tiny_engine().tokenizer("Q: hi\nA:").input_ids)
