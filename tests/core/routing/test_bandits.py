"""Bandit unit tests: convergence, non-stationarity, state round-trips and input validation."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashspec_core.routing import UCB1, ThompsonSampling, bandit_from_state

RATES = (0.3, 0.7, 0.5)


def _play(bandit, rates, rounds, env_seed=0, start=0, picks=None):
    env = random.Random(env_seed)
    picks = [] if picks is None else picks
    for t in range(start, start + rounds):
        arm = bandit.select()
        picks.append(arm)
        r = rates(t)[arm] if callable(rates) else rates[arm]
        bandit.update(arm, 1.0 if env.random() < r else 0.0)
    return picks


@pytest.mark.parametrize(
    "make",
    [
        lambda: UCB1(3, seed=1),
        lambda: ThompsonSampling(3, seed=1),
        lambda: ThompsonSampling(3, posterior="normal", seed=1),
        lambda: ThompsonSampling(3, discount=0.995, seed=1),
        lambda: ThompsonSampling(3, window=500, seed=1),
    ],
    ids=["ucb1", "thompson-beta", "thompson-normal", "thompson-discounted", "thompson-window"],
)
def test_converges_to_the_best_arm(make):
    picks = _play(make(), RATES, 3000)
    late = picks[-500:]
    assert late.count(1) / len(late) > 0.85


def test_thompson_pseudo_regret_is_far_below_ucb1():
    """The seed paper's gap (≈19 vs ≈100 at T=10k); at T=3k Thompson must still be far ahead."""
    def regret(make):
        total = 0.0
        for seed in range(3):
            picks = _play(make(seed), RATES, 3000, env_seed=100 + seed)
            total += sum(0.7 - RATES[a] for a in picks)
        return total / 3
    ucb, ts = regret(lambda s: UCB1(3, seed=s)), regret(lambda s: ThompsonSampling(3, seed=s))
    assert ts < 30 < ucb < 150


def test_ucb1_tries_every_arm_first():
    b = UCB1(4)
    seen = []
    for _ in range(4):
        arm = b.select()
        seen.append(arm)
        b.update(arm, 0.0)
    assert sorted(seen) == [0, 1, 2, 3]


def test_thompson_normal_posterior_separates_close_continuous_rewards():
    """Low-noise continuous rewards 0.55 vs 0.60: Normal-Gamma learns the small spread."""
    b = ThompsonSampling(2, seed=3)
    env = random.Random(3)
    picks = []
    for _ in range(1500):
        arm = b.select()
        picks.append(arm)
        b.update(arm, min(1.0, max(0.0, env.gauss((0.55, 0.60)[arm], 0.02))))
    assert not b.binary
    assert picks[-300:].count(1) > 270


@pytest.mark.parametrize("kind", ["discount", "window"])
def test_non_stationary_variants_follow_a_switch(kind):
    def rates(t):
        return (0.8, 0.2) if t < 2000 else (0.2, 0.8)
    extra = {"discount": 0.98} if kind == "discount" else {"window": 150}
    adaptive = _play(ThompsonSampling(2, seed=5, **extra), rates, 2600)
    stationary = _play(ThompsonSampling(2, seed=5), rates, 2600)
    assert adaptive[-300:].count(1) > 250
    assert adaptive[-600:].count(1) > stationary[-600:].count(1)


def test_full_information_round_discounts_once():
    b = ThompsonSampling(3, discount=0.5)
    b.update_many({0: 1.0, 1: 0.5, 2: 0.0})
    b.update_many({0: 1.0, 1: 0.5, 2: 0.0})
    assert b.counts == [1.5, 1.5, 1.5]
    assert b.steps == 1.5
    assert b.sums[1] == pytest.approx(0.75)


def test_sliding_window_forgets_exactly():
    b = UCB1(2, window=3)
    for arm, r in [(0, 1.0), (1, 0.0), (0, 0.0), (1, 1.0), (1, 1.0)]:
        b.update(arm, r)
    # Only the last three rounds remain: (0, 0.0), (1, 1.0), (1, 1.0).
    assert b.counts == [1.0, 2.0]
    assert b.sums == [0.0, 2.0]
    assert b.steps == 3.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: UCB1(3, exploration=1.5, seed=2),
        lambda: ThompsonSampling(3, posterior="normal", discount=0.9, seed=2),
        lambda: ThompsonSampling(3, window=7, seed=2),
    ],
)
def test_export_import_round_trip(make):
    b = make()
    _play(b, RATES, 50)
    state = b.export_state()
    clone = bandit_from_state(state, seed=9)
    assert type(clone) is type(b)
    assert clone.export_state() == state
    # The clone keeps learning identically (same stats -> same means after the same update).
    b.update(1, 0.25)
    clone.update(1, 0.25)
    assert clone.export_state() == b.export_state()


