"""Multi-armed bandits over a handful of arms: UCB1 and Thompson sampling.

Both keep the same sufficient statistics per arm (count, sum and sum of squares of rewards), so one
state layout serves every algorithm, the store and the router's shared prior. Rewards must already
be in [0, 1]. Arms in `observed` are scored every round whether played or not, so neither
algorithm explores them: they compete on their mean alone. Non-stationary streams get a discount
factor (every update first multiplies all statistics by `discount`) or a sliding window (only the
last `window` updates count); `update_many` scores several arms on one round and discounts once.
Pure Python, a few arms: microseconds a step. Why: docs/design.md, "The bandits".
"""
from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

STATE_VERSION = 1


def _check_reward(reward: float) -> float:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"reward must be a real number in [0, 1], got {reward!r}")
    r = float(reward)
    if not (0.0 <= r <= 1.0):  # also rejects NaN
        raise ValueError(
            f"reward must be in [0, 1], got {reward!r}; normalise it first "
            "(e.g. divide goodput by a running maximum)"
        )
    return r


class Bandit:
    """Shared statistics and update rules; subclasses only decide `select`."""

    algorithm: ClassVar[str] = ""

    def __init__(
        self,
        n_arms: int,
        *,
        discount: float = 1.0,
        window: int | None = None,
        seed: int | None = None,
        observed: Sequence[int] = (),
    ) -> None:
        if isinstance(n_arms, bool) or not isinstance(n_arms, int) or n_arms < 1:
            raise ValueError(f"n_arms must be an int >= 1, got {n_arms!r}")
        if not isinstance(discount, (int, float)) or not (0.0 < discount <= 1.0):
            raise ValueError(f"discount must be in (0, 1] (1 = no discounting), got {discount!r}")
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ValueError(f"window must be None or an int >= 1, got {window!r}")
            if discount != 1.0:
                raise ValueError("window and discount are alternatives: pass one of them, not both")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be None or an int, got {seed!r}")
        observed = tuple(observed)
        if any(isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < n_arms for a in observed):
            raise ValueError(f"observed must list arm indices in [0, {n_arms}), got {list(observed)!r}")
        self.n_arms = n_arms
        self.observed = frozenset(observed)
        self.discount = float(discount)
        self.window = window
        self.seed = seed
        self._rng = random.Random(seed)
        self.counts = [0.0] * n_arms
        self.sums = [0.0] * n_arms
        self.sumsqs = [0.0] * n_arms
        # Rounds seen (discounted like the counts); UCB's log term and the window run on it.
        self.steps = 0.0
        # True while every observed reward was exactly 0 or 1 (Thompson then uses a Beta posterior).
        self.binary = True
        self._history: deque[tuple[tuple[int, float], ...]] | None = (
            deque() if window is not None else None
        )

    def _check_arm(self, arm: int) -> int:
        if isinstance(arm, bool) or not isinstance(arm, int) or not (0 <= arm < self.n_arms):
            raise ValueError(f"arm must be an int in [0, {self.n_arms}), got {arm!r}")
        return arm

    def select(self, exclude: frozenset[int] = frozenset()) -> int:
        """The arm to play next, never one of `exclude` (unless every arm is)."""
        raise NotImplementedError

    def _allowed(self, exclude: frozenset[int]) -> list[int]:
        allowed = [i for i in range(self.n_arms) if i not in exclude]
        return allowed or list(range(self.n_arms))

    def update(self, arm: int, reward: float) -> None:
        """One round in which `arm` was played and earned `reward` in [0, 1]."""
        self.update_many({arm: reward})

    def update_many(self, rewards: Mapping[int, float]) -> None:
        """One round in which every arm in `rewards` was observed (full information).

        The round is validated as a whole before anything changes, so a bad reward leaves the
        statistics untouched.
        """
        if not isinstance(rewards, Mapping) or not rewards:
            raise ValueError("rewards must be a non-empty mapping {arm index: reward in [0, 1]}")
        items = tuple((self._check_arm(a), _check_reward(r)) for a, r in rewards.items())
        if self.discount < 1.0:
            g = self.discount
            self.counts = [c * g for c in self.counts]
            self.sums = [s * g for s in self.sums]
            self.sumsqs = [q * g for q in self.sumsqs]
            self.steps *= g
        for arm, r in items:
            self.counts[arm] += 1.0
            self.sums[arm] += r
            self.sumsqs[arm] += r * r
            if r not in (0.0, 1.0):
                self.binary = False
        self.steps += 1.0
        if self._history is not None:
            self._history.append(items)
            if len(self._history) > (self.window or 0):
                self._forget(self._history.popleft())

    def _forget(self, items: tuple[tuple[int, float], ...]) -> None:
        for arm, r in items:
            # max(0, .) absorbs float drift from many add/subtract pairs.
            self.counts[arm] = max(0.0, self.counts[arm] - 1.0)
            self.sums[arm] = max(0.0, self.sums[arm] - r)
            self.sumsqs[arm] = max(0.0, self.sumsqs[arm] - r * r)
        self.steps = max(0.0, self.steps - 1.0)

    def add_prior(
        self, counts: Sequence[float], sums: Sequence[float], sumsqs: Sequence[float]
    ) -> None:
        """Add pseudo-observations (the router's shared prior for a domain not seen before).

        They count as evidence like real rounds, fade with the discount, and are never dropped by
        the sliding window (they are not in its history).
        """
        for name, seq in (("counts", counts), ("sums", sums), ("sumsqs", sumsqs)):
            if len(seq) != self.n_arms:
                raise ValueError(f"{name} must have n_arms={self.n_arms} entries, got {len(seq)}")
        for i in range(self.n_arms):
            c, s, q = float(counts[i]), float(sums[i]), float(sumsqs[i])
            if c < 0 or not (0.0 <= s <= c + 1e-9) or not (0.0 <= q <= c + 1e-9):
                raise ValueError(
                    f"prior for arm {i} is inconsistent with rewards in [0, 1]: "
                    f"counts={c}, sums={s}, sumsqs={q}"
                )
            self.counts[i] += c
            self.sums[i] += s
            self.sumsqs[i] += q
        self.steps += max((float(c) for c in counts), default=0.0)

    def means(self) -> list[float]:
        """Posterior-free mean reward per arm (0.0 for an arm never observed)."""
        return [s / c if c > 0 else 0.0 for s, c in zip(self.sums, self.counts)]

    def _params(self) -> dict[str, Any]:
        return {"observed": sorted(self.observed)} if self.observed else {}

    def export_state(self) -> dict[str, Any]:
        """Everything needed to resume, as plain JSON-able values (the RNG stream is not kept)."""
        return {
            "version": STATE_VERSION,
            "algorithm": self.algorithm,
            "n_arms": self.n_arms,
            "discount": self.discount,
            "window": self.window,
            "params": self._params(),
            "counts": list(self.counts),
            "sums": list(self.sums),
            "sumsqs": list(self.sumsqs),
            "steps": self.steps,
            "binary": self.binary,
            "history": None
            if self._history is None
            else [[[a, r] for a, r in items] for items in self._history],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], seed: int | None = None) -> Bandit:
        """Rebuild a bandit from `export_state()` output."""
        if not isinstance(state, Mapping):
            raise ValueError(f"state must be a dict from export_state(), got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"state has version {state.get('version')!r}; this code reads version {STATE_VERSION}"
            )
        if state.get("algorithm") != cls.algorithm:
            raise ValueError(
                f"state is for algorithm {state.get('algorithm')!r}, not {cls.algorithm!r}; "
                "use bandit_from_state() to dispatch on it"
            )
        try:
            bandit = cls(
                int(state["n_arms"]),
                discount=float(state["discount"]),
                window=state["window"],
                seed=seed,
                **dict(state.get("params") or {}),
            )
            n = bandit.n_arms
            counts, sums, sumsqs = (
                [float(x) for x in state[k]] for k in ("counts", "sums", "sumsqs")
            )
            if not (len(counts) == len(sums) == len(sumsqs) == n):
                raise ValueError(f"counts/sums/sumsqs must each have n_arms={n} entries")
            bandit.counts, bandit.sums, bandit.sumsqs = counts, sums, sumsqs
            bandit.steps = float(state["steps"])
            bandit.binary = bool(state["binary"])
            if bandit._history is not None:
                for items in state.get("history") or []:
                    bandit._history.append(
                        tuple((bandit._check_arm(int(a)), _check_reward(r)) for a, r in items)
                    )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"state is missing or has a malformed field: {exc}") from exc
        return bandit


