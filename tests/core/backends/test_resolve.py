"""Which backend "auto" picks, and what a wrong choice says."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import tiny_loaded

from flashspec_core.backends import resolve_backend


def test_auto_on_the_cpu_is_transformers_even_for_a_gguf_target():
    # llama.cpp stays opt-in on the CPU (resolve_backend's docstring says why).
    target = dataclasses.replace(tiny_loaded(), gguf=Path("model.gguf"))
    assert resolve_backend("auto", target) == "hf"
    assert resolve_backend("llama.cpp", target) == "llama.cpp"


def test_wrong_choices_name_the_argument_and_the_fix():
    target = tiny_loaded()
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("vllm", target)
    with pytest.raises(ValueError, match="needs a GGUF target"):
        resolve_backend("llama.cpp", target)
    with pytest.raises(ValueError, match="use backend='hf'"):
        resolve_backend("cuda-graph", target)
