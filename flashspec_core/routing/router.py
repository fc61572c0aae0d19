"""Routers: pick the arm (draft source, γ) for each decode step from the domain and past steps.

`BanditRouter` keeps one bandit per domain over the arms, plain decoding (`Arm(NO_DRAFT, 0)`)
always among them. The reward is goodput, tokens emitted per second of step time (draft and
verify), normalised per domain in units of plain decoding's goodput there and uncapped up to the
γ + 1 tokens a step can emit. Deterministic drafts and plain decoding are scored after the fact on
every step (copy_scoring.py), so they are never explored; a model draft's step also scores the
same draft at every smaller γ. Only finished steps are used (exactness invariant): `update` runs
after the step's tokens are final. Why each choice: docs/design.md, "The router and its reward".
"""
from __future__ import annotations

import threading
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.drafts.base import DraftSource
from flashspec_core.records import StepRecord, check_record
from flashspec_core.routing.bandits import UCB1, Bandit, ThompsonSampling
from flashspec_core.routing.base import Router
from flashspec_core.routing.copy_scoring import CopyScorer
from flashspec_core.routing.domain_state import ArmTally, DomainState
from flashspec_core.routing.forward_costs import ForwardCosts
from flashspec_core.routing.store import ArmDelta, DomainStats, RouterStore
from flashspec_core.routing.store_writer import StoreWriter

# Evidence half-life of ~140 steps within a domain: on the switching simulation (benchmarks/
# bandit_sim.py) 0.995 lost less than 0.98 or 0.99 (more exploration) and no more than 0.998.
DEFAULT_DISCOUNT = 0.995
ALGORITHMS = ("thompson", "ucb1", "thompson-discounted", "ucb1-discounted")


