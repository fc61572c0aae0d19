"""LangChain's standard chat-model suites (langchain-tests), subclassed without overriding a test.

The unit suite builds models without loading anything (construction is lazy). The integration
suite runs against the real default model (SmolLM2-135M-Instruct) on CPU with max_tokens=32, which
a forced call's JSON (decoded under its schema by the engine) fits. Tests whose assertion needs
more of a 135M model than that are marked xfail (not strict) by the `_known_model_limits`
fixture, each with the reason observed.
"""
from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from flashspec_integrations.langchain import ChatFlashSpec

DEGENERATES = (
    "the 135M default model's greedy free-text argument degenerates into repetition ('The cat is a cat, "
    "but it's not a cat, it's a cat cat cat ...') and runs past max_tokens (seen at 32 and 96); the call "
    "is cut, and the adapter reports it in invalid_tool_calls instead of inventing its end"
)
JSON_MODE_KEYS = (
    "JSON mode guarantees a JSON object, not its keys; the 135M model adds a 'type' key that the test's "
    "exact key-set assertion rejects (with a schema, keys are constrained: see test_tool_choice)"
)
AUTO_TOOL_CHOICE = (
    "tool_choice is 'auto' here, so nothing forces a call: the 135M model answers in prose instead of "
    "calling get_weather (forced calls are schema-constrained and pass: test_tool_calling, test_tool_choice)"
)
KNOWN_LIMITS = {
    "test_bind_runnables_as_tools": DEGENERATES,
    "test_unicode_tool_call_integration": DEGENERATES,
    "test_structured_output": DEGENERATES,
    "test_structured_output_async": DEGENERATES,
    "test_structured_output_pydantic_2_v1": DEGENERATES,
    "test_structured_output_optional_param": DEGENERATES,
    "test_json_mode": JSON_MODE_KEYS,
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
        return {"max_tokens": 32}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @pytest.fixture(autouse=True)
    def _known_model_limits(self, request: pytest.FixtureRequest) -> None:
        reason = KNOWN_LIMITS.get(request.node.originalname)
        if reason:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=False))
