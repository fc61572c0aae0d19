"""The public imports (each framework's classes from its subpackage, as langchain-ollama does) and
the shared modules' independence from both frameworks."""
from __future__ import annotations

import subprocess
import sys

import flashspec_integrations.langchain as lc
import flashspec_integrations.llama_index as li


def test_all_lists_the_public_classes():
    assert sorted(lc.__all__) == ["ChatFlashSpec", "FlashSpecLLM", "HashingEmbeddings"]
    assert sorted(li.__all__) == ["FlashSpecLLM", "HashingEmbedding", "LLMStep", "record_steps"]
    for module in (lc, li):
        assert all(hasattr(module, name) for name in module.__all__)


def test_the_shared_modules_import_neither_framework():
    shared = ["domain_rules", "settings", "engines", "calls", "prompts", "tool_calls", "async_bridge", "hashing"]
    code = (f"import sys, importlib\nfor m in {shared!r}: importlib.import_module('flashspec_integrations.' + m)\n"
            "print(sorted(k for k in sys.modules "
            "if k.split('.')[0] in ('langchain', 'langchain_core', 'llama_index')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
