"""Bandit simulations: the seed paper's Bernoulli benchmark and a domain-switching goodput stream.

1. Stationary (the paper's setup): K = 3 Bernoulli arms with rates 0.30 / 0.70 / 0.50,
   T = 10,000 rounds, 5 seeds, pseudo-regret sum_t (mu* - mu_{a_t}). The paper reports
   UCB1 100.2 and Thompson sampling 18.9. Also run with full-information updates (every arm's
   reward is observed each round, as the router gets for free drafts), and over more seeds to
   show how much five seeds move the mean.
2. Switching: an agent-like stream whose domain (and with it the best arm) changes every
   200-500 rounds; halfway through, one domain drifts (its best arm changes). Arms are
   (draft, γ) with simulated acceptance and step times; the reward is goodput. Compares the
   domain-keyed discounted router (`BanditRouter(..., "thompson-discounted")`) with plain UCB1
   and Thompson sampling that ignore the domain (the same router keyed by one constant domain),
   by dynamic regret: sum_t (g*_{d_t} - g_{d_t, a_t}) / g*_{d_t}, i.e. steps' worth of goodput lost
   against an oracle that knows every domain's current best arm.

Prints tables and writes a plot (`--out`). Never asserts on numbers: this is a measurement.

    PYTHONPATH=. python benchmarks/bandit_sim.py --out bench_out/bandit_sim.png
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.records import StepRecord
from flashspec_core.routing import UCB1, BanditRouter, ThompsonSampling

RATES = (0.30, 0.70, 0.50)
PAPER = {"UCB1": 100.2, "Thompson (Beta)": 18.9}

BANDITS: dict[str, Callable[[int], object]] = {
    "UCB1": lambda seed: UCB1(len(RATES), seed=seed),
    "Thompson (Beta)": lambda seed: ThompsonSampling(len(RATES), posterior="beta", seed=seed),
    "Thompson (Normal-Gamma)": lambda seed: ThompsonSampling(len(RATES), posterior="normal", seed=seed),
}


def stationary_run(make: Callable[[int], object], seed: int, horizon: int, full_info: bool) -> list[float]:
    """Cumulative pseudo-regret after each round for one seed."""
    bandit = make(seed)
    env = random.Random(10_000 + seed)  # the environment's draws do not depend on the algorithm
    best = max(RATES)
    regret, curve = 0.0, []
    for _ in range(horizon):
        arm = bandit.select()
        draws = [1.0 if env.random() < r else 0.0 for r in RATES]
        if full_info:
            bandit.update_many(dict(enumerate(draws)))
        else:
            bandit.update(arm, draws[arm])
        regret += best - RATES[arm]
        curve.append(regret)
    return curve


# Switching simulation: arms, domains, and a simple cost model of a speculative step.
ARMS = (Arm(NO_DRAFT, 0), Arm("ngram", 4), Arm("model", 2), Arm("model", 4))
VERIFY_S, VERIFY_PER_TOKEN_S = 0.030, 0.002  # target forward for 1 + γ positions
DRAFT_S = {"ngram": (0.0003, 0.0), "model": (0.0, 0.006)}  # (per step, per proposed token)
# Per-token acceptance rate of each draft in each domain (before, after the drift).
ACCEPT = {
    "chat": ({"ngram": 0.15, "model": 0.75}, None),
    "tool": ({"ngram": 0.85, "model": 0.60}, None),
    "math": ({"ngram": 0.05, "model": 0.30}, {"ngram": 0.80, "model": 0.30}),  # drifts at T/2
}
NOISE = 0.05  # log-normal spread of step times


def step_seconds(arm: Arm) -> tuple[float, float]:
    if arm.draft == NO_DRAFT:
        return 0.0, VERIFY_S
    per_step, per_token = DRAFT_S[arm.draft]
    return per_step + per_token * arm.gamma, VERIFY_S + VERIFY_PER_TOKEN_S * arm.gamma


def expected_goodput(arm: Arm, alpha: float) -> float:
    """E[emitted] / step time, with emitted = accepted prefix + 1 (truncated geometric)."""
    draft_s, verify_s = step_seconds(arm)
    if arm.gamma == 0:
        return 1.0 / verify_s
    emitted = (1.0 - alpha ** (arm.gamma + 1)) / (1.0 - alpha)
    return emitted / (draft_s + verify_s)


def acceptance(domain: str, t: int, horizon: int) -> dict[str, float]:
    before, after = ACCEPT[domain]
    return after if after is not None and t >= horizon // 2 else before


def domain_stream(seed: int, horizon: int) -> list[str]:
    """Runs of 200-500 rounds, each in a domain different from the previous run's."""
    rng = random.Random(seed)
    names = sorted(ACCEPT)
    stream: list[str] = []
    current = rng.choice(names)
    while len(stream) < horizon:
        stream += [current] * rng.randint(200, 500)
        current = rng.choice([d for d in names if d != current])
    return stream[:horizon]


def switching_run(algorithm: str, keyed: bool, seed: int, horizon: int) -> list[float]:
    """Cumulative dynamic regret (in steps' worth of goodput) for one router configuration."""
    router = BanditRouter(ARMS, algorithm, seed=seed)
    env = random.Random(20_000 + seed)
    regret, curve = 0.0, []
    for t, domain in enumerate(domain_stream(seed, horizon)):
        alphas = acceptance(domain, t, horizon)
        goodputs = [expected_goodput(a, alphas.get(a.draft, 0.0)) for a in ARMS]
        arm = router.select(domain if keyed else "all")
        accepted = 0
        while accepted < arm.gamma and env.random() < alphas.get(arm.draft, 0.0):
            accepted += 1
        draft_s, verify_s = step_seconds(arm)
        noise = env.lognormvariate(0.0, NOISE)
        router.update(StepRecord(domain if keyed else "all", arm, arm.gamma, accepted,
                                 accepted + 1, draft_s * noise, verify_s * noise))
        best = max(goodputs)
        regret += (best - goodputs[ARMS.index(arm)]) / best
        curve.append(regret)
    return curve


