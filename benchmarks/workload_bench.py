"""Side-by-side tokens/s on agent workloads on the CPU, in one run on one machine.

Workloads (flashspec_workloads): `dev` (the short hand-written stream), `independent` (real agent
steps, each its own request: 1k+-token retrieval contexts, real chat and code questions, tool
calls with real-looking schemas) and `loop` (agent loops whose steps extend one prefix).

Configurations: HF `generate`; HF prompt lookup; llama-cpp-python plain greedy decoding of the
same GGUF file (what CPU users run) and its own prompt-lookup speculation; then this engine on
each `--backends` target (transformers: "hf", llama.cpp: "llama.cpp") with each fixed arm, and
with the Thompson router once fresh ("cold") and once after untimed warm-up on the `--warmup`
steps that precede the measured ones ("warm"). Every configuration runs the same steps, each step
on every configuration in turn (the VM's speed drifts over minutes); times are whole calls
(prefill included). Greedy everywhere, so every engine configuration must produce
exactly the tokens of the plain decoder of its backend (HF's or llama.cpp's): the table says how
many steps matched. Tool and RAG steps get the domain hint an adapter passes, unless --no-hints.

    python benchmarks/workload_bench.py --workload independent --steps 24 --warmup 24 --max-new-tokens 64
    python benchmarks/workload_bench.py --requantize Q4_K_M ...   # the default model as a user's Q4_K_M file

results.json keeps the table; workload.png plots it. The CPU and thread count head the table.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.backends import llama_cpp
from flashspec_core.backends.calibration import machine_line
from flashspec_core.engine import SpecEngine
from flashspec_core.loading import default_drafts, load_target
from flashspec_core.models import load_model
from flashspec_core.routing.fixed import FixedRouter
from flashspec_integrations.demo import ADAPTER_HINTS
from flashspec_workloads.agent import agent_workload
from flashspec_workloads.baselines import LlamaCppGreedy, hf_generate, stock_default_model
from flashspec_workloads.dev import dev_workload


def stream(args):
    n = args.warmup + args.steps
    if args.workload == "dev":
        return dev_workload(n, seed=args.seed, max_new_tokens=args.max_new_tokens)
    return agent_workload(kind=args.workload, n_steps=n, seed=args.seed, max_new_tokens=args.max_new_tokens,
                          split="heldout")


def requantized(ftype: str) -> Path:
    """The default model's file re-quantized by llama.cpp's quantizer to `ftype`, in the cache folder."""
    from gguf_scale import quantize  # this folder's script: the same quantizer call

    from flashspec_core.models import cache_root, default_gguf_path

    source = default_gguf_path()
    target = cache_root() / "models" / f"{source.stem}-{source.stat().st_size}.{ftype}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        quantize(source, target, ftype, threads=2)
    return target


def engine_runner(engine: SpecEngine, hints: bool):
    def run(ids, budget, domain):
        start = time.perf_counter()
        res = engine.generate(ids, max_new_tokens=budget, hint=domain if hints and domain in ADAPTER_HINTS else None)
        return res.token_ids, time.perf_counter() - start, res.stats
    return run


def baseline_runner(fn):
    def run(ids, budget, domain):
        tokens, seconds = fn(ids, budget)
        return tokens, seconds, None
    return run


def fixed_arms(names: str | None, pool, gammas) -> list[Arm]:
    arms = [Arm(NO_DRAFT, 0)]
    for name in names.split(",") if names else [d.name for d in pool]:
        draft, _, gamma = name.partition("@")
        if draft != NO_DRAFT:
            arms += [Arm(draft, int(gamma))] if gamma else [Arm(draft, g) for g in gammas]
    return arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("dev", "independent", "loop"), default="independent")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=24, help="untimed steps before the measured ones")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gammas", default="2,4,8")
    parser.add_argument("--backends", default="hf,llama.cpp")
    parser.add_argument("--fixed", default="prompt_lookup@4,distill_chat@2",
                        help="drafts (every γ) or arms (name@γ) to run as fixed arms besides plain decoding; "
                             "'all' for the whole pool")
    parser.add_argument("--no-hints", action="store_true", help="classify every step (no adapter hints)")
    parser.add_argument("--gguf", default=None,
                        help="a GGUF file to run as the target, e.g. a Q4_K_M of the default model "
                             "(default: the embedded one)")
    parser.add_argument("--requantize", default=None, metavar="FTYPE",
                        help="run the default model re-quantized by llama.cpp's quantizer to FTYPE (Q4_K_M, Q5_K_M, "
                             "Q8_0, F16, ...: llama.cpp's file types) instead; made once into the cache folder")
    parser.add_argument("--out", default="bench_out/workload")
    args = parser.parse_args()
    if args.requantize:
        args.gguf = str(requantized(args.requantize))

    steps_all = stream(args)
    warmup, steps = steps_all[:args.warmup], steps_all[args.warmup:]
    gammas = [int(g) for g in args.gammas.split(",")]
    backends = args.backends.split(",")
    if "llama.cpp" in backends and not llama_cpp.available():
        raise SystemExit(f"--backends llama.cpp needs llama-cpp-python: {llama_cpp.INSTALL}")
    target = load_target(args.gguf)
    encoder = SpecEngine(target, [], router=FixedRouter(Arm(NO_DRAFT, 0)), backend="hf", calibrate=False)
    encode = lambda s: encoder.encode([s.messages], s.max_new_tokens)[0]
    ids, warm_ids = [encode(s) for s in steps], [encode(s) for s in warmup]

    stock = load_model(args.gguf).model if args.gguf else stock_default_model()
    pad = target.tokenizer.pad_token_id
    runners = {
        "HF generate": baseline_runner(lambda i, n: hf_generate(stock, i, n, pad)),
        "HF prompt lookup": baseline_runner(lambda i, n: hf_generate(stock, i, n, pad, prompt_lookup_num_tokens=10)),
    }
    if llama_cpp.available():
        runners["llama.cpp"] = baseline_runner(LlamaCppGreedy(target.gguf, encoder.eos_ids))
        runners["llama.cpp prompt lookup"] = baseline_runner(LlamaCppGreedy(target.gguf, encoder.eos_ids,
                                                                            prompt_lookup=10))
    warm_keys, routers = set(), {}
    for backend in backends:
        pool_names = None if args.fixed == "all" else args.fixed
        for arm in fixed_arms(pool_names, default_drafts(target), gammas):
            engine = SpecEngine(target, default_drafts(target), router=FixedRouter(arm), gammas=gammas, backend=backend)
            runners[f"{backend} {arm}"] = engine_runner(engine, not args.no_hints)
            if arm.draft == "suffix_cache":
                warm_keys.add(f"{backend} {arm}")  # its cache persists across requests, as the router's stats
        for label in ("router (cold)", "router (warm)"):
            engine = SpecEngine(target, default_drafts(target), router="thompson", gammas=gammas, backend=backend)
            runners[f"{backend} {label}"] = engine_runner(engine, not args.no_hints)
            routers[f"{backend} {label}"] = engine.router
        warm_keys.add(f"{backend} router (warm)")

    results, failed = measure(runners, steps, ids, warmup, warm_ids, warm_keys)
    views = {key: router.summary() for key, router in routers.items() if key in results}
    report(results, failed, steps, backends, Path(args.out), args, views)


def measure(runners: dict, steps, ids, warmup, warm_ids, warm_keys: set) -> tuple[dict, dict]:
    """Warm up every configuration, then time step 1 on each in turn, then step 2, and so on.

    Why in turn: on these shared VMs the same forward costs 20-40% more or less from one minute to
    the next, and a configuration timed over its own five minutes met another machine than the one
    before it. Interleaved, a load change hits every configuration alike. Each keeps its own state
    (caches, router statistics) across its steps, as when run alone.
    Returns (rows per configuration, one per step; why each failed configuration failed).
    """
    results, failed, live = {}, {}, {}
    for key, run in runners.items():
        try:
            if key in warm_keys:
                for s, i in tqdm(list(zip(warmup, warm_ids)), desc=f"warm-up {key}"):
                    run(i, s.max_new_tokens, s.domain)
            run(ids[0], 4, steps[0].domain)  # first-call costs (allocations, kernels) stay out of the timing
            live[key], results[key] = run, []
        except Exception as exc:  # a baseline that breaks (llama-cpp-python's prompt lookup does on
            failed[key] = repr(exc)  # long prompts) is reported, and the others still run
            print(f"{key}: FAILED ({exc!r}); left out of the table", flush=True)
    for s, i in tqdm(list(zip(steps, ids)), desc="steps, every configuration in turn"):
        for key, run in list(live.items()):
            try:
                tokens, seconds, stats = run(i, s.max_new_tokens, s.domain)
            except Exception as exc:
                failed[key] = repr(exc)
                del live[key], results[key]
                print(f"{key}: FAILED ({exc!r}); left out of the table", flush=True)
                continue
            results[key].append({"domain": s.domain, "tokens": tokens, "seconds": seconds,
                                 "arms": stats.arms if stats else None, "resolved": stats.domain if stats else None,
                                 "prompt_tokens": len(i)})
    return results, failed


def print_router_views(views: dict) -> None:
    """What each router learned: per domain, the arms it ran (pulls, measured tokens/s)."""
    for key, summary in views.items():
        print(f"\n{key}: arms run per domain (pulls x measured tokens/s a step), warm-up steps included")
        for domain, arms in sorted(summary.items()):
            ran = sorted(((v["pulls"], a, v["mean_goodput"]) for a, v in arms.items() if v["pulls"]), reverse=True)
            print(f"  {domain:<6}" + ", ".join(f"{a} {n}x{g:.1f}" for n, a, g in ran))


def report(results, failed, steps, backends, out: Path, args, views: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    domains = sorted({s.domain for s in steps})
    plain_of = {"hf": "HF generate", "llama.cpp": "llama.cpp"}
    table = {}
    header = (f"{'configuration':<34}" + "".join(f"{d:>8}" for d in domains)
              + f"{'overall':>9}{'vs HF':>7}{'vs l.cpp':>9}{'same':>7}")
    print(f"\n{machine_line()}")
    print(f"workload={args.workload}, {len(steps)} steps, greedy, max_new_tokens={args.max_new_tokens}, "
          f"hints={'none' if args.no_hints else 'adapter'}; tokens/s over whole calls (prefill included)\n{header}")
    rates = {}
    for key, rows in results.items():
        per = defaultdict(lambda: [0, 0.0])
        for r in rows:
            per[r["domain"]][0] += len(r["tokens"])
            per[r["domain"]][1] += r["seconds"]
        rates[key] = {d: per[d][0] / per[d][1] for d in domains}
        rates[key]["overall"] = sum(v[0] for v in per.values()) / sum(v[1] for v in per.values())
    for key, rows in results.items():
        backend = key.split()[0] if key.split()[0] in plain_of else None
        ref_key = plain_of.get(backend, "HF generate" if key.startswith("HF") else "llama.cpp")
        ref = results.get(ref_key)
        same = sum(r["tokens"] == x["tokens"] for r, x in zip(rows, ref)) if ref else 0
        vs_lcpp = rates[key]["overall"] / rates["llama.cpp"]["overall"] if "llama.cpp" in rates else float("nan")
        table[key] = {**rates[key], "same": same, "reference": ref_key}
        print(f"{key:<34}" + "".join(f"{rates[key][d]:>8.1f}" for d in domains)
              + f"{rates[key]['overall']:>9.1f}{rates[key]['overall'] / rates['HF generate']['overall']:>6.2f}x"
              + f"{vs_lcpp:>8.2f}x{same:>4}/{len(rows)}")
    for key, why in failed.items():
        print(f"{key:<34}FAILED: {why[:100]}")
    print_router_views(views)
    (out / "results.json").write_text(json.dumps({
        "machine": machine_line(), "args": vars(args), "table": table, "failed": failed,
        "router_arms": {k: [{"domain": r["domain"], "resolved": r["resolved"], "arms": r["arms"]} for r in v]
                        for k, v in results.items() if "router" in k},
        "router_views": views}, indent=1))
    plot(table, domains, out / "workload.png", f"{args.workload} workload — {machine_line()}")


def plot(table, domains, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(16, 5.5))
    keys = list(table)
    width = 0.8 / (len(domains) + 1)
    for i, d in enumerate(domains + ["overall"]):
        ax.bar([k + i * width for k in range(len(keys))], [table[c][d] for c in keys], width, label=d)
    ax.set_xticks([k + 0.4 for k in range(len(keys))], keys, rotation=50, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s (whole calls)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