class BanditRouter(Router):
    """One bandit per domain over `arms`, rewarded by normalised goodput.

    arms: the (draft, γ) choices; `Arm(NO_DRAFT, 0)` is added if missing, so plain decoding is
        always available. algorithm: "thompson" (default; Normal-Gamma posterior on the
        normalised goodput), "ucb1", or their "-discounted" variants for drifting workloads.
    discount: overrides the discounted variants' factor (default 0.995).
    store: a `RouterStore` to resume from and write every update to (None: memory only).
    free_drafts: name -> deterministic DraftSource scored after the fact on every step (for the
        arms with that draft name).
    prior_weight: a domain seen for the first time starts from the other domains' pooled
        statistics, shrunk to at most this many pseudo-observations per arm: enough to start
        on the arm that usually wins, little enough that its own steps overrule it quickly.
    stored_weight: the store's statistics count for at most this many steps per arm (rewards
        and step times alike). They were learned by earlier processes, maybe by an earlier
        version, on a machine under another load: a warm start, not a verdict, so this many
        steps of the present outweigh them whatever the store has piled up.
    seed: makes arm selection reproducible (each domain's bandit derives its own seed).
    """

    def __init__(
        self,
        arms: Sequence[Arm],
        algorithm: str = "thompson",
        *,
        discount: float | None = None,
        store: RouterStore | None = None,
        free_drafts: Mapping[str, DraftSource] | None = None,
        prior_weight: float = 2.0,
        stored_weight: float = 10.0,
        seed: int | None = None,
    ) -> None:
        arms = list(arms) if isinstance(arms, Sequence) and not isinstance(arms, str) else None
        if not arms or not all(isinstance(a, Arm) for a in arms):
            raise ValueError("arms must be a non-empty sequence of Arm, e.g. [Arm('ngram', 4)]")
        if len(set(arms)) != len(arms):
            raise ValueError(f"arms must be distinct, got {[str(a) for a in arms]}")
        for a in arms:
            if (a.draft == NO_DRAFT) != (a.gamma == 0) or a.gamma < 0:
                raise ValueError(
                    f"arm {a!r}: use Arm(NO_DRAFT, 0) for plain decoding and gamma >= 1 otherwise"
                )
        if Arm(NO_DRAFT, 0) not in arms:
            arms.append(Arm(NO_DRAFT, 0))
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if discount is None:
            discount = DEFAULT_DISCOUNT if algorithm.endswith("-discounted") else 1.0
        if not isinstance(discount, (int, float)) or not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount!r}")
        if store is not None and not isinstance(store, RouterStore):
            raise ValueError(f"store must be a RouterStore or None, got {type(store).__name__}")
        if not isinstance(prior_weight, (int, float)) or prior_weight < 0:
            raise ValueError(f"prior_weight must be a number >= 0, got {prior_weight!r}")
        if not isinstance(stored_weight, (int, float)) or stored_weight <= 0:
            raise ValueError(f"stored_weight must be a number > 0, got {stored_weight!r}")
        free_drafts = dict(free_drafts or {})
        for name, draft in free_drafts.items():
            if not isinstance(draft, DraftSource) or not getattr(draft, "deterministic", False):
                raise ValueError(
                    f"free_drafts[{name!r}] must be a deterministic DraftSource: only drafts with "
                    "one-hot q and no side effects can be scored after the fact"
                )
        self.arms: tuple[Arm, ...] = tuple(arms)
        self.algorithm = algorithm
        self.discount = float(discount)
        self.store = store
        self.prior_weight = float(prior_weight)
        self.stored_weight = float(stored_weight)
        self.seed = seed
        self._index = {a: i for i, a in enumerate(self.arms)}
        self._plain = self._index[Arm(NO_DRAFT, 0)]
        self._tokens_at_one = float(max(a.gamma for a in self.arms) + 1)  # reward 1: see the docstring
        self._observed = sorted({self._plain} | {i for i, a in enumerate(self.arms) if a.draft in free_drafts})
        self._names = [str(a) for a in self.arms]  # the store's keys
        self._copies = CopyScorer(self.arms, free_drafts)
        self._free_names = frozenset(free_drafts)
        self._domains: dict[str, DomainState] = {}
        self._costs = ForwardCosts()  # shared by every DomainState (set_forward_costs)
        self._expected: dict[int, float] = {}  # arm -> prior mean reward (set_expected_goodput)
        self._retired: frozenset[int] = frozenset()  # arms not offered (set_expected_goodput)
        self._arms_of = {a.draft: frozenset(i for i, b in enumerate(self.arms) if b.draft == a.draft)
                         for a in self.arms}  # draft name -> its arms' indices (select's `unavailable`)
        self._lock = threading.Lock()
        self._writes = StoreWriter(store)
        if store is not None:
            self._load(store)

    def _new_bandit(self, domain: str) -> Bandit:
        seed = None if self.seed is None else (self.seed * 1_000_003 + zlib.crc32(domain.encode())) % 2**63
        if self.algorithm.startswith("thompson"):
            # In units of a plain step's tokens: one step's reward varies by about 0.4 of them (a
            # prior sized for [0, 1] would keep posteriors wide for hundreds of steps), and an
            # untried model draft is presumed twice as productive as plain decoding, enough to try
            # it, not so much that every γ of every draft is pulled many times to disprove it
            # (0.1 and 0.5 when reward 1 was 4 tokens).
            unit = 1.0 / self._tokens_at_one
            bandit = ThompsonSampling(len(self.arms), prior_sd=0.4 * unit, prior_mean=min(1.0, 2.0 * unit),
                                      discount=self.discount, seed=seed, observed=self._observed)
            self._seed_expected(bandit)
            return bandit
        # UCB1's bonus is sized for rewards spread over [0, 1]; these spread over about two plain
        # steps' worth of tokens, so the bonus shrinks with them: exploration 2 * (2 units)**2
        # (0.5 when reward 1 was 4 tokens, as Thompson's prior above).
        unit = 1.0 / self._tokens_at_one
        return UCB1(len(self.arms), exploration=2.0 * (2.0 * unit) ** 2, discount=self.discount, seed=seed,
                    observed=self._observed)

    def _cap(self) -> float:
        """Most evidence per arm taken from the store: `stored_weight`, or a discounted
        bandit's effective memory when that is shorter."""
        memory = float("inf") if self.discount >= 1.0 else 1.0 / (1.0 - self.discount)
        return min(self.stored_weight, memory)

    def _load(self, store: RouterStore) -> None:
        for domain, stats in store.load().items():
            state = self._domains[domain] = DomainState(
                self._new_bandit(domain), [ArmTally() for _ in self.arms], stats.steps, stats.scale,
                costs=self._costs,
            )
            state.add_evidence(stats, self._names, self._cap())
            state.bandit.steps = min(max(state.bandit.steps, float(stats.steps)), self._cap())

    def absorb(self, increments: Mapping[str, DomainStats]) -> None:
        """Learn from steps other processes took: `increments` are what they added to a shared
        store since this router last looked (see `flashspec_integrations.serve.stats`).

        Unlike the store read at start-up, which may be old and is capped at `stored_weight`,
        these are steps of the same service running now, so they count in full, as if this
        router had taken them: every replica learns from every other one's steps.
        """
        with self._lock:
            for domain, stats in increments.items():
                if not isinstance(stats, DomainStats):
                    raise ValueError(f"increments[{domain!r}] must be a DomainStats, got {type(stats).__name__}")
                state = self._domain(domain)
                state.add_evidence(stats, self._names, float("inf"))
                state.steps += stats.steps
                if state.verify_seconds(1) is None and stats.scale:
                    state.stored_scale = stats.scale

    def _domain(self, domain: str) -> DomainState:
        state = self._domains.get(domain)
        if state is not None:
            return state
        bandit = self._new_bandit(domain)
        k = len(self.arms)
        n, s, q = [0.0] * k, [0.0] * k, [0.0] * k
        for other in self._domains.values():
            for i in range(k):
                n[i] += other.bandit.counts[i]
                s[i] += other.bandit.sums[i]
                q[i] += other.bandit.sumsqs[i]
        for i in range(k):
            if n[i] > self.prior_weight:
                shrink = self.prior_weight / n[i]
                n[i], s[i], q[i] = n[i] * shrink, s[i] * shrink, q[i] * shrink
        if any(n):
            bandit.add_prior(n, s, q)
        state = self._domains[domain] = DomainState(bandit, [ArmTally() for _ in range(k)], costs=self._costs)
        return state

    def set_forward_costs(self, seconds: Mapping[int, float], slopes: Mapping[int, float] | None = None,
                          context: int = 0) -> None:
        """Seconds of one target forward by width after `context` cached tokens, and how many more
        per cached token (`slopes`), as calibrated on this machine: every domain prices its passes
        from these, scaled by what its own passes measure (forward_costs.py, domain_state.py)."""
        with self._lock:
            self._costs.set(seconds, slopes, context)

    def set_expected_goodput(self, goodput: Mapping[Arm, float]) -> None:
        """Tokens/s each arm is expected to reach before it has run: the prior mean of its reward
        in every domain (Thompson sampling only; arms not given keep the optimistic default, twice
        plain decoding's goodput). An arm expected below plain decoding's goodput is not offered
        at all: its draft's expectation is its best case (`routing/priors.py` prices the accepted
        lengths measured on prompts like its training data at this machine's costs), so it would
        not win anywhere and each try costs a prefill. Needs `set_forward_costs` first.
        """
        with self._lock:
            plain = self._costs.at_width(1)
            if not plain or not self.algorithm.startswith("thompson"):
                return
            self._expected = {}
            for arm, tokens_per_second in goodput.items():
                if arm not in self._index or not tokens_per_second >= 0:
                    raise ValueError(f"goodput: {arm!r} is not an arm, or {tokens_per_second!r} is not >= 0 tokens/s")
                self._expected[self._index[arm]] = min(1.0, tokens_per_second * plain / self._tokens_at_one)
            self._retired = frozenset(self._index[a] for a, tps in goodput.items() if tps * plain < 1.0)
            for state in self._domains.values():
                self._seed_expected(state.bandit)

    def _seed_expected(self, bandit: Bandit) -> None:
        if not isinstance(bandit, ThompsonSampling):  # only Thompson sampling takes a prior mean
            return
        for i, mean in self._expected.items():
            if i not in bandit.observed:
                bandit.set_prior_mean(i, mean)

    def select(self, domain: str, unavailable: frozenset[str] = frozenset()) -> Arm:
        """The arm for the next step of a request in `domain` (from past steps only), never one
        whose draft is in `unavailable` (plain decoding always stays)."""
        if not isinstance(domain, str) or not domain:
            raise ValueError(f"domain must be a non-empty str (see resolve_domain), got {domain!r}")
        with self._lock:
            exclude = self._retired.union(*(self._arms_of.get(name, ()) for name in unavailable))
            return self.arms[self._domain(domain).bandit.select(exclude)]

    def _free_seconds(self, domain: DomainState, i: int, proposed: int, context: int, draft_seconds: float,
                      fallback: float) -> float:
        """What a step of free arm i proposing `proposed` tokens after `context` would have cost:
        its measured drafting time plus this domain's price of a single-row verify pass over
        `proposed` + 1 tokens there. Before any price (no calibration, no pass in this domain):
        arm i's mean step time in this domain, else in all domains, else `fallback` (the step's
        own time)."""
        verify = domain.verify_estimate(proposed + 1, context)
        if verify is not None:
            return draft_seconds + verify
        t = domain.tallies[i]
        if t.pulls:
            return t.seconds_sum / t.pulls
        pulls = sum(d.tallies[i].pulls for d in self._domains.values())
        if pulls:
            return sum(d.tallies[i].seconds_sum for d in self._domains.values()) / pulls
        return fallback

    def _shorter_gamma(self, state: DomainState, record: StepRecord) -> list[tuple[int, int, float]]:
        """The same model draft at each smaller γ, scored from this step: [(arm, emitted, seconds)]."""
        drafted = record.drafted
        if record.rows != 1 or drafted < 2 or record.arm.draft in self._free_names:
            return []
        out = []
        for i, arm in enumerate(self.arms):
            if arm.draft == record.arm.draft and arm.gamma < drafted:
                verify = state.verify_estimate(arm.gamma + 1, record.context_len)
                if verify is None:
                    verify = record.steady_verify_seconds  # unmeasured: the longer pass's time
                drafting = record.draft_seconds - record.catchup_seconds
                seconds = record.catchup_seconds + drafting * arm.gamma / drafted + verify
                out.append((i, min(record.accepted, arm.gamma) + 1, seconds))
        return out

    def update(self, record: StepRecord) -> None:
        """Learn from a finished step: its own goodput, the same draft at smaller γ, and free
        drafts scored after the fact.

        A request's first step (`prefilled`) rewards no arm: its first token came from the
        prefill's forward, nearly free, and counted it would pull the arm's mean step time toward
        zero and overrate it. Its proposal still starts the copy drafts' paths."""
        check_record(record, self._index)
        with self._lock:
            state = self._domain(record.domain)
            fed = record.drafted + (0 if record.prefilled else 1)  # a prefilled first token fed nothing
            if record.rows == 1 and fed:
                state.add_pass(fed, record.steady_verify_seconds, record.context_len)
            free: dict[str, list[tuple[int, int, float]]] = {}
            for c in self._copies.step(record):
                seconds = self._free_seconds(self._domain(c.domain), c.arm, c.proposed, c.context, c.draft_seconds,
                                             c.step_seconds)
                free.setdefault(c.domain, []).append((c.arm, c.emitted, seconds))
            free.setdefault(record.domain, [])
            plain = self._plain_seconds(state, record.context_len)
            if not record.prefilled:
                free[record.domain].extend(self._shorter_gamma(state, record))
                if record.arm.gamma and plain is not None:  # plain decoding: a token per row per one-token pass
                    free[record.domain].append((self._plain, record.rows, plain))
            ran = None if record.prefilled else record
            for domain in sorted(set(free) | {record.domain}, key=lambda d: d != record.domain):
                self._learn(domain, ran if domain == record.domain else None, free.get(domain, []))

    def _plain_seconds(self, state: DomainState, context: int | None = None) -> float | None:
        """What a one-token pass after `context` costs in this domain: measured here (or
        calibrated), else the mean of the other domains' prices (a pass costs about the same
        whatever the domain), else None. Plain decoding is never explored, so a domain must not
        wait for its own."""
        own = state.verify_seconds(1, context)
        if own is not None:
            return own
        others = [t for d in self._domains.values() if (t := d.verify_seconds(1, context)) is not None]
        return sum(others) / len(others) if others else None

    def _scale(self, state: DomainState) -> float | None:
        """The goodput that earns reward 1 in this domain (tokens/s), None before any evidence."""
        plain = self._plain_seconds(state)
        return self._tokens_at_one / plain if plain else state.stored_scale

    @staticmethod
    def _reward(scale: float | None, goodput: float) -> float:
        if not scale:  # no plain step measured yet: every arm alike (the first steps of a domain)
            return 0.5
        return min(1.0, goodput / scale)

    def _learn(self, domain: str, record: StepRecord | None, free: list[tuple[int, int, float]]) -> None:
        """Bandit rounds of `domain`: the arm that ran (if `record`) and the free scorings resolved
        now, one reward per arm per round (an arm resolved twice gets a second round)."""
        state = self._domain(domain)
        scale = self._scale(state)  # fixed during these rounds: they change tallies, not verify passes
        rounds: list[dict[int, float]] = [{}]
        ran = goodput = seconds = None
        if record is not None:
            seconds = record.seconds - record.warmup_seconds  # one-time work is nobody's cost
            goodput = record.emitted / seconds
            ran = self._index[record.arm]
            t = state.tallies[ran]
            # A model draft's catch-up (its prefill of what it has not seen) is charged to its arm:
            # the router pays it every time it tries the draft in a request, and after a long
            # retrieval prompt it costs many plain steps; left out, the router would keep trying it.
            rounds[0][ran] = self._reward(scale, record.emitted / t.mean_seconds(seconds))
            t.pulls += 1
            t.goodput_sum += goodput
            t.seconds_sum += seconds
            state.steps += 1
        for i, emitted, free_seconds in free:
            reward = self._reward(scale, emitted / state.tallies[i].mean_seconds(free_seconds))
            for slot in rounds:
                if i not in slot:
                    break
            else:
                slot = {}
                rounds.append(slot)
            slot[i] = reward
            state.tallies[i].scored += 1
        for rewards in rounds:
            if rewards:
                state.bandit.update_many(rewards)
        if self._writes.active:  # the increments only a store needs
            deltas: dict[str, ArmDelta] = {}
            if ran is not None:
                assert goodput is not None and seconds is not None  # measured whenever an arm ran
                deltas[self._names[ran]] = ArmDelta(pulls=1, goodput_sum=goodput, seconds_sum=seconds)
            for i, _, _ in free:
                deltas.setdefault(self._names[i], ArmDelta()).scored += 1
            for rewards in rounds:
                for i, r in rewards.items():
                    d = deltas.setdefault(self._names[i], ArmDelta())
                    d.reward_n += 1.0
                    d.reward_sum += r
                    d.reward_sumsq += r * r
            if deltas:
                self._writes.add(domain, deltas, scale)  # written when flushed (store_writer.py)

    def flush(self) -> None:
        """Write queued statistics to the store (the engine's scheduler calls this off its device
        thread). Not under the router's lock: a write that waits on a locked file must not hold
        up `select` and `update`. A failed write keeps its statistics queued (store_writer.py)."""
        self._writes.flush()

    def verify_costs(self) -> dict[str, dict[int, tuple[float | None, int]]]:
        """Per domain, tokens fed -> (the seconds a verify pass is priced at, passes kept): the
        cost model copy drafts are scored with, for benchmarks to print."""
        with self._lock:
            return {d: {n: (s.verify_seconds(n), len(kept)) for n, kept in sorted(s.verify.items())}
                    for d, s in self._domains.items()}

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Per domain, per arm: real pulls, mean measured goodput (tokens/s, None if never
        pulled), full-information scorings, and the bandit's mean normalised reward."""
        with self._lock:
            out: dict[str, dict[str, dict[str, Any]]] = {}
            for domain, state in self._domains.items():
                means = state.bandit.means()
                out[domain] = {
                    str(arm): {
                        "pulls": t.pulls,
                        "mean_goodput": t.goodput_sum / t.pulls if t.pulls else None,
                        "scored": t.scored,
                        "mean_reward": means[i],
                    }
                    for i, (arm, t) in enumerate(zip(self.arms, state.tallies))
                }
            return out
