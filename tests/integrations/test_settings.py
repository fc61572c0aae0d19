"""One shape for both adapters: the same constructor fields with the same names, one engine per
setting shared by every instance, settings that survive serialisation, sampling passed through."""
from __future__ import annotations

import pytest
from fakes import ScriptedEngine
from llama_index.core.base.llms.types import ChatMessage

from flashspec_core import SpecEngine
from flashspec_integrations import engines
from flashspec_integrations.langchain import ChatFlashSpec, FlashSpecLLM
from flashspec_integrations.llama_index import FlashSpecLLM as LlamaIndexLLM
from flashspec_integrations.settings import FlashSpecFields

CLASSES = [ChatFlashSpec, FlashSpecLLM, LlamaIndexLLM]
SETTINGS = {"target": "org/some-model", "drafts": ["prompt_lookup", "suffix_cache"], "router": "ucb1",
            "device": "cpu", "max_tokens": 77, "temperature": 0.5, "top_k": 4, "top_p": 0.9, "seed": 3,
            "repetition_penalty": 1.2, "no_repeat_ngram_size": 3, "stop": ["\n\n"], "domain": "code",
            "domain_per_node": True}


def _invoke(model, **kwargs):
    if isinstance(model, LlamaIndexLLM):
        return model.chat([ChatMessage(role="user", content="hi")], **kwargs)
    return model.invoke("hi", **kwargs)


@pytest.mark.parametrize("cls", CLASSES)
def test_every_adapter_takes_the_same_fields_by_the_same_names(cls):
    assert set(FlashSpecFields.model_fields) <= set(cls.model_fields)
    model = cls(**SETTINGS)
    assert {k: getattr(model, k) for k in SETTINGS} == SETTINGS
    assert cls(max_new_tokens=5).max_tokens == 5 and cls(model="org/m").target == "org/m"


@pytest.mark.parametrize("cls", CLASSES)
def test_settings_survive_serialisation(cls):
    model = cls(**SETTINGS)
    if cls is LlamaIndexLLM:
        again = cls.from_json(model.to_json())
    else:
        again = cls(**model.model_dump())
    assert {k: getattr(again, k) for k in SETTINGS} == SETTINGS
    engine = ScriptedEngine(["ok"])
    assert "engine" not in cls(engine=engine).model_dump()  # an object, not a setting


@pytest.mark.parametrize("cls", CLASSES)
def test_bad_settings_are_refused_naming_the_fix(cls):
    with pytest.raises(ValueError, match="target=, drafts="):
        cls(engine_kwargs={"target": "x"})
    with pytest.raises(ValueError, match="either"):
        cls(engine=ScriptedEngine(["ok"]), target="org/m")
    with pytest.raises(ValueError, match="frobnicate"):
        cls(frobnicate=1)
    with pytest.raises(ValueError, match="max_tokens"):
        cls(max_tokens=0)


def test_one_engine_per_setting_for_every_instance_of_either_framework(monkeypatch):
    built = []

    def from_pretrained(cls, target=None, drafts=None, router="thompson", device=None):
        built.append((target, drafts, router, device))
        return ScriptedEngine(["ok"], model_name=target)

    monkeypatch.setattr(SpecEngine, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(engines, "_engines", {})
    models = [LlamaIndexLLM(target="org/m"), LlamaIndexLLM(target="org/m"), ChatFlashSpec(model="org/m"),
              FlashSpecLLM(target="org/m"), LlamaIndexLLM(target="org/m", router="ucb1")]
    for model in models:
        _invoke(model)
    assert built == [("org/m", None, "thompson", None), ("org/m", None, "ucb1", None)]
    assert len({id(m.get_engine()) for m in models[:4]}) == 1
    assert {m.model_name for m in models} == {"org/m"}


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("name, field, call, bad", [("repetition_penalty", 1.3, 1.1, 0.0),
                                                    ("no_repeat_ngram_size", 3, 2, -1), ("top_p", 0.5, 0.7, 1.5)])
def test_sampling_fields_and_call_keywords_reach_the_engine(cls, name, field, call, bad):
    engine = ScriptedEngine(["ok"])
    model = cls(engine=engine, **{name: field})
    _invoke(model)
    _invoke(model, **{name: call})
    assert [getattr(c["sampling"], name) for c in engine.calls] == [field, call]
    with pytest.raises(ValueError, match=name):
        _invoke(model, **{name: bad})


@pytest.mark.parametrize("cls", CLASSES)
def test_max_tokens_by_either_name_at_call_time(cls):
    engine = ScriptedEngine(["ok"])
    model = cls(engine=engine)
    _invoke(model, max_tokens=7)
    _invoke(model, max_new_tokens=9)
    assert [c["max_new_tokens"] for c in engine.calls] == [7, 9]
    with pytest.raises(ValueError, match="max_new_tokens"):
        _invoke(model, max_new_tokens=0)
