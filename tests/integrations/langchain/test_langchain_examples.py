"""The LangChain examples run, and an agent's tool-call and answer steps reach the router under
different domains.

Fast tests drive the examples with a scripted engine (a model that says exactly what the test
needs) and record the label the engine resolves for each call; slow tests run them on the real
default model and record the domains the router itself receives, per decode step.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fakes import ScriptedEngine
from helpers import from_the_question

from flashspec_core import SpecEngine
from flashspec_core.routing.base import Router
from flashspec_integrations.langchain import ChatFlashSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import langchain_agent
import langchain_rag_chain


class RecordingRouter(Router):
    """Wraps an engine's router and records the domain of every `select` (one per decode step)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.arms = inner.arms
        self.domains: list[str] = []

    def select(self, domain: str, unavailable: frozenset[str] = frozenset()):
        self.domains.append(domain)
        return self.inner.select(domain, unavailable)

    def update(self, record) -> None:
        self.inner.update(record)


def agent_script(prompt: str) -> str:
    """The example forces a call of one of its two tools first (the grammar writes a tagged call),
    then an answer."""
    if "<tool_response>" in prompt:
        return "17 times 23 is 391."
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'



def test_agent_example_calls_a_real_tool_and_switches_domain(capsys):
    engine = ScriptedEngine(agent_script)
    steps = langchain_agent.main(["What is 17 * 23?"], llm=ChatFlashSpec(engine=engine))
    out = capsys.readouterr().out
    assert "tool calculator -> 391" in out  # the tool really ran on the model's arguments
    assert [c["label"] for c in engine.calls] == ["json", "tool/result"]
    assert [s["domain"] for s in steps] == ["json", "tool/result"] and steps[0]["tool_calls"] == ["calculator"]
    assert "domain=json" in out and "domain=tool/result" in out and "draft=" in out
    assert {s["node"] for s in steps} == {"helper"}


def test_word_count_and_calculator_tools_are_real():
    assert langchain_agent.word_count.invoke({"text": "the cat sat on the mat"}) == 6
    assert langchain_agent.calculator.invoke({"expression": "2 ** 10 - 24"}) == "1000"
    assert langchain_agent.calculator.invoke({"expression": "__import__('os')"}).startswith("error")


def test_hashing_embedding_really_ranks():
    retriever = langchain_rag_chain.build_retriever(k=1)
    assert retriever.invoke("descale with vinegar")[0].metadata["source"] == "kettle-care.md"
    assert retriever.invoke("bagel mode toaster")[0].metadata["source"] == "toaster.md"
    assert retriever.invoke("free delivery shipping")[0].metadata["source"] == "shipping.md"


def test_rag_example_reaches_rag_then_chat(capsys):
    engine = ScriptedEngine(["It takes 3 minutes."])
    steps = langchain_rag_chain.main([], llm=ChatFlashSpec(engine=engine))
    out = capsys.readouterr().out
    assert [s["domain"] for s in steps] == ["rag", "rag", "chat"]
    assert "[kettle.md]" in engine.calls[0]["prompt"] and "retrieved: ['kettle.md'" in out
    assert out.count("draft=") == 3


@pytest.fixture
def recording_default_engine():
    engine = SpecEngine.from_default()
    inner = engine.router
    engine.router = RecordingRouter(inner)
    try:
        yield engine
    finally:
        engine.router = inner


@pytest.mark.slow
def test_default_model_agent_run_reaches_the_router_under_two_domains(recording_default_engine, capsys):
    """One agent run on the real model: the forced tool-call step and the answer step decode under
    different router domains (what the router saw is recorded per decode step)."""
    router = recording_default_engine.router
    steps = langchain_agent.main(["What is 17 * 23?"])  # the default 40 tokens: the tagged call takes ~35
    out = capsys.readouterr().out
    # Greedy decoding is exact, so the model's output (a valid call here) does not depend on the
    # drafts the router picks: the run is deterministic.
    assert steps[0]["tool_calls"] == ["calculator"] and "tool calculator -> 391" in out
    assert [s["domain"] for s in steps] == ["json", "tool/result"]
    first_answer_step = router.domains.index("tool/result")
    assert set(router.domains[:first_answer_step]) == {"json"}
    assert set(router.domains[first_answer_step:]) == {"tool/result"}


@pytest.mark.slow
def test_default_model_agent_example_answers_its_own_questions(capsys):
    """The example's main path on the default model: each question gets the right tool, called with
    arguments written from the question, and a non-empty answer built on the tool's result."""
    steps = langchain_agent.main([])
    answers = [line.split("A: ", 1)[1] for line in capsys.readouterr().out.splitlines() if "  A: " in line]
    calls = [(name, args) for s in steps for name, args in zip(s["tool_calls"], s["tool_args"])]
    assert [name for name, _ in calls] == ["calculator", "word_count"]
    for (name, args), question in zip(calls, langchain_agent.QUESTIONS):
        (argument,) = args.values()
        assert argument in question and from_the_question(argument, question), (name, args)
    assert len(answers) == 2 and all(answers) and "391" in answers[0] and "6" in answers[1], answers


@pytest.mark.slow
def test_default_model_rag_example_runs(recording_default_engine, capsys):
    steps = langchain_rag_chain.main(["--max-tokens", "16", langchain_rag_chain.QUESTIONS[0]])
    assert [s["domain"] for s in steps] == ["rag", "chat"]
    assert set(recording_default_engine.router.domains) == {"rag", "chat"}
    assert all(s["draft"] for s in steps)


def test_agent_example_lets_a_tool_calling_target_choose(capsys):
    """--auto-tools drops the forcing middleware: the model (scripted here as a larger target that
    calls tools) decides: nothing is forced, and calls are decoded under the tools' structural tag."""
    def chooses(prompt: str) -> str:
        if "<tool_response>" in prompt:
            return "It is 391."
        return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'

    engine = ScriptedEngine(chooses)
    steps = langchain_agent.main(["--auto-tools", "What is 17 * 23?"], llm=ChatFlashSpec(engine=engine))
    assert "tool calculator -> 391" in capsys.readouterr().out
    assert [s["domain"] for s in steps] == ["tool", "tool/result"]
    assert all(c["json_schema"]["type"] == "structural_tag" for c in engine.calls)
