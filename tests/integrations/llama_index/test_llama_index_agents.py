"""FunctionAgent and ReActAgent on FlashSpecLLM: a real tool is called, the run finishes, and
every LLM step is filed under its own domain.

The scripted-engine runs check the adapter's side of the agent loop deterministically. The
default-model runs make the tool call obvious by design (the 135M model does not pick tools on
its own): the FunctionAgent's first step is forced with `initial_tool_choice`; the ReAct user
message spells out the action lines, and its tool returns directly, because after an observation
the small model repeats the action with the observation substituted instead of answering
(`Action Input: {"a": 42, "b": 7}`), which no prompt wording we tried fixed.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from fakes import ScriptedEngine
from helpers import from_the_question
from llama_index.core import Settings
from llama_index.core.agent.react.formatter import ReActChatFormatter
from llama_index.core.agent.workflow import FunctionAgent, ReActAgent
from llama_index.core.tools import FunctionTool

from flashspec_integrations.llama_index import FlashSpecLLM, record_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
# A ReAct header short enough for a 135M model to keep the format in view.
COMPACT_REACT_HEADER = """You answer questions with tools. Tools:
{tool_desc}

To use a tool, write:
Thought: <why>
Action: <one of {tool_names}>
Action Input: <JSON arguments>
You then get:
Observation: <tool result>
When you know the answer, write:
Thought: I can answer.
Answer: <answer>
"""
REACT_REQUEST = """What is 6 times 7? Answer in this format:
Thought: I need to use a tool.
Action: multiply
Action Input: {"a": 6, "b": 7}"""


def _multiply_tool(calls: list, return_direct: bool = False) -> FunctionTool:
    def multiply(a: int, b: int) -> int:
        """Multiply two integers a and b and return the product."""
        calls.append((a, b))
        return a * b

    return FunctionTool.from_defaults(multiply, return_direct=return_direct)


def _run(agent, message: str, max_iterations: int = 4):
    async def go():
        with record_steps() as recorder:
            result = await agent.run(user_msg=message, max_iterations=max_iterations)
        return str(result), recorder.steps

    return asyncio.run(go())


@pytest.mark.parametrize("streaming", [True, False])
def test_function_agent_loop_with_a_scripted_model(streaming):
    calls: list = []
    engine = ScriptedEngine([
        'Let me compute.<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>',
        "6 times 7 is 42.",
    ])
    agent = FunctionAgent(tools=[_multiply_tool(calls)], llm=FlashSpecLLM(engine=engine), streaming=streaming)
    answer, steps = _run(agent, "What is 6 times 7?")
    assert calls == [(6, 7)] and answer == "6 times 7 is 42."
    assert [(s.domain, s.tool_calls) for s in steps] == [("tool", ["multiply"]), ("tool/result", [])]
    assert "<tool_response>\n42\n</tool_response>" in engine.calls[1]["prompt"]
    assert '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>' in engine.calls[1]["prompt"]


def test_react_agent_loop_with_a_scripted_model():
    calls: list = []
    engine = ScriptedEngine([
        ' I need a tool.\nAction: multiply\nAction Input: {"a": 6, "b": 7}\nObservation: 41',
        " I can answer.\nAnswer: 42",
    ])
    agent = ReActAgent(tools=[_multiply_tool(calls)], llm=FlashSpecLLM(engine=engine))
    answer, steps = _run(agent, "What is 6 times 7?")
    assert calls == [(6, 7)] and answer == "42"
    assert [s.domain for s in steps] == ["react", "react"]
    assert "Observation: 42" in engine.calls[1]["prompt"] and "41" not in engine.calls[1]["prompt"]


@pytest.mark.slow
def test_function_agent_calls_the_tool_and_finishes_on_the_default_model(default_engine):
    calls: list = []
    agent = FunctionAgent(
        tools=[_multiply_tool(calls)],
        llm=FlashSpecLLM(max_tokens=32),  # the forced call, bare JSON under its schema, is 25 tokens
        system_prompt="You are a calculator. Use the multiply tool, then state the result.",
        initial_tool_choice="multiply",
    )
    answer, steps = _run(agent, "What is 6 times 7?")
    assert calls == [(6, 7)]
    assert "42" in answer
    assert steps[0].domain == "json" and steps[0].tool_calls == ["multiply"]
    assert steps[-1].domain == "tool/result" and not steps[-1].tool_calls
    assert all(s.arms for s in steps)


@pytest.mark.slow
def test_react_agent_calls_the_tool_and_finishes_on_the_default_model(default_engine):
    calls: list = []
    agent = ReActAgent(
        tools=[_multiply_tool(calls, return_direct=True)],
        llm=FlashSpecLLM(max_tokens=32),
        formatter=ReActChatFormatter.from_defaults(system_header=COMPACT_REACT_HEADER),
    )
    answer, steps = _run(agent, REACT_REQUEST)
    assert calls == [(6, 7)] and answer == "42"
    assert [s.domain for s in steps] == ["react"]
    assert steps[0].text.startswith("Thought:") and "Action: multiply" in steps[0].text


@pytest.mark.slow
def test_rag_agent_example_on_the_default_model(capsys, default_engine):
    saved = (Settings._llm, Settings._embed_model)
    sys.path.insert(0, str(EXAMPLES))
    try:
        import llama_index_rag_agent as example

        answer, called = example.main([])
    finally:
        sys.path.remove(str(EXAMPLES))
        Settings._llm, Settings._embed_model = saved
    out = capsys.readouterr().out
    # Its own question, its main path: one search whose query the model wrote from the question's
    # words, and the answer the search synthesised from the right document.
    (name, args), = called
    assert name == "search_docs" and from_the_question(args["question"], example.QUESTION)
    assert "95 minutes" in answer and f"answer: {answer.strip()}" in out
    assert "domain=json" in out and "domain=rag" in out and "draft=" in out