SWITCHING = (  # (label, algorithm, keyed by domain)
    ("UCB1 (no domain)", "ucb1", False),
    ("Thompson (no domain)", "thompson", False),
    ("Thompson, domain-keyed", "thompson", True),
    ("UCB1, domain-keyed, discounted", "ucb1-discounted", True),
    ("Thompson, domain-keyed, discounted", "thompson-discounted", True),
)


def mean_curve(curves: Sequence[Sequence[float]]) -> list[float]:
    return [statistics.fmean(col) for col in zip(*curves)]


def summarise(finals: Sequence[float]) -> str:
    sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
    return f"{statistics.fmean(finals):8.1f} ± {sd:5.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out/bandit_sim.png", help="where to write the plot")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per configuration (paper: 5)")
    parser.add_argument("--horizon", type=int, default=10_000, help="rounds per run (paper: 10,000)")
    parser.add_argument("--check-seeds", type=int, default=40,
                        help="extra seeds for the stationary bandit-feedback check (0 skips it)")
    args = parser.parse_args(argv)
    for name in ("seeds", "horizon"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.check_seeds < 0:
        parser.error("--check-seeds must be >= 0")
    started = time.perf_counter()
    seeds = range(args.seeds)

    print(f"Stationary Bernoulli bandit: rates {RATES}, T={args.horizon}, seeds 0-{args.seeds - 1}")
    print(f"{'algorithm':<26}{'feedback':<12}{'pseudo-regret (mean ± sd)':>28}{'paper':>8}")
    stationary_curves: dict[tuple[str, bool], list[float]] = {}
    for full_info in (False, True):
        for name, make in BANDITS.items():
            curves = [stationary_run(make, s, args.horizon, full_info) for s in seeds]
            stationary_curves[(name, full_info)] = mean_curve(curves)
            comparable = name in PAPER and not full_info and args.horizon == 10_000
            paper = f"{PAPER[name]:8.1f}" if comparable else f"{'':>8}"
            feedback = "full-info" if full_info else "bandit"
            print(f"{name:<26}{feedback:<12}{summarise([c[-1] for c in curves]):>28}{paper}")
    if args.check_seeds:
        print(f"\nBandit feedback over {args.check_seeds} seeds (how far 5 seeds sit from the mean):")
        for name, make in BANDITS.items():
            finals = [stationary_run(make, s, args.horizon, False)[-1] for s in range(args.check_seeds)]
            print(f"{name:<26}{'bandit':<12}{summarise(finals):>28}")

    stream = domain_stream(0, args.horizon)
    runs = sum(1 for i in range(1, len(stream)) if stream[i] != stream[i - 1]) + 1
    print(f"\nSwitching stream: domains {sorted(ACCEPT)}, runs of 200-500 rounds "
          f"({runs} runs in seed 0), 'math' drifts at T/2, arms {[str(a) for a in ARMS]}")
    for domain in sorted(ACCEPT):
        for phase, t in (("before", 0), ("after", args.horizon)):
            if phase == "after" and ACCEPT[domain][1] is None:
                continue
            g = {str(a): expected_goodput(a, acceptance(domain, t, args.horizon).get(a.draft, 0.0))
                 for a in ARMS}
            best = max(g, key=g.__getitem__)
            cells = "  ".join(f"{k}={v:5.1f}" for k, v in g.items())
            print(f"  {domain:<5} {phase:<7} goodput tok/s: {cells}   best: {best}")
    print(f"{'router':<38}{'dynamic regret (mean ± sd)':>28}{'per 1k rounds':>15}")
    switching_curves: dict[str, list[float]] = {}
    for label, algorithm, keyed in SWITCHING:
        curves = [switching_run(algorithm, keyed, s, args.horizon) for s in seeds]
        switching_curves[label] = mean_curve(curves)
        finals = [c[-1] for c in curves]
        per_k = 1000 * statistics.fmean(finals) / args.horizon
        print(f"{label:<38}{summarise(finals):>28}{per_k:>15.1f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for (name, full_info), curve in stationary_curves.items():
        ax1.plot(curve, label=f"{name}{' full-info' if full_info else ''}",
                 linestyle="--" if full_info else "-")
    ax1.set(title=f"Stationary Bernoulli {RATES}, mean of {args.seeds} seeds",
            xlabel="round", ylabel="cumulative pseudo-regret")
    ax1.legend(fontsize=8)
    for label, curve in switching_curves.items():
        ax2.plot(curve, label=label)
    for i in range(1, len(stream)):
        if stream[i] != stream[i - 1]:
            ax2.axvline(i, color="0.85", linewidth=0.6, zorder=0)
    ax2.axvline(args.horizon // 2, color="0.4", linestyle=":", linewidth=1)
    ax2.set(title="Domain-switching goodput stream (grey: seed-0 domain switches; dotted: drift)",
            xlabel="round", ylabel="cumulative dynamic regret (steps of goodput)")
    ax2.title.set_fontsize(9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"\nplot: {out}   ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
