"""The test doubles stay honest: the scripted engine keeps the real engine's signature."""
from __future__ import annotations

import inspect

import pytest
from fakes import ScriptedEngine, byte_tokenizer

from flashspec_core import SpecEngine


@pytest.mark.parametrize("method", ["submit", "stream", "generate"])
def test_scripted_engine_keeps_the_real_engine_signature(method):
    """The adapters are tested against the double; it must not drift from the engine it stands for."""
    real = list(inspect.signature(getattr(SpecEngine, method)).parameters)[1:]
    fake = list(inspect.signature(getattr(ScriptedEngine, method)).parameters)[1:]
    assert fake == real


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = 'é <tool_call>\n{"a": 1}\n</tool_call> 名字'
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
