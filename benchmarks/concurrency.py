"""Many agent requests at once, in process: the engine's continuous batching against the same
requests one after another and as one offline batch.

A mix of the dev workload's steps (tool calls, RAG, code, chat; some streamed, some not; each with
its own token budget, and some with a stop string or a repetition penalty) is run three ways on
the same engine, greedy:

Each mode runs on an engine of its own (the same loaded target), warmed on other requests, so no
mode reuses another's prompt cache, suffix-cache outputs or router statistics.

- `sequential`: one request at a time, what a caller gets without concurrency;
- `concurrent N`: N callers at once (threads: streams and plain calls), each request joining the
  engine's running batch when its caller submits it and leaving when it finishes;
- `offline batch`: every prompt in one `engine.generate` list with one shared setting (the largest
  budget, no stop strings or penalties), the throughput ceiling of a fixed batch.

Per mode: aggregate output tokens/s, time to first token and inter-token gap (p50/p99, streamed
requests), and whether every request's output equals its sequential run (greedy: it must);
`cut`: greedy proposals the token budget cut (to the step's width on CUDA graphs, per row on a CPU);
`1-time s`: the mode's seconds of one-time work inside its timed run (graph captures, cache growth).
With `--phases`, the largest concurrency runs once more on a fresh engine with `host_step.py`'s phase
clock around the engine's step methods and the runner's forward, and prints ms per scheduler step by
phase (`forward`: the runner's call, on a GPU the launch and whatever waits on the device inside it).

    python benchmarks/concurrency.py --requests 8 --concurrency 1,4,8 --out bench_out/concurrency
    python benchmarks/concurrency.py --requests 8 --concurrency 1,8 --short-prompts 1600 --max-new-tokens 128
    python benchmarks/concurrency.py --device cuda --requests 256 --concurrency 1,16,64 --max-batch 64

Prints the table (CPU model and threads, or the GPU) and writes results.json and concurrency.png.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashspec_core import SamplingParams, SpecEngine
from flashspec_core.backends.calibration import machine_line
from flashspec_workloads.common import Step
from flashspec_workloads.dev import dev_workload


@dataclass
class Job:
    messages: list[dict]
    domain: str
    max_new_tokens: int
    stream: bool
    stop: list[str] | None
    penalty: float


@dataclass
class Timed:
    tokens: list[int] = field(default_factory=list)
    start: float = 0.0
    first: float | None = None
    gaps: list[float] = field(default_factory=list)
    end: float = 0.0


def jobs(n: int, seed: int, max_new_tokens: int, steps_file: str | None = None,
         short: int | None = None) -> list[Job]:
    """n requests of the dev workload with mixed settings (every other streamed, every third with a
    stop string, every fourth with a repetition penalty, budgets between half and all of max).
    steps_file: the steps saved as JSON (for a host without the ShareGPT package); short: only
    steps whose messages hold at most this many characters (about four a token)."""
    if steps_file:
        steps = [Step(**d) for d in json.loads(Path(steps_file).read_text())]
    else:
        steps = dev_workload(n_steps=n if short is None else 20 * n, seed=seed, max_new_tokens=max_new_tokens)
    if short is not None:
        steps = [s for s in steps if sum(len(str(m.get("content") or "")) for m in s.messages) <= short]
    steps = steps[:n]
    return [Job(s.messages, s.domain, max(8, max_new_tokens // 2 + (i * 7) % (max_new_tokens // 2 + 1)),
                stream=i % 2 == 0, stop=["\n\n\n"] if i % 3 == 2 else None, penalty=1.1 if i % 4 == 3 else 1.0)
            for i, s in enumerate(steps)]


def run_one(engine: SpecEngine, job: Job, out: Timed) -> None:
    sampling = SamplingParams(repetition_penalty=job.penalty)
    hint = job.domain if job.domain in ("tool", "rag") else None  # what the adapters pass for these steps
    out.start = time.perf_counter()
    if job.stream:
        last = out.start
        for chunk in engine.stream(job.messages, max_new_tokens=job.max_new_tokens, sampling=sampling, stop=job.stop,
                                   hint=hint):
            now = time.perf_counter()
            if chunk.token_ids:
                if out.first is None:
                    out.first = now - out.start
                else:
                    out.gaps.append((now - last) / len(chunk.token_ids))
                last = now
            out.tokens.extend(chunk.token_ids)
    else:
        res = engine.generate(job.messages, max_new_tokens=job.max_new_tokens, sampling=sampling, stop=job.stop,
                              hint=hint)
        out.tokens = res.token_ids
    out.end = time.perf_counter()


def run_concurrent(engine: SpecEngine, work: list[Job], concurrency: int) -> tuple[list[Timed], float]:
    """`concurrency` callers, each taking the next request when its last one ended."""
    results = [Timed() for _ in work]
    queue = list(range(len(work)))
    lock = threading.Lock()

    def caller() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            run_one(engine, work[i], results[i])

    start = time.perf_counter()
    threads = [threading.Thread(target=caller) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else float("nan")


def summary(name: str, results: list[Timed], seconds: float, reference: list[list[int]] | None) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    firsts = [r.first for r in results if r.first is not None]
    gaps = [g for r in results for g in r.gaps]
    return {"mode": name, "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "ttft_p50_ms": pct(firsts, 0.5), "ttft_p99_ms": pct(firsts, 0.99),
            "itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99),
            "same_as_sequential": None if reference is None else sum(
                r.tokens == ref for r, ref in zip(results, reference))}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["mode"] for r in rows], [r["tok_per_s"] for r in rows], color="#4c72b0")
    ax.set_ylabel("output tokens/s (all requests)")
    ax.set_title(title, fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def step_phases(engine: SpecEngine, work: list[Job], callers: int) -> dict:
    """ms per scheduler step by phase over `callers` callers running `work` on `engine`."""
    from host_step import instrument  # a script beside this one

    clock = instrument(engine, engine.runner)
    steps0 = engine._scheduler.steps
    results, seconds = run_concurrent(engine, work, callers)
    steps = engine._scheduler.steps - steps0
    clock.undo()
    return {"callers": callers, "steps": steps, "step_ms": seconds / steps * 1e3,
            "tokens_per_step": sum(len(r.tokens) for r in results) / steps, "ms": clock.ms_per_step(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated caller counts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8, help="the engine's max_batch")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prefill_chunk")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="the target's dtype (default: the device's usual one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps-file", default=None, help="the workload as JSON (warm-up steps first)")
    parser.add_argument("--short-prompts", type=int, default=None, metavar="CHARS",
                        help="only requests whose messages hold at most CHARS characters (1600: ~400 tokens)")
    parser.add_argument("--phases", action="store_true",
                        help="also time the largest concurrency's steps by phase (host_step.py's clock)")
    parser.add_argument("--out", default="bench_out/concurrency")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.steps_file:
        saved = jobs(args.requests + 4, 0, args.max_new_tokens, args.steps_file, args.short_prompts)
        warm, work = saved[:4], saved[4:]
    else:
        warm = jobs(4, args.seed + 100, 16)
        work = jobs(args.requests, args.seed + 1, args.max_new_tokens, short=args.short_prompts)
    warmups: list[float] = []

    def fresh() -> SpecEngine:
        """An engine of its own for each mode (the target is loaded once per process): no mode
        finds what an earlier one left in the cache or the suffix draft, or a router it trained."""
        start = time.perf_counter()
        engine = SpecEngine.from_pretrained(None, device=args.device, max_batch=args.max_batch,
                                            prefill_chunk=args.prefill_chunk,
                                            dtype=getattr(torch, args.dtype) if args.dtype else None)
        for job in warm:  # warm-up (kernels, the router's first steps) on other requests: untimed
            run_one(engine, job, Timed())
        warmups.append(time.perf_counter() - start)
        return engine

    rows = []
    engine = fresh()
    one_time = engine.runner.warmup_seconds  # captures and cache growth so far (timed runs report theirs)
    sequential = [Timed() for _ in work]
    t0 = time.perf_counter()
    for job, timed in zip(work, sequential):
        run_one(engine, job, timed)
    rows.append(summary("sequential", sequential, time.perf_counter() - t0, None)
                | {"cuts": None, "one_time_s": engine.runner.warmup_seconds - one_time})
    reference = [r.tokens for r in sequential]
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        engine = fresh()
        one_time = engine.runner.warmup_seconds
        results, seconds = run_concurrent(engine, work, concurrency)
        cuts = engine._stepper.budget.cuts  # greedy proposals the token budget cut
        rows.append(summary(f"concurrent {concurrency}", results, seconds, reference)
                    | {"cuts": cuts, "one_time_s": engine.runner.warmup_seconds - one_time})
    longest = max(j.max_new_tokens for j in work)
    engine = fresh()
    one_time = engine.runner.warmup_seconds
    t0 = time.perf_counter()
    batch = engine.generate([j.messages for j in work], max_new_tokens=longest)
    seconds = time.perf_counter() - t0
    rows.append({"mode": "offline batch", "tokens": sum(len(r.token_ids) for r in batch), "seconds": seconds,
                 "tok_per_s": sum(len(r.token_ids) for r in batch) / seconds, "ttft_p50_ms": float("nan"),
                 "ttft_p99_ms": float("nan"), "itl_p50_ms": float("nan"), "itl_p99_ms": float("nan"),
                 "same_as_sequential": None, "cuts": engine._stepper.budget.cuts,
                 "one_time_s": engine.runner.warmup_seconds - one_time})

    phases = step_phases(fresh(), work, max(int(c) for c in args.concurrency.split(","))) if args.phases else None

    gpu = torch.cuda.is_available() and args.device != "cpu"
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}" if gpu else machine_line()
    dtype = str(engine._target.model.dtype).removeprefix("torch.")
    kind = "short-prompt agent requests" if args.short_prompts else "agent requests"
    title = (f"{len(work)} {kind}, greedy, budgets {min(j.max_new_tokens for j in work)}-{longest}; {device}; {dtype}; "
             f"max_batch {args.max_batch}; prefill_chunk {args.prefill_chunk}; "
             f"engine start and warm-up {statistics.median(warmups):.1f} s (median of {len(warmups)})")
    print(title)
    print(f"{'mode':<16}{'tokens':>8}{'s':>8}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
          f"{'cut':>7}{'1-time s':>9}  same")
    for r in rows:
        print(f"{r['mode']:<16}{r['tokens']:>8}{r['seconds']:>8.2f}{r['tok_per_s']:>9.1f}{r['ttft_p50_ms']:>10.0f}"
              f"{r['ttft_p99_ms']:>8.0f}{r['itl_p50_ms']:>9.0f}{r['itl_p99_ms']:>8.0f}"
              f"{'' if r['cuts'] is None else r['cuts']:>7}{r['one_time_s']:>9.2f}  "
              f"{'' if r['same_as_sequential'] is None else str(r['same_as_sequential']) + '/' + str(len(work))}")
    if phases:
        print(f"{phases['callers']} callers, {phases['steps']} steps of {phases['tokens_per_step']:.1f} tokens, "
              f"{phases['step_ms']:.2f} ms a step; ms a step by phase:")
        print("  ".join(f"{k} {v:.2f}" for k, v in sorted(phases["ms"].items(), key=lambda kv: -kv[1])))
    (out / "results.json").write_text(json.dumps({"title": title, "machine": platform.node(), "rows": rows,
                                                   "phases": phases, "args": vars(args)}, indent=1))
    plot(rows, out / "concurrency.png", title)


if __name__ == "__main__":
    main()
