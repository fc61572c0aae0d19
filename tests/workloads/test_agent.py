"""The agent workload: real long contexts with answerable questions, valid tool calls, prefixes
that loops really share, a tune/held-out split that never leaks, and the same stream per seed.

Speed figures on this stream are only as good as these properties: a question whose answer is
not in the context, a loop whose steps do not extend each other or a held-out step that was
tuned on would each flatter or hide what the engine does on real agent traffic.
"""
from __future__ import annotations

import json
import random
from collections import Counter

import jsonschema
import pytest
from helpers import needs_sharegpt

from flashspec_workloads import agent, passages, rag, tools
from flashspec_workloads.agent import agent_workload
from flashspec_workloads.common import DEFAULT_MAX_NEW_TOKENS, DOMAINS

pytestmark = needs_sharegpt
N = 64


@pytest.fixture(scope="module")
def streams() -> dict[tuple[str, str], list]:
    return {(kind, split): agent_workload(kind, N, seed=0, split=split)
            for kind in agent.KINDS for split in ("tune", "heldout")}


def _episode(step) -> str:
    """The source without its step index: steps of one loop episode share it."""
    return step.source.rsplit("/", 1)[0]


def _origin(step) -> str:
    """The conversation stem, passage stem or tool episode behind a step."""
    name = _episode(step).split(":", 1)[1]
    return name.split("#")[0].rsplit("_", 1)[0] if not step.source.startswith("tool:") else name


def test_same_arguments_same_stream_and_seed_matters(streams) -> None:
    for (kind, split), steps in streams.items():
        assert len(steps) == N
        assert steps == agent_workload(kind, N, seed=0, split=split)
        assert [s.source for s in steps] != [s.source for s in agent_workload(kind, N, seed=1, split=split)]


def test_every_domain_appears_in_fair_shares(streams) -> None:
    for steps in streams.values():
        counts = Counter(s.domain for s in steps)
        assert set(counts) == set(DOMAINS)
        assert min(counts.values()) >= N // 8
        assert all(s.max_new_tokens == DEFAULT_MAX_NEW_TOKENS[s.domain] for s in steps)
    assert {s.max_new_tokens for s in agent_workload("loop", 12, max_new_tokens=7)} == {7}


def test_tune_and_heldout_share_no_source(streams) -> None:
    for kind in agent.KINDS:
        tune = {_origin(s) for s in streams[(kind, "tune")]}
        heldout = {_origin(s) for s in streams[(kind, "heldout")]}
        assert tune and heldout and not tune & heldout
    for split in ("tune", "heldout"):
        assert {passages.holdout_of(p.id) for p in passages.passages(split)} == {split}


def test_loop_steps_extend_the_step_before(streams) -> None:
    for split in ("tune", "heldout"):
        steps = streams[("loop", split)]
        lengths = Counter(_episode(s) for s in steps)
        assert max(lengths.values()) >= 3 and sum(v >= 2 for v in lengths.values()) >= len(lengths) // 2
        for before, after in zip(steps, steps[1:]):
            if _episode(before) == _episode(after):
                assert after.messages[: len(before.messages)] == before.messages
                assert len(after.messages) > len(before.messages)


def test_independent_steps_share_no_request(streams) -> None:
    """Tool episodes (8 a side) come back once all are used; nothing else repeats in 64 steps."""
    for split in ("tune", "heldout"):
        steps = streams[("independent", split)]
        assert all(a.domain != b.domain for a, b in zip(steps, steps[1:]))
        users = [next(m["content"] for m in s.messages if m["role"] == "user")
                 for s in steps if s.domain != "tool"]
        assert len(set(users)) == len(users)
        episodes = [_episode(s) for s in steps if s.domain == "tool"]
        n = len(tools.episodes(split))
        assert len(set(episodes[:n])) == n


def test_rag_contexts_are_long_and_hold_each_answer_once(streams) -> None:
    rag_steps = [s for steps in streams.values() for s in steps if s.domain == "rag"]
    assert len(rag_steps) >= 30
    for step in rag_steps:
        first_user = next(m["content"] for m in step.messages if m["role"] == "user")
        assert len(first_user) >= passages.MIN_CONTEXT_CHARS
    pool = passages.passages("tune")
    for p in pool[:20]:
        chunks, questions = rag.questions_over(p, pool, 3, random.Random(0))
        joined = "\n\n".join(c.text for c in chunks)
        for q in questions:
            assert joined.count(q.answer_quote) == 1
            assert q.answer_quote in next(c.text for c in chunks if c.id == q.passage_id)


def test_tool_schemas_are_valid_and_every_call_matches_its_schema() -> None:
    data = tools.tool_data()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in data["tools"]}
    assert len(schemas) == len(data["tools"]) >= 15
    for tool in data["tools"]:
        assert tool["type"] == "function" and tool["function"]["description"]
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    nested = [s for s in schemas.values()
              if any(p.get("type") in ("object", "array") for p in s["properties"].values())]
    assert len(nested) >= 8
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for episode in data["episodes"]:
        for call in episode["calls"]:
            jsonschema.validate(call["arguments"], schemas[call["name"]], format_checker=checker)
    assert Counter(e["split"] for e in data["episodes"]) == {"tune": 8, "heldout": 8}


def test_tool_steps_list_their_tools_and_replay_the_calls(streams) -> None:
    data = tools.tool_data()
    by_name = {t["function"]["name"]: t for t in data["tools"]}
    episodes = {e["id"]: e for e in data["episodes"]}
    steps = [s for steps in streams.values() for s in steps if s.domain == "tool"]
    assert {s.source.rsplit(":", 1)[1] for s in steps} == set(tools.FORMATS)
    for step in steps:
        episode = episodes[_episode(step).split(":", 1)[1]]
        system = step.messages[0]["content"]
        k = int(step.source.rsplit("/call", 1)[1].split(":")[0])
        assert len(step.messages) == 2 + 2 * k
        for call, (said, result) in zip(episode["calls"], zip(step.messages[2::2], step.messages[3::2])):
            assert json.dumps(by_name[call["name"]], ensure_ascii=False) in system
            body = json.loads(said["content"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
            assert body["name"] == call["name"] and result["role"] == "tool"
            json.loads(result["content"])
        if tools.needs_passage(episode) and k == 2:
            assert len(step.messages[-1]["content"]) >= passages.MIN_CONTEXT_CHARS


@pytest.mark.parametrize("kwargs, name", [
    ({"kind": "chain"}, "kind"), ({"n_steps": 0}, "n_steps"), ({"n_steps": 2.5}, "n_steps"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"split": "dev"}, "split"),
])
def test_bad_arguments_are_named(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        agent_workload(**kwargs)


@pytest.mark.slow
def test_rag_contexts_are_over_a_thousand_tokens(default_target) -> None:
    from flashspec_core.prompts import render_messages

    tok = default_target.tokenizer
    for split in ("tune", "heldout"):
        for step in agent_workload("independent", 48, seed=0, split=split):
            if step.domain == "rag":
                assert len(tok(render_messages(tok, step.messages)).input_ids) >= 1000