class UCB1(Bandit):
    """UCB1 (Auer et al. 2002): play every arm once, then the highest upper confidence bound.

    Score = mean + sqrt(exploration * ln(t) / n). With `discount` < 1 this is discounted UCB
    (Garivier and Moulines 2011): t and n are the discounted round and pull counts.
    """

    algorithm = "ucb1"

    def __init__(
        self,
        n_arms: int,
        *,
        exploration: float = 2.0,
        discount: float = 1.0,
        window: int | None = None,
        seed: int | None = None,
        observed: Sequence[int] = (),
    ) -> None:
        super().__init__(n_arms, discount=discount, window=window, seed=seed, observed=observed)
        if not isinstance(exploration, (int, float)) or not (exploration >= 0.0):
            raise ValueError(f"exploration must be a number >= 0 (UCB1 uses 2), got {exploration!r}")
        self.exploration = float(exploration)

    def _params(self) -> dict[str, Any]:
        return {**super()._params(), "exploration": self.exploration}

    def select(self, exclude: frozenset[int] = frozenset()) -> int:
        # An arm whose evidence has (almost) faded away counts as unplayed and is tried first
        # (observed arms too: one that was never scored may need a pull before it can be).
        allowed = self._allowed(exclude)
        for i in allowed:
            if self.counts[i] < 1e-9:
                return i
        log_t = math.log(max(self.steps, 1.0))
        best, best_score = allowed[0], -math.inf
        for i in allowed:
            s, c = self.sums[i], self.counts[i]
            bonus = 0.0 if i in self.observed else math.sqrt(self.exploration * log_t / c)
            score = s / c + bonus
            if score > best_score:
                best, best_score = i, score
        return best


