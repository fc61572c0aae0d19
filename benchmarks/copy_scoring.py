"""Does the router's after-the-fact score of a copy draft match what the draft really does?

The router never explores copy drafts: it scores them on every request whichever arm ran
(routing/copy_scoring.py) and prices their passes with its cost model (routing/forward_costs.py).
If those scores are biased, it picks the wrong arm with confidence. This runs the same agent steps
once per fixed arm, each engine with its own drafts and a Thompson router that learns from every
step but always runs that arm, and prints per domain:

- real: tokens per second of step time with that arm fixed, over plain decoding's (`none` row);
- estimate while plain decoding ran: the router's mean reward for that arm over plain decoding's,
  learned only from after-the-fact scoring (what a router that has not run the arm believes);
- estimate while the arm ran: the same, on the engine that ran it.

    python benchmarks/copy_scoring.py --workload loop --steps 16

results.json keeps the table; copy_scoring.png plots real against estimated speed-ups.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.backends.calibration import machine_line
from flashspec_core.engine import SpecEngine
from flashspec_core.loading import default_drafts, load_target
from flashspec_core.routing.router import BanditRouter
from flashspec_integrations.demo import ADAPTER_HINTS
from flashspec_workloads.agent import agent_workload

NONE = Arm(NO_DRAFT, 0)


class PinnedRouter(BanditRouter):
    """Learns like the engine's router; always runs one arm."""

    def __init__(self, pinned: Arm, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pinned = pinned

    def select(self, domain: str, unavailable: frozenset[str] = frozenset()) -> Arm:
        return self.pinned


def estimates(router: BanditRouter) -> dict[str, dict[str, float]]:
    """Per domain, arm -> its mean reward over plain decoding's."""
    out = {}
    for domain, arms in router.summary().items():
        plain = arms[str(NONE)]["mean_reward"]
        out[domain] = {a: v["mean_reward"] / plain for a, v in arms.items() if (v["scored"] or v["pulls"]) and plain}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("independent", "loop"), default="loop")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--arms", default="prompt_lookup@2,prompt_lookup@4,suffix_cache@2")
    parser.add_argument("--out", default="bench_out/copy_scoring")
    args = parser.parse_args()

    target = load_target(None)
    runs = [NONE] + [Arm(n, int(g)) for n, _, g in (a.partition("@") for a in args.arms.split(","))]
    engines = {}
    for arm in runs:
        drafts = default_drafts(target)  # each engine its own: the suffix cache learns from its outputs
        free = {d.name: d for d in drafts if d.deterministic}
        every = [NONE] + [Arm(n, g) for n in free for g in (2, 4, 8)]
        engines[arm] = SpecEngine(target, drafts, router=PinnedRouter(arm, every, free_drafts=free, seed=0),
                                  gammas=[2, 4, 8], backend="hf")
    steps = agent_workload(kind=args.workload, n_steps=args.steps, seed=0, max_new_tokens=args.max_new_tokens,
                           split="heldout")
    encode = engines[NONE].encode
    real = {arm: defaultdict(lambda: [0, 0.0]) for arm in runs}  # domain -> [tokens, step seconds]
    start = time.time()
    for step in tqdm(steps, desc="steps, every arm in turn"):
        ids = encode([step.messages], step.max_new_tokens)[0]
        for arm, engine in engines.items():
            res = engine.generate(ids, max_new_tokens=step.max_new_tokens,
                                  hint=step.domain if step.domain in ADAPTER_HINTS else None)
            acc = real[arm][res.stats.domain]
            acc[0] += sum(r.emitted for r in res.stats.records)
            acc[1] += sum(r.seconds for r in res.stats.records)
    believed = {arm: estimates(engine.router) for arm, engine in engines.items()}
    rows = []
    for domain in sorted(real[NONE]):
        plain = real[NONE][domain][0] / real[NONE][domain][1]
        for arm in runs[1:]:
            tokens, seconds = real[arm][domain]
            rows.append({"domain": domain, "arm": str(arm), "real": tokens / seconds / plain,
                         "estimate_plain_ran": believed[NONE].get(domain, {}).get(str(arm)),
                         "estimate_arm_ran": believed[arm].get(domain, {}).get(str(arm))})
    fmt = lambda x: f"{x:8.2f}x" if x is not None else f"{'-':>9}"
    lines = [machine_line(),
             f"workload={args.workload}, {args.steps} steps, greedy, max_new_tokens={args.max_new_tokens}; "
             f"speed-ups over plain decoding, tokens per second of step time; {time.time() - start:.0f} s",
             f"{'domain':<7}{'arm':<18}{'real':>9}{'est. (plain ran)':>18}{'est. (arm ran)':>16}"]
    lines += [f"{r['domain']:<7}{r['arm']:<18}{fmt(r['real'])}{fmt(r['estimate_plain_ran']):>18}"
              f"{fmt(r['estimate_arm_ran']):>16}" for r in rows]
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": machine_line(), "args": vars(args), "rows": rows},
                                                 indent=1))
    plot(rows, out / "copy_scoring.png", lines[0])
    print(f"plot: {out / 'copy_scoring.png'}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for key, marker, label in (("estimate_plain_ran", "o", "estimated while plain decoding ran"),
                               ("estimate_arm_ran", "s", "estimated while the arm ran")):
        pts = [(r["real"], r[key]) for r in rows if r[key] is not None]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
    lo = min([r["real"] for r in rows] + [0.5])
    hi = max([r["real"] for r in rows] + [r[k] for r in rows for k in ("estimate_plain_ran", "estimate_arm_ran")
                                          if r[k] is not None] + [1.5])
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1, label="estimate = real")
    ax.set_xlabel("real speed-up over plain decoding (arm fixed)")
    ax.set_ylabel("router's estimated speed-up")
    ax.set_title(title, fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
