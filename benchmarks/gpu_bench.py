"""Side-by-side tokens/s on a GPU, batch 1, bf16, in one process: what a GPU user could run.

Configurations: HF `generate` eager; HF `generate` with a static cache (transformers compiles its
forward); PyPI `flashspec` (the seed paper's package) with `compile=True` and its n-gram drafter,
when installed; this engine on the CUDA-graph backend with each fixed arm and with the router
(warmed on disjoint steps of the same stream first). Every configuration is warmed up before it
is timed; warm-up (compile, capture) time is reported apart. Greedy outputs are compared with
HF eager: in bf16 kernels of different shapes can break near-ties either way, and the table says
how many steps matched. `--temperature T` samples at T instead (every configuration: HF with
top_k=0, the peer's SamplingConfig, this engine's SamplingParams seeded by the prompt); sampled outputs
are not compared, and only the lengths differ in what is timed.

    python benchmarks/gpu_bench.py --steps 12 --warmup 12 --max-new-tokens 128 --out bench_out/gpu

Writes results.json and gpu_bench.png; prints the table per domain and this engine's per-step
time breakdown (draft, target forward + verify, host).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
import traceback
import zlib
from collections import defaultdict
from pathlib import Path

import torch

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.drafts.trained import shipped_drafts
from flashspec_core.engine import SpecEngine
from flashspec_core.loading import GPU_GAMMAS, build_drafts, default_drafts
from flashspec_core.models import load_model
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.fixed import FixedRouter
from flashspec_workloads.common import Step
from flashspec_workloads.dev import dev_workload


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def hf_runner(model, tokenizer, temperature: float, **kwargs):
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)

    def run(ids: list[int], max_new: int) -> list[int]:
        x = torch.tensor([ids], device="cuda")
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                             pad_token_id=tokenizer.pad_token_id, **sample, **kwargs)
        return out[0, len(ids):].tolist()
    return run


def peer_runner(model, eos_ids, temperature: float):
    """PyPI flashspec 0.3.1 as the issue drove it: n-gram drafter, compile=True."""
    from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine
    from flashspec.engine.ngram import NgramDrafter
    from flashspec.engine.verifier import TargetModel

    config = FlashSpecConfig(device="cuda", drafter_strategy="bandit", bandit=BanditConfig(n_arms=1), compile=True,
                             compile_max_cache_len=2048, sampling=SamplingConfig(temperature=temperature))
    engine = SpeculativeEngine(config, [NgramDrafter()], TargetModel("smollm2", torch.device("cuda"),
                                                                       torch.bfloat16, model=model))

    def run(ids: list[int], max_new: int) -> list[int]:
        res = engine.generate(torch.tensor([ids], device="cuda"), max_new_tokens=max_new, eos_token_ids=list(eos_ids))
        return [t for t in res.output_ids[0].tolist() if t >= 0]
    return run


def engine_runner(engine: SpecEngine, breakdown: dict, temperature: float, log: list | None = None):
    """Runs one request on `engine`; adds its time split to `breakdown` and, if `log` is given, one
    row per request (domain, arms, prefill, steps, other) to `log`."""

    runner = engine.runner

    def run(ids: list[int], max_new: int) -> list[int]:
        # Seeded by the prompt, not by the call count: the router's engine runs more warm-up
        # requests than a fixed arm's, and a count would give its timed steps other random numbers
        # (other text, other lengths) than the fixed arms' on the same prompts.
        seed = zlib.crc32(str(ids).encode())
        sampling = SamplingParams(temperature=temperature, seed=seed) if temperature else None
        captures, warm = runner.captures, runner.warmup_seconds
        start = time.perf_counter()
        res = engine.generate(ids, max_new_tokens=max_new, sampling=sampling)
        wall = time.perf_counter() - start
        st = res.stats
        # What a request costs outside its prefill, steps and per-step host work (domain
        # classification, drafts' begin/end, the router's last update and flush, ...).
        breakdown["other"] += wall - st.prefill_seconds - sum(r.seconds for r in st.records) - st.host_seconds
        breakdown["captures"] += runner.captures - captures  # graphs captured (or cache grown) in timed steps
        breakdown["capture s"] += runner.warmup_seconds - warm
        breakdown["requests"] += 1
        breakdown["steps"] += st.steps
        breakdown["tokens"] += len(res.token_ids)
        breakdown["prefill"] += st.prefill_seconds
        breakdown["draft"] += sum(r.draft_seconds for r in st.records)
        breakdown["forward+verify"] += sum(r.verify_seconds for r in st.records)
        breakdown["host"] += st.host_seconds
        if log is not None:
            log.append({"domain": st.domain, "tokens": len(res.token_ids), "wall_ms": wall * 1e3,
                        "prefill_ms": st.prefill_seconds * 1e3, "cached_prompt_tokens": st.cached_prompt_tokens,
                        "prompt_tokens": st.prompt_tokens, "steps_ms": sum(r.seconds for r in st.records) * 1e3,
                        "host_ms": st.host_seconds * 1e3, "arms": st.arms})
        return res.token_ids
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--fixed", default="none,prompt_lookup@2,prompt_lookup@4,prompt_lookup@8,suffix_cache@4,"
                                          "distill_chat@2,distill_code@2")
    parser.add_argument("--skip", default="", help="comma list of configurations to leave out (hf_static, peer, ...)")
    parser.add_argument("--steps-file", default=None,
                        help="JSON list of steps (domain, messages, max_new_tokens, source) instead of the dev "
                             "workload, for a GPU host without the ShareGPT package")
    parser.add_argument("--router-with-trained", action="store_true",
                        help="also time a router whose pool adds the shipped trained drafts")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; otherwise sample at T")
    parser.add_argument("--gammas", default=",".join(map(str, GPU_GAMMAS)),
                        help="the γ of the router's arms (each fixed arm's engine adds its own)")
    parser.add_argument("--router-gammas", default="",
                        help="also time a router over these γ (comma list), e.g. 2,4,8,16")
    parser.add_argument("--out", default="bench_out/gpu")
    args = parser.parse_args()
    temp = args.temperature
    skip = set(filter(None, args.skip.split(",")))
    gammas = tuple(int(g) for g in args.gammas.split(","))

    if args.steps_file:
        stream = [Step(**s) for s in json.loads(Path(args.steps_file).read_text())][:args.warmup + args.steps]
    else:
        stream = dev_workload(args.warmup + args.steps, seed=args.seed, max_new_tokens=args.max_new_tokens)
    warm, steps = stream[:args.warmup], stream[args.warmup:]
    target = load_model(None, device="cuda", dtype=torch.bfloat16)
    tok = target.tokenizer
    probe = SpecEngine(target, [], router=FixedRouter(Arm(NO_DRAFT, 0)))
    encode = lambda step: probe.encode([step.messages], step.max_new_tokens)[0]
    warm_ids, step_ids = [encode(s) for s in warm], [encode(s) for s in steps]

    runners, warmups, breakdowns = {}, {}, {}
    logs: dict[str, list] = {}  # engine rows: one entry per timed request
    stock = load_model(None, device="cuda", dtype=torch.bfloat16).model
    if "hf_eager" not in skip:
        runners["hf eager"] = hf_runner(stock, tok, temp)
    if "hf_static" not in skip:
        runners["hf static (compiled)"] = hf_runner(stock, tok, temp, cache_implementation="static")
    if "peer" not in skip and importlib.util.find_spec("flashspec"):
        peer_model = load_model(None, device="cuda", dtype=torch.bfloat16).model
        runners["flashspec 0.3.1 (compile)"] = peer_runner(peer_model, probe.eos_ids, temp)
    built = {}  # engine construction seconds (it captures the graphs of every width): warm-up
    for name in args.fixed.split(","):
        draft, _, gamma = name.partition("@")
        arm = Arm(NO_DRAFT, 0) if draft == NO_DRAFT else Arm(draft, int(gamma))
        # Fixed arms may name the trained drafts, which the GPU's default pool leaves out, or the
        # NF4 copy of the target (bitsandbytes).
        extra = build_drafts(["nf4"], target, None, device="cuda", dtype=torch.bfloat16) if draft == "nf4" else []
        engine, built[f"engine {arm}"] = timed(lambda: SpecEngine(
            target, default_drafts(target) + shipped_drafts(target) + extra, router=FixedRouter(arm),
            gammas=sorted(set(gammas) | ({arm.gamma} if arm.gamma else set()))))
        breakdowns[f"engine {arm}"] = defaultdict(float)
        key = f"engine {arm}"
        runners[key] = engine_runner(engine, breakdowns[key], temp, logs.setdefault(key, []))
    router_engine, built["engine router"] = timed(lambda: SpecEngine(target, default_drafts(target),
                                                                     router="thompson", gammas=gammas))
    breakdowns["engine router"] = defaultdict(float)
    runners["engine router"] = engine_runner(router_engine, breakdowns["engine router"], temp,
                                             logs.setdefault("engine router", []))
    if args.router_gammas:
        wide = tuple(int(g) for g in args.router_gammas.split(","))
        key = f"engine router γ {','.join(map(str, wide))}"
        engine, built[key] = timed(lambda: SpecEngine(target, default_drafts(target), router="thompson", gammas=wide))
        breakdowns[key] = defaultdict(float)
        runners[key] = engine_runner(engine, breakdowns[key], temp, logs.setdefault(key, []))
    if args.router_with_trained:  # the pool the CPU gets: copy drafts plus the shipped trained drafts
        key = "engine router +trained"
        engine, built[key] = timed(lambda: SpecEngine(target, default_drafts(target) + shipped_drafts(target),
                                                      router="thompson"))
        breakdowns[key] = defaultdict(float)
        runners[key] = engine_runner(engine, breakdowns[key], temp, logs.setdefault(key, []))

    results = {}
    for key, run in list(runners.items()):
        try:
            results[key] = measure(key, run, warm_ids, step_ids, steps, warmups, breakdowns, args, logs)
            warmups[key] += built.get(key, 0.0)
        except Exception:  # one broken configuration must not cost the others their run
            traceback.print_exc()
            print(f"{key}: FAILED, left out of the table", flush=True)
    report(results, steps, warmups, breakdowns, Path(args.out), args, logs)
    print("\nrouter's steps per arm and domain (warm-up and timed)")
    for domain, arms in router_engine.router_summary().items():
        print(f"  {domain:<6}" + "  ".join(f"{a} {row['pulls']}" for a, row in arms.items() if row["pulls"]))
        print("        mean reward: " + "  ".join(f"{a} {row['mean_reward']:.3f}" for a, row in arms.items()
                                                 if row["pulls"] or row["scored"]))
    print("router's verify cost model: median ms of a pass by tokens fed (passes kept)")
    for domain, costs in router_engine.router.verify_costs().items():
        print(f"  {domain:<6}" + "  ".join(f"{size}: {sec * 1e3:.2f} ({n})" for size, (sec, n) in costs.items()))


def measure(key, run, warm_ids, step_ids, steps, warmups, breakdowns, args, logs) -> list[dict]:
    """Warm up one configuration, then time it on every step; returns one row per step."""
    # Compiled baselines specialise on shapes: warm them on the timed prompts themselves (only
    # their compile caches remember it). The engine's graphs depend on widths, not prompts: two
    # disjoint steps warm them, and its copy caches never see the timed steps.
    warm_on = step_ids if key.startswith(("hf static", "flashspec")) else warm_ids[:2]
    _, warmups[key] = timed(lambda: [run(ids, args.max_new_tokens) for ids in warm_on])
    if key.startswith("engine router"):  # the router learns on the rest of the warm-up stream, untimed
        for ids in warm_ids[2:]:
            run(ids, args.max_new_tokens)
    if key in breakdowns:
        breakdowns[key].clear()
        logs[key].clear()
    rows = []
    for step, ids in zip(steps, step_ids):
        tokens, seconds = timed(lambda: run(ids, step.max_new_tokens))
        rows.append({"domain": step.domain, "tokens": tokens, "seconds": seconds})
    print(f"{key}: {sum(len(r['tokens']) for r in rows) / sum(r['seconds'] for r in rows):.1f} tok/s "
          f"(warm-up {warmups[key]:.1f} s)", flush=True)
    return rows


def report(results, steps, warmups, breakdowns, out: Path, args, logs) -> None:
    out.mkdir(parents=True, exist_ok=True)
    domains = sorted({s.domain for s in steps})
    # "same" counts steps equal to HF eager's tokens (to the first configuration's when it is skipped).
    reference = [r["tokens"] for r in next(iter(results.values()))]
    base_key = "hf static (compiled)" if "hf static (compiled)" in results else next(iter(results))
    table = {}
    mode = f"sampled at T={args.temperature}" if args.temperature else "greedy"
    print(f"\nGPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; bf16, batch 1, {mode}, "
          f"{len(steps)} steps, max_new_tokens={args.max_new_tokens}; tokens/s")
    print(f"{'configuration':<30}" + "".join(f"{d:>8}" for d in domains)
          + f"{'overall':>9} {'vs ' + base_key.split()[1]:>9}{'same':>7}{'warm-up s':>10}")
    overall_base = None
    for key, rows in results.items():
        per = defaultdict(lambda: [0, 0.0])
        for r in rows:
            per[r["domain"]][0] += len(r["tokens"])
            per[r["domain"]][1] += r["seconds"]
        rates = {d: per[d][0] / per[d][1] for d in domains}
        overall = sum(v[0] for v in per.values()) / sum(v[1] for v in per.values())
        if key == base_key:
            overall_base = overall
        same = None if args.temperature else sum(r["tokens"] == ref for r, ref in zip(rows, reference))
        table[key] = {**rates, "overall": overall, "same": same, "warmup_s": warmups[key]}
    for key, row in table.items():
        print(f"{key:<30}" + "".join(f"{row[d]:>8.1f}" for d in domains) + f"{row['overall']:>9.1f}"
              f"{row['overall'] / overall_base:>9.2f}x{'-' if row['same'] is None else row['same']:>4}/{len(steps)}"
              f"{row['warmup_s']:>10.1f}")
    print("\nper-step breakdown of this engine (ms per step)")
    print(f"{'configuration':<30}{'steps':>7}{'tok/step':>9}{'draft':>8}{'fwd+verify':>11}{'host':>7}"
          f"{'prefill ms/request':>20}{'other ms/request':>18}{'captures (s) in timing':>24}")
    for key, b in breakdowns.items():
        n = max(b["steps"], 1)
        print(f"{key:<30}{int(b['steps']):>7}{b['tokens'] / n:>9.2f}{b['draft'] / n * 1e3:>8.2f}"
              f"{b['forward+verify'] / n * 1e3:>11.2f}{b['host'] / n * 1e3:>7.2f}"
              f"{b['prefill'] / max(b['requests'], 1) * 1e3:>20.2f}{b['other'] / max(b['requests'], 1) * 1e3:>18.2f}"
              f"{int(b['captures']):>17} ({b['capture s']:.2f})")
    print("\nper domain, ms per request: prefill / decode steps / other (wall less both and host); steps")
    for key, log in logs.items():
        parts = []
        for d in domains:
            rows = [r for r in log if r["domain"] == d]
            if rows:
                n = len(rows)
                other = sum(r["wall_ms"] - r["prefill_ms"] - r["steps_ms"] - r["host_ms"] for r in rows) / n
                parts.append(f"{d} {sum(r['prefill_ms'] for r in rows) / n:.1f}"
                             f"/{sum(r['steps_ms'] for r in rows) / n:.1f}"
                             f"/{other:.1f}; {sum(len(r['arms']) for r in rows)}")
        print(f"{key:<30}" + "   ".join(parts))
    (out / "results.json").write_text(json.dumps({"table": table, "breakdown": breakdowns, "requests": logs,
                                                  "gpu": torch.cuda.get_device_name()}, indent=1))
    plot(table, domains, out / "gpu_bench.png", mode)


def plot(table, domains, path: Path, mode: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(table)
    fig, ax = plt.subplots(figsize=(14, 5))
    width = 0.8 / (len(domains) + 1)
    for i, d in enumerate(domains + ["overall"]):
        ax.bar([k + i * width for k in range(len(keys))], [table[c][d] for c in keys], width, label=d)
    ax.set_xticks([k + 0.4 for k in range(len(keys))], keys, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"GPU ({torch.cuda.get_device_name()}), bf16, batch 1, {mode}: side by side")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
