"""Side-by-side tokens/s on the mixed agent dev workload, in one run on one machine.

Configurations: plain HF `generate`, HF prompt-lookup assisted generation, the engine with each
fixed arm (a draft source and γ), and the engine with the Thompson router, once with fresh
statistics ("router (cold)") and once after an untimed warm-up on the `--warmup` steps that
precede the measured ones in the same stream ("router (warm)"). The router's statistics persist
across runs by default, so the warm figure is the steady state and the cold one the first minutes
after installation. Warm-up prompts are disjoint from the measured ones, and the fixed
suffix-cache arms get the same warm-up (their cache also persists across requests), so the warm
router gets no head start on copies. The HF baselines run a separate stock copy of the model
(the engine swaps its CPU linear layers). All decode greedily, so every configuration must
produce the same tokens; the table says how many steps matched HF exactly.
Tool and RAG steps get the domain hint an adapter would pass (demo.ADAPTER_HINTS); chat and
code are classified.

    python benchmarks/workload_bench.py --steps 16 --warmup 48 --max-new-tokens 48 --out bench_out/workload
    python benchmarks/workload_bench.py --fixed prompt_lookup@4,distill_chat@2 ...   # plain + these fixed arms

results.json keeps the table, the warm router's arm per step and its `router_summary()`.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from flashspec_core.demo import ADAPTER_HINTS, hf_generate, stock_default_model
from flashspec_core.engine import SpecEngine
from flashspec_core.pool import default_drafts, load_target
from flashspec_core.routing.router import FixedRouter
from flashspec_core.types import NO_DRAFT, Arm
from flashspec_workloads.dev import dev_workload


def hf_run(engine: SpecEngine, stock, steps, **generate_kwargs):
    for step in steps:
        tokens, seconds = hf_generate(engine, stock, step.messages, step.max_new_tokens, **generate_kwargs)
        yield tokens, seconds, None


def engine_run(engine: SpecEngine, steps):
    for step in steps:
        start = time.perf_counter()
        res = engine.generate(step.messages, max_new_tokens=step.max_new_tokens,
                              hint=step.domain if step.domain in ADAPTER_HINTS else None)
        yield res.token_ids, time.perf_counter() - start, res.stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=12, help="untimed steps before the measured ones (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gammas", default="2,4,8")
    parser.add_argument("--fixed", default=None,
                        help="comma list of drafts (every γ) or arms (name@γ) to pin as fixed arms (default: the whole pool)")
    parser.add_argument("--no-fixed", action="store_true", help="skip the fixed-arm configurations")
    parser.add_argument("--out", default="bench_out/workload")
    args = parser.parse_args()

    stream = dev_workload(args.warmup + args.steps, seed=args.seed, max_new_tokens=args.max_new_tokens)
    warmup, steps = stream[:args.warmup], stream[args.warmup:]
    gammas = [int(g) for g in args.gammas.split(",")]
    target = load_target(None)
    names = args.fixed.split(",") if args.fixed else [d.name for d in default_drafts(target)]
    fixed = [Arm(NO_DRAFT, 0)]
    for name in names:
        draft, _, gamma = name.partition("@")
        if draft == NO_DRAFT:
            continue  # always a fixed arm
        fixed += [Arm(draft, int(gamma))] if gamma else [Arm(draft, g) for g in gammas]

    def pool():
        return default_drafts(target)

    stock = stock_default_model()
    configs = {
        "hf_generate": lambda e: hf_run(e, stock, steps),
        "hf_prompt_lookup": lambda e: hf_run(e, stock, steps, prompt_lookup_num_tokens=10),
    }
    engines = {"hf_generate": SpecEngine(target, [], router=FixedRouter(Arm(NO_DRAFT, 0)))}
    engines["hf_prompt_lookup"] = engines["hf_generate"]
    if not args.no_fixed:
        for arm in fixed:
            key = f"fixed:{arm}"
            engines[key] = SpecEngine(target, pool(), router=FixedRouter(arm), gammas=gammas)
            configs[key] = lambda e: engine_run(e, steps)
    for key in ("router (cold)", "router (warm)"):
        engines[key] = SpecEngine(target, pool(), router="thompson", gammas=gammas)
        configs[key] = lambda e: engine_run(e, steps)
    for key, engine in engines.items():
        if warmup and (key == "router (warm)" or key.startswith("fixed:suffix_cache")):
            for _ in tqdm(engine_run(engine, warmup), total=len(warmup), desc=f"warm-up {key}"):
                pass

    results: dict[str, list[dict]] = {}
    for key, run in configs.items():
        rows = []
        for step, (tokens, seconds, stats) in tqdm(zip(steps, run(engines[key])), total=len(steps), desc=key):
            rows.append({"domain": step.domain, "tokens": tokens, "seconds": seconds,
                         "arms": stats.arms if stats else None, "resolved": stats.domain if stats else None})
        results[key] = rows
    report(results, steps, Path(args.out), args, engines["router (warm)"].router_summary())


def report(results, steps, out: Path, args, router_summary) -> None:
    out.mkdir(parents=True, exist_ok=True)
    reference = [r["tokens"] for r in results["hf_generate"]]
    domains = sorted({s.domain for s in steps})
    base = {}
    header = f"{'config':<26}" + "".join(f"{d:>9}" for d in domains) + f"{'overall':>9}{'vs HF':>7}{'same':>6}"
    print(f"\ntokens/s, greedy, {len(steps)} steps, max_new_tokens={args.max_new_tokens}\n{header}")
    table = {}
    for key, rows in results.items():
        per = defaultdict(lambda: [0, 0.0])
        for r in rows:
            per[r["domain"]][0] += len(r["tokens"])
            per[r["domain"]][1] += r["seconds"]
        overall = sum(v[0] for v in per.values()) / sum(v[1] for v in per.values())
        rates = {d: per[d][0] / per[d][1] for d in domains}
        base = base or {**rates, "overall": overall}
        same = sum(r["tokens"] == ref for r, ref in zip(rows, reference))
        table[key] = {**rates, "overall": overall, "same": same}
        print(f"{key:<26}" + "".join(f"{rates[d]:>9.1f}" for d in domains)
              + f"{overall:>9.1f}{overall / base['overall']:>6.2f}x{same:>4}/{len(rows)}")
    (out / "results.json").write_text(json.dumps({"table": table, "router_arms": [
        {"domain": r["domain"], "resolved": r["resolved"], "arms": r["arms"]} for r in results["router (warm)"]],
        "router_summary": router_summary}, indent=1))
    plot(table, results["router (warm)"], domains, out)


def plot(table, router_rows, domains, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5))
    keys = list(table)
    width = 0.8 / (len(domains) + 1)
    for i, d in enumerate(domains + ["overall"]):
        ax1.bar([k + i * width for k in range(len(keys))], [table[c][d] for c in keys], width, label=d)
    ax1.set_xticks([k + 0.4 for k in range(len(keys))], keys, rotation=60, ha="right", fontsize=7)
    ax1.set_ylabel("tokens/s")
    ax1.set_title("Dev workload, greedy, side by side")
    ax1.legend(fontsize=7)
    arms = sorted({a for r in router_rows for a in r["arms"]})
    t = 0
    colors = {d: f"C{i}" for i, d in enumerate(domains)}
    for r in router_rows:
        ys = [arms.index(a) for a in r["arms"]]
        ax2.scatter(range(t, t + len(ys)), ys, s=4, color=colors[r["domain"]])
        t += len(ys)
    for d in domains:
        ax2.scatter([], [], color=colors[d], label=d)
    ax2.set_yticks(range(len(arms)), arms, fontsize=7)
    ax2.set_xlabel("decode step")
    ax2.set_title("Warm router: arm chosen per step, coloured by workload domain")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "workload.png", dpi=110)
    print(f"plot: {out / 'workload.png'}")


if __name__ == "__main__":
    main()
