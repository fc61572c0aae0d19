"""The dev workload: domain runs, the dev split only, valid hand-written tools and documents.

Benchmarks and the demo trust this stream, so a leaking split or a broken tool schema would
corrupt every number downstream.
"""
from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from helpers import needs_sharegpt

from flashspec_workloads import dev as workload
from flashspec_workloads.dev import DOMAINS, Step, agent_prompts, demo_workload, dev_workload, rag_step
from flashspec_workloads.sharegpt import split_of


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="n_steps"):
        dev_workload(0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dev_workload(8, max_new_tokens=0)


def _runs(steps: list[Step]) -> list[tuple[str, int]]:
    return [(d, len(list(g))) for d, g in itertools.groupby(s.domain for s in steps)]


@needs_sharegpt
@pytest.mark.parametrize("n_steps, seed", [(24, 0), (24, 1), (8, 3), (13, 5), (40, 2)])
def test_dev_workload_mixes_all_domains_in_runs(n_steps: int, seed: int) -> None:
    steps = dev_workload(n_steps, seed)
    assert len(steps) == n_steps
    assert steps == dev_workload(n_steps, seed)
    runs = _runs(steps)
    assert {d for d, _ in runs} == set(DOMAINS)
    assert all(2 <= length <= 4 for _, length in runs)
    for step in steps:
        assert step.messages and all(set(m) == {"role", "content"} for m in step.messages)
        assert step.messages[-1]["role"] in ("user", "tool")
        assert step.max_new_tokens == workload.DEFAULT_MAX_NEW_TOKENS[step.domain]
    sharegpt = [s.source for s in steps if s.source.startswith("sharegpt:")]
    assert len(sharegpt) == len(set(sharegpt))


@needs_sharegpt
def test_dev_workload_uses_only_dev_split_and_seed_matters() -> None:
    steps = dev_workload(24, 0)
    ids = [s.source.split(":", 1)[1] for s in steps if s.source.startswith("sharegpt:")]
    assert ids and all(split_of(i) == "dev" for i in ids)
    assert [s.source for s in steps] != [s.source for s in dev_workload(24, 1)]


@needs_sharegpt
def test_demo_workload_is_short_and_fixed() -> None:
    steps = demo_workload()
    assert len(steps) == 8 and steps == demo_workload()
    assert {s.domain for s in steps} == set(DOMAINS)
    assert all(48 <= s.max_new_tokens <= 64 for s in steps)


def test_tool_schemas_are_valid_and_calls_match_them() -> None:
    data = agent_prompts()
    tools = {t["function"]["name"]: t for t in data["tools"]}
    assert len(tools) == len(data["tools"]) >= 20
    for tool in data["tools"]:
        assert tool["type"] == "function" and tool["function"]["description"]
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    assert len(data["tool_tasks"]) >= 20
    for task in data["tool_tasks"]:
        schema = tools[task["call"]["name"]]["function"]["parameters"]
        jsonschema.validate(task["call"]["arguments"], schema)
    assert len({t["call"]["name"] for t in data["tool_tasks"]}) >= 20


def _tool_entry(data: dict, name: str) -> dict:
    return next(t for t in data["tools"] if t["function"]["name"] == name)


def test_tool_steps_list_the_called_tool() -> None:
    data = agent_prompts()
    for seed in range(10):
        used: set[str] = set()
        steps = workload._tool_steps(workload.random.Random(seed), 4, None, used)
        system = steps[0].messages[0]["content"]
        assert all(s.messages[0]["content"] == system for s in steps)
        for step in steps:
            task = data["tool_tasks"][int(step.source.split(":")[1])]
            assert json.dumps(_tool_entry(data, task["call"]["name"]), ensure_ascii=False) in system
            if step.source.endswith(":answer"):
                assert json.loads(step.messages[2]["content"]) == task["call"]
                assert step.messages[3]["role"] == "tool"


def test_every_rag_question_has_its_document_in_the_prompt() -> None:
    docs = agent_prompts()["rag_documents"]
    assert len(docs) >= 10
    for d, doc in enumerate(docs):
        assert len(doc["text"].split("\n\n")) >= 2
        for q, question in enumerate(doc["questions"]):
            assert question["answer_quote"] in doc["text"]
            prompt = rag_step(d, q).messages[-1]["content"]
            assert doc["text"] in prompt and question["question"] in prompt


def test_run_structure_for_any_length() -> None:
    """Runs of 2–4, never the same domain twice in a row, all four domains once there is room."""
    for n_steps in range(2, 60):
        for seed in range(5):
            rng = workload.random.Random(seed)
            lengths = workload._run_lengths(n_steps, rng)
            order = workload.domain_order(len(lengths), rng)
            assert sum(lengths) == n_steps and all(2 <= x <= 4 for x in lengths)
            assert all(a != b for a, b in zip(order, order[1:]))
            if n_steps >= 8:
                assert set(order) == set(DOMAINS)
