"""Priors for model-draft arms the router has not run: measured acceptance at measured costs."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from helpers import tiny_llama, tiny_loaded

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.drafts import ModelDraft
from flashspec_core.drafts.trained import WEIGHTS_DIR, card_accepted_lengths
from flashspec_core.engine import SpecEngine
from flashspec_core.routing import BanditRouter
from flashspec_core.routing.bandits import ThompsonSampling
from flashspec_core.routing.priors import draft_token_seconds, expected_goodput

from .test_router import WORLD, drive

NONE = Arm(NO_DRAFT, 0)


def test_an_arm_s_own_prior_mean_decides_how_often_it_is_tried():
    def tries(prior):
        bandit = ThompsonSampling(2, prior_sd=0.1, observed=[0], seed=1)
        for _ in range(5):
            bandit.update(0, 0.5)  # plain decoding, scored every step: mean 0.5
        if prior is not None:
            bandit.set_prior_mean(1, prior)
        return sum(bandit.select() == 1 for _ in range(200))

    assert tries(0.1) < 20 < 60 < tries(None) < 140 < tries(0.9)  # the default 0.5 ties plain's mean
    with pytest.raises(ValueError, match="mean"):
        ThompsonSampling(2).set_prior_mean(1, 1.5)


def test_model_drafts_presumed_slow_are_rarely_explored_where_they_do_not_pay():
    """On "slow" (plain decoding 25 tok/s, the model draft 17) the router without priors pulls the
    model arms to disprove the optimistic default; told they earn ~half of plain, far less."""
    arms = [Arm("model", 2), Arm("model", 4)]

    def model_pulls(expected):
        total = 0
        for seed in range(4):
            router = BanditRouter(arms, "thompson", seed=seed)
            router.set_forward_costs({1: 0.04, 3: 0.06, 5: 0.08})
            if expected:
                router.set_expected_goodput({a: 12.0 for a in arms})
            total += sum(a != NONE for a in drive(
                router, "slow", 40, random.Random(seed),
                world={"slow": {NONE: (1.0, 0.04), **{a: (1.5, 0.09) for a in arms}}}))
        return total

    assert model_pulls(expected=False) >= 8
    assert model_pulls(expected=True) == 0  # expected below plain decoding: not offered at all


def test_only_arms_expected_below_plain_decoding_are_retired():
    """Plain decoding: 25 tok/s (0.04 s a pass). model@2 is expected at 30 (offered), model@4 at
    20 (not offered, in every domain, new ones too); a copy draft is never retired."""
    arms = [Arm("model", 2), Arm("model", 4)]
    router = BanditRouter(arms, "thompson", seed=0)
    router.set_forward_costs({1: 0.04, 3: 0.06, 5: 0.08})
    router.set_expected_goodput({Arm("model", 2): 30.0, Arm("model", 4): 20.0})
    # Both model arms would in fact be the fastest (3 tokens in 0.06 s): only model@2 gets to show it.
    world = {d: {NONE: (1.0, 0.04), Arm("model", 2): (3.0, 0.06), Arm("model", 4): (3.0, 0.06)}
             for d in ("chat", "code", "tool")}
    picks = [a for d in world for a in drive(router, d, 60, random.Random(1), world=world)]
    assert Arm("model", 4) not in picks and picks.count(Arm("model", 2)) > 100


def test_expected_goodput_needs_every_measurement_and_is_rejected_for_unknown_arms():
    arms = [Arm("m", 2), Arm("m", 4), Arm("n", 2)]
    got = expected_goodput(arms, {"m": {2: 1.0, 4: 1.5}}, {"m": 0.01}, {3: 0.05})
    assert got == {Arm("m", 2): pytest.approx(2.0 / (2 * 0.01 + 0.05))}  # m@4: no width-5 cost; n: no card
    router = BanditRouter([Arm("m", 2)], "thompson")
    router.set_forward_costs({1: 0.04})
    with pytest.raises(ValueError, match="goodput"):
        router.set_expected_goodput({Arm("other", 2): 10.0})
    assert WORLD  # the shared world of test_router is what `drive` runs on


def test_a_trained_draft_s_card_gives_its_accepted_lengths(tmp_path):
    shipped = card_accepted_lengths(WEIGHTS_DIR / "distill_chat.md")
    assert sorted(shipped) == [2, 4, 8]
    assert 0 < shipped[2] < shipped[4] < shipped[8] < 8  # more tokens accepted per step at larger γ
    (tmp_path / "bare.md").write_text("# a card without its evaluation block\n")
    assert card_accepted_lengths(tmp_path / "bare.md") == {}
    assert card_accepted_lengths(Path(tmp_path / "missing.md")) == {}


def test_the_engine_times_a_draft_with_a_measured_acceptance_and_seeds_the_router(flashspec_cache_dir):
    target = tiny_loaded(16, seed=0)
    draft = ModelDraft(tiny_llama(16, seed=1), name="small")
    seconds = draft_token_seconds(draft, vocab=16)
    assert 0 < seconds < 1 and math.isfinite(seconds)
    draft.accepted_lengths = {2: 1.2}
    engine = SpecEngine(target, [draft], router="thompson", gammas=(2, 4), backend="hf")
    expected = engine.router._expected
    assert set(expected) == {engine.router.arms.index(Arm("small", 2))}  # γ=4 has no measured acceptance
    assert 0 < expected[engine.router.arms.index(Arm("small", 2))] <= 1
    out = engine.generate([[1, 2, 3]], max_new_tokens=4)  # the draft still serves requests after its timing
    assert len(out[0].token_ids) == 4