def test_ucb1_resumes_the_same_choices_after_round_trip():
    b = UCB1(3)
    _play(b, RATES, 40)
    clone = UCB1.from_state(b.export_state())
    assert [clone.select() for _ in range(3)] == [b.select() for _ in range(3)]


def test_from_state_rejects_foreign_or_broken_state():
    state = UCB1(2).export_state()
    with pytest.raises(ValueError, match="algorithm"):
        ThompsonSampling.from_state(state)
    with pytest.raises(ValueError, match="version"):
        UCB1.from_state({**state, "version": 99})
    with pytest.raises(ValueError, match="n_arms"):
        UCB1.from_state({**state, "counts": [0.0]})
    with pytest.raises(ValueError, match="algorithm"):
        bandit_from_state({"algorithm": "epsilon-greedy"})


@pytest.mark.parametrize("bad", [-0.01, 1.01, math.nan, math.inf, "0.5", None, True])
def test_rewards_outside_unit_interval_raise_naming_reward(bad):
    b = ThompsonSampling(2)
    with pytest.raises(ValueError, match="reward"):
        b.update(0, bad)
    assert b.counts == [0.0, 0.0] and b.steps == 0.0


def test_a_bad_reward_leaves_a_full_information_round_untouched():
    b = UCB1(3)
    with pytest.raises(ValueError, match="reward"):
        b.update_many({0: 0.5, 1: 2.0})
    assert b.counts == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("arm", [-1, 3, 1.0, "0", True])
