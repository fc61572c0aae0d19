"""LangChain's standard chat-model suites (langchain-tests), subclassed without overriding a test.

The unit suite builds models without loading anything (construction is lazy). The integration
suite runs against the real default model (SmolLM2-135M-Instruct) on CPU, greedy, with
max_tokens=128 and the n-gram ban (no_repeat_ngram_size=3), which forced calls' JSON (decoded
under its schema by the engine) fits. Tests whose assertion needs more of a 135M model than that
are marked xfail (not strict) by the `_known_model_limits` fixture, each with the reason observed.
"""
from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from flashspec_integrations.langchain import ChatFlashSpec

AUTO_TOOL_CHOICE = (
    "tool_choice is 'auto' here, so nothing forces a call and the 135M model answers in prose; it makes 0 "
    "unforced calls on 50 tool requests with three prompt formats (benchmarks/auto_tool_calls.py, "
    "docs/constrained.md). Forced calls are schema-constrained and pass: test_tool_calling, test_tool_choice"
)
KNOWN_LIMITS = {
    "test_agent_loop": AUTO_TOOL_CHOICE,
}


class TestChatFlashSpecUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatFlashSpec]:
        return ChatFlashSpec


@pytest.mark.slow
class TestChatFlashSpecIntegration(ChatModelIntegrationTests):
    # The suite's async tests are plain `async def`s written for pytest-asyncio's auto mode; the
    # mark runs them in strict mode too (on the sync tests it is a no-op, whose warning is muted).
    pytestmark = [
        pytest.mark.asyncio,
        pytest.mark.filterwarnings("ignore:The test <Function .* is marked with '@pytest.mark.asyncio'"),
    ]

    @property
    def chat_model_class(self) -> type[ChatFlashSpec]:
        return ChatFlashSpec

    @property
    def chat_model_params(self) -> dict:
        # Greedy 135M output loops inside JSON strings ("a cat is a cat, a cat is a cat, ...");
        # the n-gram ban over the output (ngram_ban.py) ends the loops without forbidding copies
        # from the prompt, which tool arguments need. The model still rambles: its longest forced
        # call here (the pydantic v1 Joke) closes after 90-odd tokens.
        return {"max_tokens": 128, "no_repeat_ngram_size": 3}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @pytest.fixture(autouse=True)
    def _known_model_limits(self, request: pytest.FixtureRequest) -> None:
        reason = KNOWN_LIMITS.get(request.node.originalname)
        if reason:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=False))
