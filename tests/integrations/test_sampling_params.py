"""Both adapters pass the repetition penalty and the n-gram ban (a field or a call keyword) to the
engine's sampling."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from flashspec_integrations.langchain import ChatFlashSpec, FlashSpecLLM
from flashspec_integrations.llama_index import FlashSpecLLM as LlamaIndexLLM

SETTINGS = [("repetition_penalty", 1.3, 1.1, 0.0), ("no_repeat_ngram_size", 3, 2, -1)]


@pytest.mark.parametrize("cls", [FlashSpecLLM, ChatFlashSpec])
@pytest.mark.parametrize("name, field, call, bad", SETTINGS)
def test_langchain_models_pass_the_setting(cls, name, field, call, bad):
    model = cls(**{name: field})
    assert getattr(model._call_settings(None, {})[1], name) == field
    assert getattr(model._call_settings(None, {name: call})[1], name) == call
    with pytest.raises(ValueError, match=name):
        model._call_settings(None, {name: bad})


@pytest.mark.parametrize("name, field, call, bad", SETTINGS)
def test_llama_index_llm_passes_the_setting(name, field, call, bad):
    llm = LlamaIndexLLM(**{name: field})
    decision = SimpleNamespace(domain=None, hint=None)
    assert getattr(llm._engine_kwargs({}, decision, [])["sampling"], name) == field
    assert getattr(llm._engine_kwargs({name: call}, decision, [])["sampling"], name) == call
