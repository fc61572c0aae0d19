"""What a `BanditRouter` keeps per domain: its bandit, raw tallies per arm, and what a verify pass costs.

The cost model prices steps the router did not run (copy drafts scored after the fact, smaller γ
of a model draft), so it is where one bad measurement does the most harm: see `verify_seconds`.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from flashspec_core.routing.bandits import Bandit
from flashspec_core.routing.forward_costs import ForwardCosts
from flashspec_core.routing.store import DomainStats

VERIFY_SAMPLES = 63  # latest verify passes kept per size; their median prices the size


@dataclass
class ArmTally:
    """Raw (un-normalised) per-(domain, arm) counters for `summary()` and step-time estimates."""

    pulls: int = 0
    scored: int = 0
    goodput_sum: float = 0.0
    seconds_sum: float = 0.0
    cost_n: float = 0  # steps run or scored (fewer when resumed: stored_weight), with
    cost_sum: float = 0.0  # their measured or estimated seconds

    def mean_seconds(self, seconds: float) -> float:
        """Add one step's (measured or estimated) seconds; the arm's mean step time so far."""
        self.cost_n += 1
        self.cost_sum += seconds
        return self.cost_sum / self.cost_n


@dataclass
class DomainState:
    """One domain's bandit, its arms' tallies and its cost model of a verify pass by size."""

    bandit: Bandit
    tallies: list[ArmTally]
    steps: int = 0
    stored_scale: float | None = None  # the store's scale, until this process measures its own
    # Tokens fed by a single-row verify pass -> its latest measured seconds over the calibrated
    # seconds at its width and context (over 1 without a calibration): what this domain's passes
    # cost next to the calibration, measured while the router runs (load, cache, kernel).
    verify: dict[int, deque[float]] = field(default_factory=dict)
    medians: dict[int, float] = field(default_factory=dict)  # tokens -> median of `verify[tokens]`
    # One forward's seconds by width and context as calibrated on this machine (one object shared
    # by all domains): what a pass costs until this domain has measured its own.
    costs: ForwardCosts = field(default_factory=ForwardCosts)

    def add_evidence(self, stats: DomainStats, names: Sequence[str], cap: float) -> None:
        """Add counters learned elsewhere (a store, another replica) to the bandit and the tallies,
        each arm's shrunk to at most `cap` steps (rewards and step times alike). names: the arms'
        store keys in bandit order; arms not among them are skipped."""
        index = {name: i for i, name in enumerate(names)}
        k = len(names)
        n, s, q = [0.0] * k, [0.0] * k, [0.0] * k
        for arm_name, d in stats.arms.items():
            i = index.get(arm_name)
            if i is None or d.reward_n <= 0:
                continue
            shrink = min(1.0, cap / d.reward_n)
            n[i], s[i], q[i] = d.reward_n * shrink, d.reward_sum * shrink, d.reward_sumsq * shrink
            timed = min(float(d.pulls), cap)  # the step-time mean, shrunk alike
            t = self.tallies[i]
            t.pulls += d.pulls
            t.scored += d.scored
            t.goodput_sum += d.goodput_sum
            t.seconds_sum += d.seconds_sum
            t.cost_n += timed
            t.cost_sum += d.seconds_sum * timed / d.pulls if d.pulls else 0.0
        self.bandit.add_prior(n, s, q)

    def _model(self, tokens: int, context: int | None) -> float:
        return self.costs(tokens, context) or 1.0

    def add_pass(self, tokens: int, seconds: float, context: int | None = None) -> None:
        """Record a single-row verify pass over `tokens` tokens after `context` cached ones."""
        kept = self.verify.setdefault(tokens, deque(maxlen=VERIFY_SAMPLES))
        kept.append(seconds / self._model(tokens, context))
        self.medians[tokens] = statistics.median(kept)

    def verify_seconds(self, tokens: int, context: int | None = None) -> float | None:
        """What a single-row verify pass over `tokens` tokens after `context` cached tokens costs
        (None: at the calibration's context): the calibrated cost there times the median ratio of
        this size's latest passes to theirs, at most that of any larger size measured; an
        unmeasured size takes the median ratio over the sizes measured (1 before any). Without a
        calibration: the median seconds of this size's latest passes, at most a larger size's;
        None when neither is known.

        This price is charged to every copy-draft proposal of that size scored after the fact,
        and only sizes the router runs are measured again, so one slow pass (a kernel compiled at
        first use, a garbage-collector pause) must not set it: hence the median, and the bound (a
        pass over fewer tokens does not cost more than one over more).
        """
        larger = [m * self._model(n, context) for n, m in self.medians.items() if n > tokens]
        median = self.medians.get(tokens)
        if median is None:
            if not self.costs:
                return None
            median = statistics.median(self.medians.values()) if self.medians else 1.0
        return min([median * self._model(tokens, context)] + larger)

    def verify_estimate(self, tokens: int, context: int | None = None) -> float | None:
        """`verify_seconds(tokens, context)`, else (no calibration) that of the nearest size
        measured in this domain, the larger on a tie; None when nothing is known. A pass costs
        about the same for a few more or fewer tokens, and an arm whose cost this misjudges gets
        picked and measured."""
        known = self.verify_seconds(tokens, context)
        if known is not None or not self.verify:
            return known
        nearest = min(self.verify, key=lambda n: (abs(n - tokens), -n))
        return self.verify_seconds(nearest, context)
