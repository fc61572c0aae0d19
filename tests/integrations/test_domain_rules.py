"""flashspec_integrations.domain_rules: the framework-neutral rules that pick a call's router domain."""
from __future__ import annotations

import time

import pytest

from flashspec_integrations.domain_rules import (
    DomainDecision,
    StepContext,
    agent_node,
    decide_domain,
    is_rag_prompt,
    is_react_prompt,
    normalize_role,
)

LC_RAG = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question.\nQuestion: what is x?\nContext: x is 3.\nAnswer:"
)
LI_TEXT_QA = (
    "Context information is below.\n---------------------\nfile_path: a.txt\nx is 3\n---------------------\n"
    "Given the context information and not prior knowledge, answer the query.\nQuery: what is x?\nAnswer: "
)
REACT = "Thought: I need a tool.\nAction: add\nAction Input: {\"a\": 1}\nObservation: 2\n"


def test_explicit_beats_metadata_tags_and_context():
    ctx = StepContext(
        explicit_domain=" Code ", metadata={"flashspec_domain": "rag"}, tags=["flashspec_domain:math"],
        tools_bound=True, tool_choice_forced=True,
    )
    assert decide_domain(ctx) == DomainDecision("code", None, "explicit", None)


def test_metadata_then_tag_win_over_context():
    assert decide_domain(StepContext(metadata={"flashspec_domain": "Rag"}, tools_bound=True)).domain == "rag"
    d = decide_domain(StepContext(tags=["x", "flashspec_domain:math"], tools_bound=True))
    assert (d.domain, d.source) == ("math", "tag")


@pytest.mark.parametrize(
    "ctx, hint, source",
    [
        (StepContext(tools_bound=True, tool_choice_forced=True), "json", "forced_tool"),
        (StepContext(structured_output=True, roles=["user"]), "json", "structured_output"),
        (StepContext(tools_bound=True, roles=["system", "human"]), "tool", "tools"),
        (StepContext(tools_bound=True, roles=["human", "ai", "tool"]), "tool/result", "tool_result"),
        (StepContext(roles=["human", "ai", "tool", "ai", "human"]), "tool", "tools"),
        (StepContext(roles=["user"], prompt_text=REACT), "react", "react"),
        (StepContext(roles=["user"], prompt_text=LC_RAG), "rag", "rag"),
        (StepContext(prompt_text=LI_TEXT_QA), "rag", "rag"),
        (StepContext(roles=["user"], prompt_text="Tell me a joke about cats."), None, "classifier"),
    ],
)
def test_context_rules(ctx, hint, source):
    decision = decide_domain(ctx)
    assert (decision.domain, decision.hint, decision.source) == (None, hint, source)


def test_node_is_recorded_and_only_split_on_request():
    meta = {"langgraph_node": "model", "lc_agent_name": "Weather"}
    assert agent_node(meta) == "Weather"
    assert agent_node({"langgraph_node": "model"}) == "model"
    ctx = StepContext(metadata=meta, tools_bound=True)
    assert decide_domain(ctx) == DomainDecision(None, "tool", "tools", "Weather")
    assert decide_domain(ctx, domain_per_node=True).hint == "tool/weather"
    # No kind, no split: the classifier still decides.
    assert decide_domain(StepContext(metadata=meta), domain_per_node=True).hint is None


def test_prompt_checks_do_not_fire_on_plain_prose():
    assert not is_rag_prompt("What is the capital of France? Give some context about its history.")
    assert is_rag_prompt("Context: the sky is green.\n\nQuestion: what colour is the sky?")
    assert not is_react_prompt("Thought: hmm. That is all.")
    assert is_react_prompt(REACT)
    assert ([normalize_role(r) for r in ["Human", "AI", "function", "developer"]]
            == ["user", "assistant", "tool", "system"])


@pytest.mark.parametrize("bad", ["", "  ", 3])
def test_bad_labels_name_their_source(bad):
    with pytest.raises(ValueError, match="domain"):
        decide_domain(StepContext(explicit_domain=bad))
    with pytest.raises(ValueError, match="flashspec_domain"):
        decide_domain(StepContext(metadata={"flashspec_domain": bad}))
    with pytest.raises(ValueError, match="ctx"):
        decide_domain({"tools_bound": True})


def test_headings_count_only_at_the_start_of_a_line():
    assert is_rag_prompt("intro\n  \tCONTEXT :\nx is 3\n\n   Query: what is x?")
    assert not is_rag_prompt("See the context: x is 3. Question: what is x?")  # mid-line: prose
    assert not is_rag_prompt("Context: x is 3. The question: what is x?")
    assert is_react_prompt("  thought: a\naction input: {}\nObservation : 2")
    assert not is_react_prompt("Thought: a Action: b Observation: c")  # one line: one label


@pytest.mark.parametrize("filler, limit", [
    ("\n", 2.0), (" ", 2.0), ("\r\n", 2.0), ("\n \t", 2.0),
    ("context ", 10.0), ("x context:", 10.0),  # a candidate label every few characters: slower, still linear
])
def test_classifying_a_2_mb_message_takes_linear_time(filler, limit):
    """The prompt checks once went quadratic on runs of newlines (20,000 of them: 22 s; 2 MB of them
    would take hours). 2 MB of whitespace must be classified in under 2 s, 2 MB dense with label
    words in under 10 s, best of three: bounds 30x to 100x what a 2-core machine takes, so one
    busy with other work does not fail it, and still minutes below quadratic time."""
    text = filler * (2_000_000 // len(filler))
    ctx = StepContext(roles=["user"], prompt_text=text + "\nQuestion: what now?")
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        decide_domain(ctx)
        best = min(best, time.perf_counter() - start)
    assert best < limit, f"{best * 1000:.0f} ms for 2 MB of {filler!r}"
