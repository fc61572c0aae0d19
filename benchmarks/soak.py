"""A long seeded soak of the engine in process: does every request end, and does anything leak?

    python benchmarks/soak.py --minutes 20 --callers 6

Callers send agent-shaped requests (ShareGPT chat and code turns, tool-call and RAG prompts of
the dev workload) one after another with random settings: plain and streamed, greedy and
sampled, stop strings, domains, JSON schemas, streams abandoned after a few chunks, requests
cancelled while queued, deadlines too short to finish, and input the engine must refuse
(flashspec_workloads/soak.py says which). Prints requests by outcome, hung requests, rows left in
the batch, requests left in the queue and resident memory (sampled every few seconds); writes
the memory curve and the outcomes as a PNG beside the JSON results.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from flashspec_core.backends.calibration import machine_line
from flashspec_core.engine import SpecEngine
from flashspec_workloads.dev import dev_workload
from flashspec_workloads.soak import rss_mb, soak


def plot(samples: list[tuple[float, float]], outcomes: dict[str, int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, ends) = plt.subplots(1, 2, figsize=(10, 3.5))
    mem.plot([t / 60 for t, _ in samples], [m for _, m in samples], color="#4c72b0")
    mem.set_xlabel("minutes")
    mem.set_ylabel("resident memory (MB)")
    ends.bar(list(outcomes), list(outcomes.values()), color="#55a868")
    ends.set_ylabel("requests")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--callers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48, help="the largest budget a request asks for")
    parser.add_argument("--out", default="bench_out/soak")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    engine = SpecEngine.from_default()
    prompts = [step.messages for step in dev_workload(n_steps=64, seed=args.seed, max_new_tokens=args.max_tokens)]
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    start = time.monotonic()

    def sample() -> None:
        while not stop.wait(5.0):
            samples.append((time.monotonic() - start, rss_mb()))

    sampler = threading.Thread(target=sample, daemon=True)
    samples.append((0.0, rss_mb()))
    sampler.start()
    report = soak(engine, prompts, args.minutes * 60, callers=args.callers, seed=args.seed,
                  max_tokens=args.max_tokens, hang_s=120.0)
    stop.set()
    samples.append((time.monotonic() - start, rss_mb()))

    title = (f"soak: {args.callers} callers for {args.minutes:g} min, seed {args.seed}, budgets 1-{args.max_tokens}; "
             f"{machine_line()}")
    print(title)
    print(f"{'requests':<28}{report.requests:>8}")
    for outcome, count in sorted(report.outcomes.items(), key=lambda kv: -kv[1]):
        print(f"  {outcome:<26}{count:>8}")
    print(f"{'hung (must be 0)':<28}{report.hung:>8}")
    print(f"{'rows left in the batch':<28}{report.running:>8}")
    print(f"{'requests left in the queue':<28}{report.queued:>8}")
    peak = max(m for _, m in samples)
    print(f"{'resident MB start/peak/end':<28}{report.rss_start_mb:>8.0f} {peak:.0f} {report.rss_end_mb:.0f}")
    result = {"title": title, "requests": report.requests, "outcomes": dict(report.outcomes), "hung": report.hung,
              "running": report.running, "queued": report.queued, "rss_mb": samples}
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(samples, dict(report.outcomes), out / "soak.png", title)
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")


if __name__ == "__main__":
    main()
