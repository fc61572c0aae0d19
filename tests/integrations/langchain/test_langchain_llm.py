"""FlashSpecLLM on a real engine over a tiny random model: invoke, batch, stream, astream, stop, callbacks."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import ScriptedEngine, tiny_engine
from helpers import step_rows
from langchain_core.callbacks import BaseCallbackHandler

from flashspec_integrations.langchain import FlashSpecLLM

PROMPTS = ["The quick brown fox", "def f(x):\n    return", "Once upon a time"]


@pytest.fixture(scope="module")
def llm() -> FlashSpecLLM:
    return FlashSpecLLM(engine=tiny_engine(), max_tokens=16)


class Recorder(BaseCallbackHandler):
    def __init__(self):
        self.tokens: list[str] = []
        self.ends: list[Any] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)

    def on_llm_end(self, response, **kwargs: Any) -> None:
        self.ends.append(response)


def test_invoke_returns_text_and_stats(llm):
    result = llm.generate([PROMPTS[0]])
    gen = result.generations[0][0]
    info = gen.generation_info
    assert gen.text == llm.invoke(PROMPTS[0])  # greedy: reproducible
    assert info["finish_reason"] in ("stop", "length")
    assert info["usage"]["output_tokens"] == info["flashspec"]["steps"] + info["flashspec"]["accepted"]
    assert info["flashspec"]["domain"] and len(info["flashspec"]["arms"]) == info["flashspec"]["steps"]
    assert result.llm_output["token_usage"]["total_tokens"] == info["usage"]["total_tokens"]


def test_batch_decodes_together_and_matches_single_calls(llm, monkeypatch):
    alone = [llm.invoke(p) for p in PROMPTS]
    engine = llm.get_engine()
    widths = step_rows(monkeypatch, engine)
    result = llm.generate(PROMPTS)
    assert [g[0].text for g in result.generations] == alone
    assert max(widths) >= 2  # the prompts shared the engine's decode steps
    assert llm.batch(PROMPTS) == alone


def test_stream_and_astream_concatenate_to_invoke(llm):
    text = llm.invoke(PROMPTS[2])
    chunks = list(llm.stream(PROMPTS[2]))
    assert "".join(chunks) == text and len(chunks) > 1

    async def collect():
        return [c async for c in llm.astream(PROMPTS[2])], await llm.ainvoke(PROMPTS[2])

    achunks, ainvoked = asyncio.run(collect())
    assert "".join(achunks) == ainvoked == text


def test_stop_strings_spanning_tokens(llm):
    text = llm.invoke(PROMPTS[1])
    stop = text[4:7]  # three byte-tokens: the stop string spans tokens
    assert len(llm.get_token_ids(stop)) == 3
    cut = text[: text.find(stop)]
    assert llm.invoke(PROMPTS[1], stop=[stop]) == cut
    assert "".join(llm.stream(PROMPTS[1], stop=[stop])) == cut
    assert FlashSpecLLM(engine=llm.engine, max_tokens=16, stop=[stop]).invoke(PROMPTS[1]) == cut


def test_callbacks_see_every_streamed_token_and_the_end(llm):
    rec = Recorder()
    text = "".join(llm.stream(PROMPTS[0], config={"callbacks": [rec]}))
    assert "".join(rec.tokens) == text and len(rec.ends) == 1
    final = rec.ends[0].generations[0][0].generation_info
    assert final["flashspec"]["steps"] >= 1
    rec2 = Recorder()
    llm.invoke(PROMPTS[0], config={"callbacks": [rec2]})
    assert rec2.ends[0].generations[0][0].text == llm.invoke(PROMPTS[0])


def test_domain_hints_reach_the_engine():
    engine = ScriptedEngine(["ok"])
    llm = FlashSpecLLM(engine=engine)
    llm.invoke("Context: the sky is green.\n\nQuestion: what colour is the sky?")
    llm.invoke("hello", domain="code")
    llm.invoke("hello", config={"metadata": {"flashspec_domain": "math"}})
    assert [c["label"] for c in engine.calls] == ["rag", "code", "math"]


def test_standard_params_and_bad_input(llm):
    params = llm._get_ls_params(stop=["x"])
    assert params["ls_provider"] == "flashspec" and params["ls_model_type"] == "llm" and params["ls_stop"] == ["x"]
    with pytest.raises(ValueError, match="prompt"):
        llm.invoke("")
    with pytest.raises(ValueError, match="max_tokens"):
        FlashSpecLLM(engine=llm.engine).invoke("x", max_tokens=-1)


@pytest.mark.slow
def test_default_model_end_to_end():
    llm = FlashSpecLLM(max_tokens=8)
    out = llm.generate(["The capital of France is"]).generations[0][0]
    assert out.text.strip() and out.generation_info["flashspec"]["steps"] >= 1
    assert out.generation_info["usage"]["output_tokens"] <= 8
