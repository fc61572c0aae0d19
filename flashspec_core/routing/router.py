"""Routers: pick the arm (draft source, γ) for each decode step from the domain and past steps.

`BanditRouter` keeps one bandit per domain, because the draft that pays for a tool call (copying
a schema) is rarely the one that pays for chat. The reward is goodput, tokens emitted per second
of step time (draft + verify), because acceptance alone ignores what drafting costs: a long γ
with a slow draft can accept more and still be slower than plain decoding, which is why
`Arm(NO_DRAFT, 0)` is always an arm. Goodput is normalised per domain into [0, 1] by a running
high quantile of that domain's measured goodput (robust to one freak fast step, unlike a max).

Deterministic drafts (prompt lookup, suffix cache) are cheap to run and have no side effects, so
after every step the router also asks each of them what it would have proposed from the same
context and scores that against the tokens verified from there on, once enough of them are
known (full-information updates): their arms learn on every step, whichever arm ran. Only
finished steps are used, never the current one (exactness invariant): `update` runs after the
step's tokens are final.

`FixedRouter` always returns one arm; it is the engine's baseline and fallback.
"""
from __future__ import annotations

import sqlite3
import threading
import warnings
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from flashspec_core.drafts.base import DraftSource
from flashspec_core.routing.bandits import UCB1, ThompsonSampling, Bandit
from flashspec_core.routing.store import ArmDelta, RouterStore
from flashspec_core.sampling import SamplingParams
from flashspec_core.types import NO_DRAFT, Arm, StepRecord

# Evidence half-life of ~140 steps within a domain: on the switching simulation (benchmarks/
# bandit_sim.py) 0.995 lost less than 0.98 or 0.99 (more exploration) and no more than 0.998.
DEFAULT_DISCOUNT = 0.995
ALGORITHMS = ("thompson", "ucb1", "thompson-discounted", "ucb1-discounted")
_SCALE_WINDOW = 256
_MAX_PENDING = 64  # free-arm scorings waiting for verified tokens; past this, all are scored as they stand
_SCALE_QUANTILE = 0.95


def _check_record(record: StepRecord, index: Mapping[Arm, int]) -> None:
    if not isinstance(record, StepRecord):
        raise ValueError(f"record must be a StepRecord, got {type(record).__name__}")
    if not isinstance(record.domain, str) or not record.domain:
        raise ValueError(f"record.domain must be a non-empty str, got {record.domain!r}")
    if record.arm not in index:
        raise ValueError(f"record.arm {record.arm} is not one of the router's arms {list(index)}")
    if record.emitted < 0:
        raise ValueError(f"record.emitted must be >= 0, got {record.emitted}")
    if not record.seconds > 0:
        raise ValueError(
            f"record.seconds (draft_seconds + verify_seconds) must be > 0, got {record.seconds}; "
            "time the step with time.perf_counter()"
        )


class FixedRouter:
    """Always the same arm; still tallies steps so `summary()` reads like the bandit router's."""

    def __init__(self, arm: Arm) -> None:
        if not isinstance(arm, Arm):
            raise ValueError(f"arm must be an Arm, e.g. Arm('ngram', 4), got {arm!r}")
        self.arm = arm
        self.arms: tuple[Arm, ...] = (arm,)
        self._tally: dict[str, list[float]] = {}

    def select(self, domain: str) -> Arm:
        return self.arm

    def update(self, record: StepRecord) -> None:
        _check_record(record, {self.arm: 0})
        t = self._tally.setdefault(record.domain, [0, 0.0])
        t[0] += 1
        t[1] += record.emitted / record.seconds

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {
            d: {str(self.arm): {"pulls": int(n), "mean_goodput": g / n if n else None}}
            for d, (n, g) in self._tally.items()
        }


class _GoodputScale:
    """Per-domain reward scale: a high quantile of the last few hundred measured goodputs."""

    def __init__(self, initial: float | None = None) -> None:
        self.values: deque[float] = deque(maxlen=_SCALE_WINDOW)
        if initial is not None and initial > 0:
            self.values.append(float(initial))

    def add(self, goodput: float) -> None:
        self.values.append(goodput)

    @property
    def scale(self) -> float | None:
        if not self.values:
            return None
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, int(_SCALE_QUANTILE * len(ordered)))]

    def reward(self, goodput: float) -> float:
        scale = self.scale
        if not scale or scale <= 0:
            return 1.0 if goodput > 0 else 0.0
        return min(1.0, max(0.0, goodput / scale))


