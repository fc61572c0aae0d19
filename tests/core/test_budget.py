"""The token budget of a step whose rows all compute one width: which width it picks from measured
step times and learned acceptance, that it cuts proposals to it, and that cut steps stay exact."""
from __future__ import annotations

import pytest
import torch

from flashspec_core.arms import Arm
from flashspec_core.budget import Acceptance, TokenBudget, best_width
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.proposals import Drafted
from flashspec_core.routing.fixed import FixedRouter

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# A graphed step's seconds by width: flat up to 5 columns, then four times dearer.
SECONDS = {1: 1.0, 3: 1.0, 5: 1.0, 9: 4.0, 17: 4.0}


def drafted(n: int, vocab: int | None = None) -> Drafted:
    probs = None if vocab is None else torch.rand(n, vocab)
    return Drafted(list(range(n)), probs, 0.1, 0.0)


def test_acceptance_keeps_the_running_mean_of_what_each_cut_would_have_kept():
    acc = Acceptance()
    assert acc.expected("tool", "pl", 6) == 6.0  # nothing seen: every token counted
    acc.learn("tool", "pl", proposed=8, accepted=3)
    acc.learn("tool", "pl", proposed=8, accepted=5)
    assert acc.expected("tool", "pl", 2) == pytest.approx(2.0)  # both kept 2 of a cut to 2
    assert acc.expected("tool", "pl", 4) == pytest.approx(3.5)  # min(3, 4) and min(5, 4)
    assert acc.expected("tool", "pl", 8) == pytest.approx(4.0)
    assert acc.expected("tool", "pl", 12) == 12.0  # longer than anything proposed: not measured
    assert acc.expected("chat", "pl", 4) == 4.0  # another domain learns apart
    assert acc.expected("tool", "pl", 0) == 0.0


def test_acceptance_follows_a_change_within_its_window():
    acc = Acceptance()
    for _ in range(200):
        acc.learn("code", "pl", 4, 4)
    for _ in range(200):
        acc.learn("code", "pl", 4, 0)
    assert acc.expected("code", "pl", 4) < 0.01


def test_the_best_width_weighs_expected_tokens_against_the_step_time():
    acc = Acceptance()
    for _ in range(10):
        acc.learn("chat", "pl", 16, 0)  # chat's long copies are never accepted
        acc.learn("tool", "pl", 16, 16)  # tool's always are
    # 63 chat rows and one tool row: 17 columns would cost 4x for 16 more tokens; 5 columns cost
    # nothing more and give the tool row 4.
    assert best_width({("chat", "pl", 16): 63, ("tool", "pl", 16): 1}, SECONDS, acc) == 5
    # Tool rows alone: 17 tokens a row for 4x the time lose to 5 for 1x; for 2x they win.
    assert best_width({("tool", "pl", 16): 4}, SECONDS, acc) == 5
    assert best_width({("tool", "pl", 16): 4}, {**SECONDS, 17: 2.0}, acc) == 17
    assert best_width({("tool", "pl", 16): 4}, {**SECONDS, 17: 2.0}, acc, floor=6) == 17
    assert best_width({("chat", "pl", 16): 4}, SECONDS, acc, floor=6) == 9  # the narrowest allowed
    # The step time decides: with 17 columns as cheap as 5, the tool row's tokens win.
    flat = dict.fromkeys(SECONDS, 1.0)
    assert best_width({("chat", "pl", 16): 63, ("tool", "pl", 16): 1}, flat, acc) == 17
    assert best_width({("tool", "pl", 16): 1}, {}, acc) is None


def test_a_budget_cuts_every_longer_greedy_proposal_and_its_q_and_never_a_lone_row():
    budget = TokenBudget()
    for _ in range(10):
        budget.learn("chat", "model", 16, 0)
    rows = [drafted(16, vocab=7), drafted(3), drafted(16)]
    cut = budget.cut(["chat"] * 3, ["model"] * 3, rows, [True] * 3, SECONDS)
    assert [len(d.tokens) for d in cut] == [0, 0, 0]  # nothing is ever accepted: width 1
    assert cut[0].probs is not None and cut[0].probs.shape == (0, 7)
    assert budget.cuts == 3
    alone = budget.cut(["chat"], ["model"], [drafted(16)], [True], SECONDS)
    assert len(alone[0].tokens) == 16
    assert budget.cut(["chat"] * 2, ["model"] * 2, [drafted(2), drafted(1)], [True] * 2, {})[0].tokens == [0, 1]


def test_a_sampled_proposal_is_never_cut_and_the_step_is_at_least_its_width():
    budget = TokenBudget()
    for _ in range(10):
        budget.learn("chat", "model", 16, 0)
    rows = [drafted(16), drafted(3), drafted(16)]
    cut = budget.cut(["chat"] * 3, ["model"] * 3, rows, [True, False, True], SECONDS)
    assert [len(d.tokens) for d in cut] == [4, 3, 4]  # width 5: the narrowest that holds the sampled row
    cut = budget.cut(["chat"] * 3, ["model"] * 3, rows, [False, True, True], SECONDS)
    assert [len(d.tokens) for d in cut] == [16, 3, 16]  # a sampled row at 16: nothing to gain by cutting


class Graphed:
    """The CPU runner behind a graphed runner's interface, with a measured step-time table."""

    use_graphs = True

    def __init__(self, inner, seconds) -> None:
        self.inner, self.seconds = inner, seconds
        self.fed: list[int] = []  # the longest row feed of each step

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step_seconds(self):
        return self.seconds

    def score_rows(self, sequences, needs):
        self.fed.append(max(needs))
        return self.inner.score_rows(sequences, needs)


