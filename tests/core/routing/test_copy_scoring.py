"""CopyScorer: each free arm is scored along the path its own steps would have taken."""
from __future__ import annotations

import pytest

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.proposals import Proposal
from flashspec_core.records import StepRecord
from flashspec_core.routing.copy_scoring import CopyScorer

NONE = Arm(NO_DRAFT, 0)


class ScriptDraft:
    """Deterministic fake: proposes the script's continuation where `right(position)`, else a
    wrong token; records the context length of every call."""

    name = "ngram"
    deterministic = True

    def __init__(self, script, right=lambda n: True):
        self.script, self.right, self.calls = list(script), right, []

    def propose(self, contexts, gamma, sampling, generator=None):
        n = len(contexts[0])
        self.calls.append(n)
        return Proposal([self.script[n:n + gamma] if self.right(n) else [-1] * gamma])


def plain_request(scorer, script, prompt_len, new_tokens, arm=NONE, unavailable=frozenset()):
    """Plain decoding of `new_tokens` tokens of `script` after a prompt: one step per token, on
    the live list, as SpecEngine._decode extends it. Returns every CopyScore."""
    seq, out = list(script[:prompt_len]), []
    for _ in range(new_tokens):
        ctx = len(seq)
        seq.append(script[ctx])
        out += scorer.step(StepRecord(domain="rag", arm=arm, drafted=0, accepted=0, emitted=1, draft_seconds=0.0,
                                      verify_seconds=0.01, context_len=ctx, sequence=seq, unavailable=unavailable))
    return out


def test_a_long_copy_is_one_step_of_the_arm_not_one_per_position():
    """Always right at γ = 4 over 20 plain-decoded tokens: the arm itself would take 4 steps of 5
    tokens. Scored from every plain step's context it was 20 scorings of 5, counting each copied
    token five times over (the bias that made prompt lookup look 3x plain decoding on RAG)."""
    script = list(range(100, 200))
    draft = ScriptDraft(script)
    scores = plain_request(CopyScorer([NONE, Arm("ngram", 4)], {"ngram": draft}), script, 10, 20)
    assert [(s.emitted, s.proposed) for s in scores] == [(5, 4)] * 4
    assert draft.calls == [10, 15, 20, 25]  # its own steps' contexts, each asked once


def test_a_draft_the_row_could_not_use_is_not_scored_on_its_request():
    """A request without a grammar: the grammar-forced draft is never offered to it, so its
    after-the-fact scores there (plain steps under its name) would only dilute what it earns on the
    requests it serves. The other drafts are scored as before; the next request scores it again."""
    script = list(range(100, 200))
    ngram, grammar = ScriptDraft(script), ScriptDraft(script)
    grammar.name = "grammar"
    arms = [NONE, Arm("ngram", 4), Arm("grammar", 4)]
    scorer = CopyScorer(arms, {"ngram": ngram, "grammar": grammar})
    scores = plain_request(scorer, script, 10, 20, unavailable=frozenset({"grammar"}))
    assert {s.arm for s in scores} == {1} and grammar.calls == []
    scores = plain_request(scorer, script, 30, 20)  # a request with a grammar
    assert {s.arm for s in scores} == {1, 2} and grammar.calls


def test_a_miss_costs_the_arm_a_one_token_step_and_the_path_goes_on_from_there():
    script = list(range(100, 200))
    draft = ScriptDraft(script, right=lambda n: n % 7 != 0)  # wrong from contexts 14, 21, ...
    scores = plain_request(CopyScorer([NONE, Arm("ngram", 4)], {"ngram": draft}), script, 10, 20)
    # 10 -> 15 (5), 15 -> 20 (5), 20 -> 25 (5): contexts 14 and 21 are never a step's start.
    assert draft.calls[:3] == [10, 15, 20]
    starts, pos = [], 10
    for s in scores:
        starts.append(pos)
        pos += s.emitted
    assert starts == draft.calls[:len(scores)]
    assert sum(s.emitted for s in scores) <= 20 + 4  # the path never outruns what was verified by a step


def test_every_gamma_follows_its_own_path_and_shares_a_call_per_position():
    script = list(range(100, 200))
    draft = ScriptDraft(script)
    scorer = CopyScorer([NONE, Arm("ngram", 2), Arm("ngram", 4)], {"ngram": draft})
    scores = plain_request(scorer, script, 10, 12)
    by_arm = {}
    for s in scores:
        by_arm.setdefault(s.arm, []).append(s.emitted)
    assert by_arm == {1: [3, 3, 3, 3], 2: [5, 5]}
    assert len(draft.calls) == len(set(draft.calls))  # one call per position serves both γ
    # The union of both paths' starts (22 is where γ = 2 would go next: nothing verified there yet).
    assert set(draft.calls) == {10, 13, 15, 16, 19, 20}


def test_the_arm_that_ran_is_scored_by_its_own_step_and_goes_on_from_its_end():
    script = list(range(100, 200))
    draft = ScriptDraft(script)
    scorer = CopyScorer([NONE, Arm("ngram", 4)], {"ngram": draft})
    seq = script[:10]
    seq.extend(script[10:15])
    assert scorer.step(StepRecord(domain="rag", arm=Arm("ngram", 4), drafted=4, accepted=4, emitted=5,
                                  draft_seconds=0.001, verify_seconds=0.01, context_len=10, sequence=seq)) == []
    assert draft.calls == []
    seq.append(script[15])
    scorer.step(StepRecord(domain="rag", arm=NONE, drafted=0, accepted=0, emitted=1, draft_seconds=0.0,
                           verify_seconds=0.01, context_len=15, sequence=seq))
    assert draft.calls == [15]


def test_a_finished_request_scores_what_waits_without_asking_the_draft_again():
    """The suffix cache has been shown the request's output by the time the next request comes:
    asking it then would copy the answer from itself."""
    script = list(range(100, 200))
    draft = ScriptDraft(script)
    scorer = CopyScorer([NONE, Arm("ngram", 8)], {"ngram": draft})
    assert plain_request(scorer, script, 10, 3) == []  # 3 of its 8 tokens verified: waiting
    calls = list(draft.calls)
    other = [1, 2, 3]
    scores = scorer.step(StepRecord(domain="chat", arm=NONE, drafted=0, accepted=0, emitted=1, draft_seconds=0.0,
                                    verify_seconds=0.01, context_len=2, sequence=other))
    old = [s for s in scores if s.domain == "rag"]
    assert [(s.emitted, s.proposed) for s in old] == [(3, 8)]  # never past the request's 3 tokens
    assert draft.calls == calls + [2]  # the new request's own step only


@pytest.mark.parametrize("rows", [1, 3])
def test_a_batch_step_scores_for_every_row(rows):
    script = list(range(100, 200))
    scorer = CopyScorer([NONE, Arm("ngram", 2)], {"ngram": ScriptDraft(script)})
    seq = script[:10]
    seq.extend(script[10:13])
    scores = scorer.step(StepRecord(domain="rag", arm=NONE, drafted=0, accepted=0, emitted=rows,
                                    draft_seconds=0.0, verify_seconds=0.01, context_len=10, sequence=seq, rows=rows))
    assert [s.emitted for s in scores] == [3 * rows]