@dataclass
class _Tally:
    """Raw (un-normalised) per-(domain, arm) counters for `summary()` and step-time estimates."""

    pulls: int = 0
    scored: int = 0
    goodput_sum: float = 0.0
    seconds_sum: float = 0.0


@dataclass
class _Pending:
    """Free arms' proposals from one step's context, waiting for the tokens that will score them."""

    domain: str
    sequence: Sequence[int]  # the step's live token list: later steps of the request extend it
    context_len: int
    rows: int
    seconds: float  # the step's time: the stand-in for an arm with no measured time of its own
    proposals: dict[int, list[int]]  # arm index -> proposed tokens


@dataclass
class _Domain:
    bandit: Bandit
    scale: _GoodputScale
    tallies: list[_Tally]
    steps: int = 0


class BanditRouter:
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
        self.seed = seed
        self._index = {a: i for i, a in enumerate(self.arms)}
        # Arms scored for free on every step: (arm index, draft, γ).
        self._free = [(i, free_drafts[a.draft], a.gamma)
                      for i, a in enumerate(self.arms) if a.draft in free_drafts]
        self._domains: dict[str, _Domain] = {}
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self._store_failed = False
        if store is not None:
            self._load(store)

    def _new_bandit(self, domain: str) -> Bandit:
        seed = None if self.seed is None else (self.seed * 1_000_003 + zlib.crc32(domain.encode())) % 2**63
        cls = ThompsonSampling if self.algorithm.startswith("thompson") else UCB1
        return cls(len(self.arms), discount=self.discount, seed=seed)

    def _cap(self) -> float:
        """Most evidence a discounted bandit can hold per arm (its effective memory)."""
        return float("inf") if self.discount >= 1.0 else 1.0 / (1.0 - self.discount)

    def _load(self, store: RouterStore) -> None:
        names = {str(a): i for i, a in enumerate(self.arms)}
        for domain, stats in store.load().items():
            state = self._domains[domain] = _Domain(
                self._new_bandit(domain), _GoodputScale(stats.scale),
                [_Tally() for _ in self.arms], stats.steps,
            )
            n, s, q = [0.0] * len(self.arms), [0.0] * len(self.arms), [0.0] * len(self.arms)
            for arm_name, d in stats.arms.items():
                i = names.get(arm_name)
                if i is None or d.reward_n <= 0:
                    continue  # an arm this router was not configured with
                shrink = min(1.0, self._cap() / d.reward_n)
                n[i], s[i], q[i] = d.reward_n * shrink, d.reward_sum * shrink, d.reward_sumsq * shrink
                state.tallies[i] = _Tally(d.pulls, d.scored, d.goodput_sum, d.seconds_sum)
            state.bandit.add_prior(n, s, q)
            state.bandit.steps = min(max(state.bandit.steps, float(stats.steps)), self._cap())

    def _domain(self, domain: str) -> _Domain:
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
        state = self._domains[domain] = _Domain(bandit, _GoodputScale(), [_Tally() for _ in range(k)])
        return state

    def select(self, domain: str) -> Arm:
        """The arm for the next step of a request in `domain` (from past steps only)."""
        if not isinstance(domain, str) or not domain:
            raise ValueError(f"domain must be a non-empty str (see resolve_domain), got {domain!r}")
        with self._lock:
            return self.arms[self._domain(domain).bandit.select()]

    def _step_seconds(self, domain: _Domain, i: int, fallback: float) -> float:
        """Mean measured step time of arm i: this domain's; else that of this domain's free arms of
        the same γ (copy drafts cost next to nothing, so their steps cost what verifying γ + 1
        tokens does); else arm i's in all domains; else `fallback`."""
        t = domain.tallies[i]
        if t.pulls:
            return t.seconds_sum / t.pulls
        gamma = self.arms[i].gamma
        peers = [domain.tallies[j] for j, _, g in self._free if g == gamma and domain.tallies[j].pulls]
        if peers:
            return sum(p.seconds_sum for p in peers) / sum(p.pulls for p in peers)
        pulls = sum(d.tallies[i].pulls for d in self._domains.values())
        if pulls:
            return sum(d.tallies[i].seconds_sum for d in self._domains.values()) / pulls
        return fallback

    def _propose_free(self, record: StepRecord) -> _Pending | None:
        """What each free arm would have proposed from this step's context, to score later."""
        ctx, seq = record.context_len, record.sequence
        if not self._free or ctx <= 0 or len(seq) <= ctx:
            return None
        context = [int(t) for t in seq[:ctx]]  # a copy: drafts must not see or touch the live list
        sampling = SamplingParams()
        proposals = {i: [int(t) for t in draft.propose([list(context)], gamma, sampling).tokens[0][:gamma]]
                     for i, draft, gamma in self._free if self.arms[i] != record.arm}
        return _Pending(record.domain, seq, ctx, record.rows, record.seconds, proposals) if proposals else None

    def _resolve(self, pending: _Pending, final: bool) -> dict[int, int]:
        """Tokens each free arm of `pending` would have emitted, for the arms whose count is known.

        Emitted = matched + 1: the verifier accepts the matching prefix and then emits one target
        token (the correction, or the bonus after a full match). The count is known once a
        mismatch shows or every proposed token has been verified. The tokens after the step's own
        come from later steps of the same request, which is why scoring waits for them: scored at
        once, a draft would be capped at the one token a plain step verifies. `final` (the
        request has moved on) scores what is left against what was verified.
        """
        verified = [int(t) for t in pending.sequence[pending.context_len:]]
        out = {}
        for i, proposal in list(pending.proposals.items()):
            matched = 0
            for p, v in zip(proposal, verified):
                if p != v:
                    break
                matched += 1
            if final or matched < min(len(proposal), len(verified)) or len(verified) >= len(proposal):
                out[i] = (matched + 1) * pending.rows  # a batch step emits for every active row
                del pending.proposals[i]
        return out

    def _free_rewards(self, record: StepRecord) -> dict[str, list[tuple[int, int, float]]]:
        """Resolve pending free-arm scorings: domain -> [(arm index, tokens emitted, stand-in seconds)]."""
        new = self._propose_free(record)
        if new is not None:
            self._pending.append(new)
        out: dict[str, list[tuple[int, int, float]]] = {}
        keep: deque[_Pending] = deque()
        for pending in self._pending:
            final = pending.sequence is not record.sequence or len(self._pending) > _MAX_PENDING
            for i, emitted in self._resolve(pending, final).items():
                out.setdefault(pending.domain, []).append((i, emitted, pending.seconds))
            if pending.proposals:
                keep.append(pending)
        self._pending = keep
        return out

    def update(self, record: StepRecord) -> None:
        """Learn from a finished step: its own goodput, plus free drafts scored after the fact."""
        _check_record(record, self._index)
        with self._lock:
            free = self._free_rewards(record)
            for domain in sorted(set(free) | {record.domain}, key=lambda d: d != record.domain):
                self._learn(domain, record if domain == record.domain else None, free.get(domain, []))

    def _learn(self, domain: str, record: StepRecord | None, free: list[tuple[int, int, float]]) -> None:
        """Bandit rounds of `domain`: the arm that ran (if `record`) and the free scorings resolved
        now, one reward per arm per round (an arm resolved twice gets a second round)."""
        state = self._domain(domain)
        rounds: list[dict[int, float]] = [{}]
        deltas: dict[str, ArmDelta] = {}
        if record is not None:
            goodput = record.emitted / record.seconds
            state.scale.add(goodput)
            ran = self._index[record.arm]
            rounds[0][ran] = state.scale.reward(goodput)
            deltas[str(record.arm)] = ArmDelta(pulls=1, goodput_sum=goodput, seconds_sum=record.seconds)
            t = state.tallies[ran]
            t.pulls += 1
            t.goodput_sum += goodput
            t.seconds_sum += record.seconds
            state.steps += 1
        for i, emitted, seconds in free:
            reward = state.scale.reward(emitted / self._step_seconds(state, i, seconds))
            slot = next((r for r in rounds if i not in r), None)
            if slot is None:
                slot = {}
                rounds.append(slot)
            slot[i] = reward
            state.tallies[i].scored += 1
            deltas.setdefault(str(self.arms[i]), ArmDelta()).scored += 1
        for rewards in rounds:
            if not rewards:
                continue
            state.bandit.update_many(rewards)
            for i, r in rewards.items():
                d = deltas.setdefault(str(self.arms[i]), ArmDelta())
                d.reward_n += 1.0
                d.reward_sum += r
                d.reward_sumsq += r * r
        if deltas:
            self._persist(domain, deltas, state.scale.scale)

    def _persist(self, domain: str, deltas: dict[str, ArmDelta], scale: float | None) -> None:
        if self.store is None or self._store_failed:
            return
        try:
            self.store.record(domain, deltas, scale=scale)
        except sqlite3.Error as exc:
            # Routing must never stop generation: keep learning in memory, say so once.
            self._store_failed = True
            warnings.warn(
                f"router store write failed ({exc}); statistics stay in memory from now on",
                RuntimeWarning,
                stacklevel=3,
            )

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
