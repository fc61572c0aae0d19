"""Requests that arrive together share engine batches; each keeps the output it would have alone."""
from __future__ import annotations

import pytest
from helpers import tiny_loaded

from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams
from flashspec_integrations.context import DomainDecision
from flashspec_integrations.serve.batching import decode_batch, group
from flashspec_integrations.serve.translate import Plan

GREEDY = SamplingParams()


def plan(ids, max_new=6, sampling=GREEDY, domain="chat") -> Plan:
    return Plan(list(ids), max_new, sampling, (), domain, DomainDecision(None, None, "classifier"), None, (), False)


@pytest.fixture
def engine(torch_one_thread):
    return SpecEngine(tiny_loaded(16, seed=0), [PromptLookupDraft()])


def test_grouping_follows_the_engines_one_setting_per_batch():
    plans = [plan([1, 2]), plan([3]), plan([4], max_new=3), plan([5], domain="code"),
             plan([6], sampling=SamplingParams(seed=1)), plan([7], sampling=SamplingParams(seed=1)), plan([8, 9])]
    assert group(plans) == [[0, 1, 6], [2], [3], [4], [5]]  # seeded requests run alone


def test_a_batch_is_one_engine_call_and_each_row_gets_its_solo_greedy_output(engine, monkeypatch):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    solo = [engine.generate(p, max_new_tokens=6).token_ids for p in prompts]
    calls = []
    real = engine.generate
    monkeypatch.setattr(engine, "generate", lambda prompt, **kw: calls.append(len(prompt)) or real(prompt, **kw))
    out = decode_batch(engine, [plan(p) for p in prompts])
    assert calls == [3]
    assert [d.result.token_ids for d in out] == solo and all(d.rows == 3 for d in out)


def test_a_failing_group_fails_only_its_own_requests(engine):
    out = decode_batch(engine, [plan([1, 2]), plan([3], max_new=10_000), plan([4, 5])])
    assert isinstance(out[1], ValueError) and "max_new_tokens" in str(out[1])
    assert out[0].rows == out[2].rows == 2 and out[0].result.token_ids