PROMPTS = [[8, 2, 8, 1, 8, 2, 8, 1, 8, 2], [6, 6, 6, 6, 1, 6, 6, 6], [3, 1, 4, 1, 3, 1, 4, 1, 3],
           [5, 3, 5, 8, 5, 3, 5, 8, 5, 3]]


def graphed_engine(tiny_target, seconds) -> SpecEngine:
    engine = SpecEngine(tiny_target, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 8)),
                        verify_backend="torch", calibrate=False)
    engine.runner = Graphed(engine.runner, seconds)
    return engine


def test_cut_greedy_steps_emit_what_uncut_steps_do(tiny_target):
    """Rows stepping together on a graphed runner whose wide steps cost 4x: the budget cuts their
    proposals (every step feeds at most 5 tokens a row) and each row's output is the uncut one's."""
    plain = graphed_engine(tiny_target, {})
    expected = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=24)]
    cut = graphed_engine(tiny_target, SECONDS)
    assert [r.token_ids for r in cut.generate(PROMPTS, max_new_tokens=24)] == expected
    assert max(plain.runner.fed) > 5  # uncut, some step fed a longer proposal
    assert cut._stepper.budget.cuts > 0 and max(cut.runner.fed) <= 5


def test_a_seeded_sampled_row_beside_cut_greedy_rows_draws_what_it_draws_alone(tiny_target):
    sampling = SamplingParams(temperature=0.8, seed=11)
    alone = graphed_engine(tiny_target, SECONDS).generate(PROMPTS[0], max_new_tokens=24, sampling=sampling)
    engine = graphed_engine(tiny_target, SECONDS)
    greedy = engine.submit(PROMPTS[1:], max_new_tokens=24)
    mine = engine.submit([PROMPTS[0]], max_new_tokens=24, sampling=sampling)
    assert mine.wait()[0].token_ids == alone.token_ids
    greedy.wait()
    assert engine._stepper.budget.cuts > 0


def line(fixed: float, per_token: float):
    """A ragged forward's seconds by the tokens it computes."""
    return lambda tokens: fixed + per_token * tokens


def test_a_ragged_cut_keeps_the_drafted_tokens_worth_their_compute():
    budget = TokenBudget()
    for _ in range(10):
        budget.learn("chat", "pl", 16, 0)  # chat's copies are never accepted
        budget.learn("tool", "pl", 16, 16)  # tool's always are
        budget.learn("code", "pl", 4, 1)  # code's: the first token, never a second
    rows = [drafted(16), drafted(16), drafted(4), drafted(16, vocab=5)]
    domains = ["chat", "tool", "code", "chat"]
    cut = budget.cut_ragged(domains, ["pl"] * 4, rows, [True] * 4, line(10.0, 1.0))
    assert [len(d.tokens) for d in cut] == [0, 16, 1, 0]
    assert cut[3].probs is not None and cut[3].probs.shape == (0, 5)
    assert budget.cuts == 3
    # A token that is always accepted but costs more than the step's rate so far is not kept.
    assert [len(d.tokens) for d in budget.cut_ragged(domains, ["pl"] * 4, rows, [True] * 4,
                                                     line(0.0, 10.0))] == [0, 0, 0, 0]
    # Nothing learned yet: every token counted as accepted, so none is cut for being unmeasured.
    fresh = TokenBudget().cut_ragged(["rag"] * 2, ["pl"] * 2, [drafted(8), drafted(3)], [True] * 2, line(5.0, 1.0))
    assert [len(d.tokens) for d in fresh] == [8, 3]


def test_a_ragged_cut_spares_sampled_rows_and_a_lone_row_unless_a_prompt_piece_shares_its_forward():
    budget = TokenBudget()
    for _ in range(10):
        budget.learn("chat", "pl", 16, 0)
    rows = [drafted(16), drafted(16)]
    cut = budget.cut_ragged(["chat"] * 2, ["pl"] * 2, rows, [False, True], line(10.0, 1.0))
    assert [len(d.tokens) for d in cut] == [16, 0]
    alone = budget.cut_ragged(["chat"], ["pl"], [drafted(16)], [True], line(10.0, 1.0))
    assert len(alone[0].tokens) == 16  # a lone row's draft is its router's choice
    fed = budget.cut_ragged(["chat"], ["pl"], [drafted(16)], [True], line(10.0, 1.0), fed=300)
    assert len(fed[0].tokens) == 0


def test_greedy_rows_cut_on_a_ragged_cpu_step_emit_what_uncut_steps_do(tiny_target):
    """CPU rows stepping together where every token a forward computes costs the same: the budget
    cuts the proposals it learns are not accepted, and each row's output is the uncut one's."""
    from flashspec_core.backends.calibration import Calibration

    def engine() -> SpecEngine:
        return SpecEngine(tiny_target, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 8)),
                          verify_backend="torch", calibrate=False)

    plain = engine()
    expected = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=24)]
    assert plain._stepper.budget.cuts == 0  # no plan: nothing to weigh tokens against
    cut = engine()
    cut.runner.plan = Calibration(key="k", cpu="c", threads=1, seconds={"stock": {1: 1.0, 128: 128.0}})
    assert [r.token_ids for r in cut.generate(PROMPTS, max_new_tokens=24)] == expected
    assert cut._stepper.budget.cuts > 0