def test_bad_arm_raises_naming_arm(arm):
    with pytest.raises(ValueError, match="arm"):
        UCB1(3).update(arm, 0.5)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"n_arms": 0}, "n_arms"),
        ({"n_arms": 2.0}, "n_arms"),
        ({"n_arms": 2, "discount": 0.0}, "discount"),
        ({"n_arms": 2, "discount": 1.5}, "discount"),
        ({"n_arms": 2, "window": 0}, "window"),
        ({"n_arms": 2, "window": 5, "discount": 0.9}, "window"),
        ({"n_arms": 2, "seed": "x"}, "seed"),
        ({"n_arms": 2, "observed": [2]}, "observed"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ThompsonSampling(**kwargs)
    with pytest.raises(ValueError, match="posterior"):
        ThompsonSampling(2, posterior="gaussian")
    with pytest.raises(ValueError, match="exploration"):
        UCB1(2, exploration=-1)
    with pytest.raises(ValueError, match="prior_sd"):
        ThompsonSampling(2, prior_sd=0)
    with pytest.raises(ValueError, match="prior_mean"):
        ThompsonSampling(2, prior_mean=1.5)


def test_a_prior_sized_to_the_rewards_spread_explores_less_and_survives_export():
    """Rewards 0.25 vs 0.30 with a spread of 0.02: the default prior (sd 0.5, sized for [0, 1])
    still plays the worse arm about a third of the time after 10 pulls each; sd 0.1 far less."""
    rng = random.Random(0)
    wrong = {}
    for sd in (0.5, 0.1):
        bandit = ThompsonSampling(2, prior_sd=sd, seed=1)
        for _ in range(10):
            bandit.update(0, 0.25 + rng.uniform(-0.02, 0.02))
            bandit.update(1, 0.30 + rng.uniform(-0.02, 0.02))
        wrong[sd] = sum(bandit.select() == 0 for _ in range(4000)) / 4000
        assert bandit_from_state(bandit.export_state()).prior_sd == sd
    assert wrong[0.1] < wrong[0.5] / 2


@pytest.mark.parametrize("make", [lambda **k: ThompsonSampling(3, prior_sd=0.1, **k),
                                  lambda **k: UCB1(3, exploration=0.5, **k)])
def test_observed_arms_compete_on_their_means_and_are_never_explored(make):
    """Arms 0 and 1 are scored every round whether played or not (the router's copy drafts):
    playing the worse of them buys nothing, so it is never played."""
    rng = random.Random(0)
    plain, observed = make(seed=3), make(seed=3, observed=[0, 1])
    for bandit in (plain, observed):
        for i in range(100):
            if i < 20:
                bandit.update_many({0: 0.30 + rng.gauss(0, 0.05), 1: 0.33 + rng.gauss(0, 0.05)})
            bandit.update(2, 0.05 + rng.uniform(-0.05, 0.05))
        assert bandit.means()[1] > bandit.means()[0] > bandit.means()[2]
    picks = {id(b): [b.select() for _ in range(2000)] for b in (plain, observed)}
    assert picks[id(observed)].count(0) == 0
    assert picks[id(observed)].count(1) > 1900
    if isinstance(plain, ThompsonSampling):  # without `observed`, Thompson plays the worse one too
        assert picks[id(plain)].count(0) > 20
    assert bandit_from_state(observed.export_state()).observed == {0, 1}


@pytest.mark.parametrize("cls", [ThompsonSampling, UCB1])
def test_an_observed_arm_without_evidence_is_tried_first(cls):
    """The router can score plain decoding only once it has timed a one-token pass."""
    bandit = cls(2, observed=[1], seed=0)
    bandit.update(0, 0.9)
    assert bandit.select() == 1
    bandit.update_many({0: 0.9, 1: 0.1})
    assert bandit.select() == 0


def test_seed_makes_thompson_reproducible():
    a, b = ThompsonSampling(3, seed=42), ThompsonSampling(3, seed=42)
    assert _play(a, RATES, 200) == _play(b, RATES, 200)


def test_binary_flag_switches_thompson_from_beta_to_normal_gamma():
    b = ThompsonSampling(2)
    b.update(0, 1.0)
    b.update(1, 0.0)
    assert b.binary and b._uses_beta()
    b.update(0, 0.4)
    assert not b.binary and not b._uses_beta()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.floats(0.0, 1.0)), min_size=1, max_size=80),
    st.sampled_from([1.0, 0.9, 0.5]),
)
def test_statistics_stay_consistent_for_any_valid_stream(stream, discount):
    b = ThompsonSampling(3, discount=discount)
    for arm, r in stream:
        b.update(arm, r)
    cap = len(stream) if discount == 1.0 else 1.0 / (1.0 - discount)
    for c, s, q in zip(b.counts, b.sums, b.sumsqs):
        assert 0.0 <= q <= s + 1e-9 <= c + 2e-9
        assert c <= cap + 1e-9
    assert 0 <= b.select() < 3
    assert all(0.0 <= m <= 1.0 + 1e-9 for m in b.means())


@settings(max_examples=60, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not 0.0 <= x <= 1.0))
def test_any_out_of_range_float_is_rejected(x):
    with pytest.raises(ValueError, match="reward"):
        UCB1(2).update(0, x)


def test_an_untried_arm_is_tried_until_its_rewards_fall_below_the_prior_mean():
    """prior_mean is the optimism an untried arm gets: with the prior at the arms' usual reward
    (0.2), an arm that earns 0.1 is dropped after fewer pulls than with the prior at 0.5."""
    pulls = {}
    for mean in (0.5, 0.2):
        bandit = ThompsonSampling(2, prior_sd=0.05, prior_mean=mean, seed=0, observed=[0])
        bandit.update_many({0: 0.2})
        for _ in range(200):
            arm = bandit.select()
            bandit.update_many({0: 0.2, 1: 0.1} if arm == 1 else {0: 0.2})
        pulls[mean] = bandit.counts[1]
        assert bandit_from_state(bandit.export_state()).prior_mean == mean
    assert 0 < pulls[0.2] < pulls[0.5]


@pytest.mark.parametrize("cls", [UCB1, ThompsonSampling])
def test_select_never_returns_an_excluded_arm_unless_every_arm_is(cls):
    bandit = cls(4, seed=0)
    for _ in range(30):
        bandit.update(1, 1.0)  # arm 1 is by far the best
    picks = {bandit.select(frozenset({1, 3})) for _ in range(200)}
    assert picks <= {0, 2} and picks
    assert bandit.select(frozenset(range(4))) in range(4)
