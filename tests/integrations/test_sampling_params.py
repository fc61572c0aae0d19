"""Both adapters pass the repetition penalty (a field or a call keyword) to the engine's sampling."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from flashspec_integrations.langchain import ChatFlashSpec, FlashSpecLLM
from flashspec_integrations.llama_index import FlashSpecLLM as LlamaIndexLLM


@pytest.mark.parametrize("cls", [FlashSpecLLM, ChatFlashSpec])
def test_langchain_models_pass_the_repetition_penalty(cls):
    model = cls(repetition_penalty=1.3)
    assert model._call_settings(None, {})[1].repetition_penalty == 1.3
    assert model._call_settings(None, {"repetition_penalty": 1.1})[1].repetition_penalty == 1.1
    with pytest.raises(ValueError, match="repetition_penalty"):
        model._call_settings(None, {"repetition_penalty": 0.0})


def test_llama_index_llm_passes_the_repetition_penalty():
    llm = LlamaIndexLLM(repetition_penalty=1.3)
    decision = SimpleNamespace(domain=None, hint=None)
    assert llm._engine_kwargs({}, decision, [])["sampling"].repetition_penalty == 1.3
    assert llm._engine_kwargs({"repetition_penalty": 1.2}, decision, [])["sampling"].repetition_penalty == 1.2