_POSTERIORS = ("auto", "beta", "normal")


class ThompsonSampling(Bandit):
    """Thompson sampling: draw a plausible mean per arm from its posterior, play the largest.

    posterior="beta": Beta(1 + sum, 1 + n - sum), the conjugate posterior for 0/1 rewards and a
    standard fractional update for rewards in [0, 1]. Its variance assumes the worst case for a
    [0, 1] reward, so it over-explores when rewards barely vary.
    posterior="normal": Normal-Gamma on the mean and precision of the reward, which learns how
    noisy each arm is; this fits continuous goodput, whose spread is far below the Bernoulli one.
    posterior="auto" (default): Beta while every reward seen was exactly 0 or 1, Normal-Gamma once
    a fractional reward arrives. Both read the same (n, sum, sum of squares) statistics.
    """

    algorithm = "thompson"
    # Normal-Gamma prior: mean `prior_mean` worth one observation; Gamma(1, prior_sd**2) on the precision.
    _KAPPA0, _ALPHA0 = 1.0, 1.0

    def __init__(
        self,
        n_arms: int,
        *,
        posterior: str = "auto",
        prior_sd: float = 0.5,
        prior_mean: float = 0.5,
        discount: float = 1.0,
        window: int | None = None,
        seed: int | None = None,
        observed: Sequence[int] = (),
    ) -> None:
        """prior_sd: the spread of one reward that the Normal-Gamma prior expects. The default
        0.5 spans the whole [0, 1] range; rewards that vary less (goodput on a fixed scale) want
        a smaller value, or the prior keeps the posterior wide for hundreds of pulls.
        prior_mean: the Normal-Gamma prior's mean reward; an untried arm above the arms' usual
        rewards is tried a few times before its own rewards pull it down (optimism)."""
        super().__init__(n_arms, discount=discount, window=window, seed=seed, observed=observed)
        if posterior not in _POSTERIORS:
            raise ValueError(f"posterior must be one of {_POSTERIORS}, got {posterior!r}")
        if isinstance(prior_sd, bool) or not isinstance(prior_sd, (int, float)) or not prior_sd > 0:
            raise ValueError(f"prior_sd must be a number > 0, got {prior_sd!r}")
        if isinstance(prior_mean, bool) or not isinstance(prior_mean, (int, float)) or not 0.0 <= prior_mean <= 1.0:
            raise ValueError(f"prior_mean must be a number in [0, 1], got {prior_mean!r}")
        self.posterior = posterior
        self.prior_sd = float(prior_sd)
        self.prior_mean = float(prior_mean)
        # arm -> its own Normal-Gamma prior mean (`set_prior_mean`): configuration, not learned
        # state, so export_state leaves it out and whoever rebuilds the bandit sets it again
        self.arm_prior_means: dict[int, float] = {}

    def set_prior_mean(self, arm: int, mean: float) -> None:
        """What arm `arm` is presumed to earn before its rewards say (instead of `prior_mean`): an
        expectation measured elsewhere, such as a draft's acceptance measured off-line priced at
        this machine's forward costs. Worth one observation, as `prior_mean` is (the Normal-Gamma
        posterior's; the Beta one, for 0/1 rewards, has no prior mean)."""
        self._check_arm(arm)
        if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not 0.0 <= mean <= 1.0:
            raise ValueError(f"mean must be a number in [0, 1], got {mean!r}")
        self.arm_prior_means[arm] = float(mean)

    def _params(self) -> dict[str, Any]:
        return {**super()._params(), "posterior": self.posterior, "prior_sd": self.prior_sd,
                "prior_mean": self.prior_mean}

    def _uses_beta(self) -> bool:
        return self.posterior == "beta" or (self.posterior == "auto" and self.binary)

    def sample_means(self) -> list[float]:
        """One posterior draw of every arm's mean reward; an observed arm's posterior mean, or
        +inf while it has no evidence (it may need one pull before it can be scored: the router
        scores plain decoding once it has timed a one-token pass)."""
        rng, observed = self._rng, self.observed
        if self._uses_beta():
            return [
                (math.inf if c < 1e-9 else (1.0 + s) / (2.0 + c)) if i in observed
                else rng.betavariate(1.0 + s, 1.0 + max(0.0, c - s))
                for i, (s, c) in enumerate(zip(self.sums, self.counts))
            ]
        k0, a0 = self._KAPPA0, self._ALPHA0
        b0 = a0 * self.prior_sd ** 2
        draws = []
        for i, (s, q, c) in enumerate(zip(self.sums, self.sumsqs, self.counts)):
            mu0 = self.arm_prior_means.get(i, self.prior_mean)
            kn = k0 + c
            mun = (k0 * mu0 + s) / kn
            if i in observed:
                draws.append(math.inf if c < 1e-9 else mun)
                continue
            m2 = max(0.0, q - s * s / c) if c > 0 else 0.0
            dev = (s / c - mu0) if c > 0 else 0.0
            bn = b0 + 0.5 * m2 + k0 * c * dev * dev / (2.0 * kn)
            tau = rng.gammavariate(a0 + 0.5 * c, 1.0 / bn)
            draws.append(rng.gauss(mun, 1.0 / math.sqrt(kn * max(tau, 1e-300))))
        return draws

    def select(self, exclude: frozenset[int] = frozenset()) -> int:
        draws = self.sample_means()
        return max(self._allowed(exclude), key=draws.__getitem__)


_BANDITS: dict[str, type[Bandit]] = {UCB1.algorithm: UCB1, ThompsonSampling.algorithm: ThompsonSampling}


def bandit_from_state(state: Mapping[str, Any], seed: int | None = None) -> Bandit:
    """Rebuild whichever bandit `state` (from `export_state()`) describes."""
    algorithm = state.get("algorithm") if isinstance(state, Mapping) else None
    if algorithm not in _BANDITS:
        raise ValueError(f"state['algorithm'] must be one of {sorted(_BANDITS)}, got {algorithm!r}")
    return _BANDITS[algorithm].from_state(state, seed=seed)
