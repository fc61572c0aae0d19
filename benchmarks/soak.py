"""A long seeded soak: does every request end, and does anything leak? In process or over HTTP.

    python benchmarks/soak.py --minutes 20 --callers 6                  # the engine, in process
    python benchmarks/soak.py --target serve --minutes 20 --callers 8   # flashspec-agents serve

`--target engine` (the default): callers send agent-shaped requests (ShareGPT chat and code turns,
tool-call and RAG prompts of the dev workload) one after another with random settings: plain and
streamed, greedy and sampled, stop strings, domains, JSON schemas, streams abandoned after a few
chunks, requests cancelled while queued, deadlines too short to finish, and input the engine must
refuse (flashspec_workloads/soak.py says which). Prints requests by outcome, hung requests, rows
left in the batch, requests left in the queue and resident memory (sampled every few seconds).

`--target serve`: starts `flashspec-agents serve` on 127.0.0.1 (two CPU replicas, an API key, a
small in-flight limit and request deadline) and sends the same prompts over HTTP with random
settings, schemas and tools, abandoned streams, clients that give up, malformed and oversized
bodies; one replica process is killed partway (flashspec_workloads/serve_soak.py says what is
counted). Prints requests by outcome and by kind, hung requests, failures outside the kill window,
the replicas' resident memory and whether the server answered normally after the kill.

Both write the memory curve and the outcomes as a PNG beside the JSON results.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashspec_core.backends.calibration import machine_line
from flashspec_workloads.common import openai_messages
from flashspec_workloads.dev import dev_workload
from flashspec_workloads.serve_soak import ServeSoakReport, soak_server
from flashspec_workloads.soak import processes, rss_mb, soak

REPLICA_TITLE = "ServeReplica:flashspec:"  # in each replica process's command line (Ray's process title)
ROOT = Path(__file__).resolve().parent.parent


def plot(samples: list[tuple[float, float]], outcomes: dict[str, int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, ends) = plt.subplots(1, 2, figsize=(11, 4))
    mem.plot([t / 60 for t, _ in samples], [m for _, m in samples], color="#4c72b0")
    mem.set_xlabel("minutes")
    mem.set_ylabel("resident memory (MB)")
    ends.barh(list(outcomes), list(outcomes.values()), color="#55a868")
    ends.set_xlabel("requests")
    ends.tick_params(axis="y", labelsize=7)
    fig.suptitle(title.replace("; ", "\n", 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class Sampler:
    """`measure()` every `every_s` seconds on a thread: (seconds since start, MB) samples."""

    def __init__(self, measure: Callable[[], float], every_s: float = 5.0):
        self.measure, self.every_s = measure, every_s
        self.start = time.monotonic()
        self.samples: list[tuple[float, float]] = [(0.0, measure())]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append((time.monotonic() - self.start, self.measure()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic() - self.start, self.measure()))


def print_rows(rows: list[tuple[str, Any]], width: int = 28) -> None:
    for label, value in rows:
        print(f"{label:<{width}}{value:>8}")


def engine_soak(args: argparse.Namespace, prompts: list[list[dict]]) -> tuple[str, dict, Sampler]:
    """The in-process soak; its title, results and memory samples."""
    from flashspec_core.engine import SpecEngine

    engine = SpecEngine.from_default()
    sampler = Sampler(rss_mb)
    report = soak(engine, prompts, args.minutes * 60, callers=args.callers, seed=args.seed,
                  max_tokens=args.max_tokens, hang_s=120.0)
    sampler.stop()
    title = (f"soak: {args.callers} callers for {args.minutes:g} min, seed {args.seed}, budgets 1-{args.max_tokens}; "
             f"{machine_line()}")
    print(title)
    print_rows([("requests", report.requests), *((f"  {k}", v) for k, v in report.outcomes.most_common())])
    peak = max(m for _, m in sampler.samples)
    print_rows([("hung (must be 0)", report.hung), ("rows left in the batch", report.running),
                ("requests left in the queue", report.queued),
                ("resident MB start/peak/end", f"{report.rss_start_mb:.0f} {peak:.0f} {report.rss_end_mb:.0f}")])
    return title, {"requests": report.requests, "outcomes": dict(report.outcomes), "hung": report.hung,
                   "running": report.running, "queued": report.queued}, sampler


def replicas_mb(server: int) -> dict[int, float]:
    """Resident MB of each replica process the server process `server` started (through Ray)."""
    return {pid: rss_mb(pid) for pid in processes(REPLICA_TITLE, under=server)}


def start_server(args: argparse.Namespace, key: str, log: Path) -> subprocess.Popen:
    """`flashspec-agents serve` in its own process group; returns once it prints that it serves."""
    command = [sys.executable, "-m", "flashspec_integrations.cli", "serve", "--replicas", str(args.replicas),
               "--host", "127.0.0.1", "--port", str(args.port), "--api-key", key,
               "--max-in-flight", str(args.max_in_flight), "--request-timeout", str(args.request_timeout),
               "--max-tokens", str(args.max_tokens)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + args.ready_timeout
    while "serving " not in log.read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"the server did not start within {args.ready_timeout:g} s; its log: {log}")
        time.sleep(1.0)
    return server


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM (the CLI shuts Serve down), then SIGKILL its process group if it lingers."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def serve_table(report: ServeSoakReport, rss_start: dict[int, float], rss_end: dict[int, float],
                peak: float) -> list[tuple[str, Any]]:
    kill = report.kill
    window = f"{kill['at_s'] / 60:.1f}-{kill.get('replaced_at_s', report.seconds) / 60:.1f} min" if kill else "no kill"
    return [("requests", report.requests), *((f"  {k}", v) for k, v in report.outcomes.most_common()),
            ("hung (must be 0)", report.hung),
            ("failed outside the kill window (must be 0)", sum(report.unclean.values())),
            ("  of which 5xx or cut connections", report.server_errors_outside_kill),
            (f"failed in the kill window ({window})", sum(report.in_kill_window_failed.values())),
            ("answered after the kill", kill.get("answered_after_kill", "-")),
            ("replaced replica answered", "yes" if kill.get("replaced_by") else "no"),
            ("normal request answered at the end", "yes" if report.answered_after else "NO"),
            ("replicas resident MB start", " ".join(f"{v:.0f}" for v in rss_start.values())),
            ("replicas resident MB end", " ".join(f"{v:.0f}" for v in rss_end.values())),
            ("replicas resident MB, peak of the sum", f"{peak:.0f}")]


def serve_soak(args: argparse.Namespace, prompts: list[list[dict]], out: Path) -> tuple[str, dict, Sampler]:
    """The soak over HTTP against a `flashspec-agents serve` this starts and stops."""
    key = secrets.token_hex(16)
    server = start_server(args, key, out / "serve.log")
    try:
        rss_start = replicas_mb(server.pid)
        sampler = Sampler(lambda: sum(replicas_mb(server.pid).values()))
        seconds = args.minutes * 60
        report = asyncio.run(soak_server(
            f"http://127.0.0.1:{args.port}/v1", {"authorization": f"Bearer {key}"}, prompts, seconds=seconds,
            callers=args.callers, seed=args.seed, max_tokens=args.max_tokens, hang_s=args.hang,
            kill_at_s=seconds * args.kill_at if args.kill_at > 0 else None))
        sampler.stop()
        rss_end = replicas_mb(server.pid)
    finally:
        stop_server(server)
    title = (f"soak --target serve: {args.callers} clients for {args.minutes:g} min, seed {args.seed}, budgets "
             f"1-{args.max_tokens}; {args.replicas} replicas, max in flight {args.max_in_flight} each, request "
             f"timeout {args.request_timeout:g} s; {machine_line()}")
    print(title)
    peak = max(m for _, m in sampler.samples)
    print_rows(serve_table(report, rss_start, rss_end, peak), width=44)
    print("by kind:", json.dumps(report.by_kind(), indent=1))
    if report.unclean or report.in_kill_window_failed:
        print("failures outside / inside the kill window:", dict(report.unclean), dict(report.in_kill_window_failed))
    return title, {"requests": report.requests, "outcomes": dict(report.outcomes), "by_kind": report.by_kind(),
                   "hung": report.hung, "unclean_outside_kill": dict(report.unclean),
                   "server_errors_outside_kill": report.server_errors_outside_kill,
                   "failed_in_kill_window": dict(report.in_kill_window_failed), "kill": report.kill,
                   "answered_after": report.answered_after, "rss_start_mb": rss_start, "rss_end_mb": rss_end,
                   "seconds": report.seconds}, sampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=("engine", "serve"), default="engine")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--callers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48, help="the largest budget a request asks for")
    parser.add_argument("--out", default="bench_out/soak")
    serve = parser.add_argument_group("--target serve")
    serve.add_argument("--replicas", type=int, default=2)
    serve.add_argument("--port", type=int, default=8766)
    serve.add_argument("--max-in-flight", type=int, default=4, help="per replica; past it a 429")
    serve.add_argument("--request-timeout", type=float, default=30.0, help="the server's deadline (a 504 past it)")
    serve.add_argument("--hang", type=float, default=300.0,
                       help="the client's limit: a request not answered by then is hung")
    serve.add_argument("--kill-at", type=float, default=0.33, help="kill a replica at this share of the run (0: never)")
    serve.add_argument("--ready-timeout", type=float, default=900.0, help="seconds the replicas may take to start")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = dev_workload(n_steps=64, seed=args.seed, max_new_tokens=args.max_tokens)
    prompts = ([step.messages for step in steps] if args.target == "engine"
               else [openai_messages(s.messages) for s in steps])
    if args.target == "engine":
        title, result, sampler = engine_soak(args, prompts)
    else:
        title, result, sampler = serve_soak(args, prompts, out)
    name = "soak" if args.target == "engine" else "soak_serve"
    (out / f"{name}.json").write_text(json.dumps({"title": title, **result, "rss_mb": sampler.samples}, indent=1))
    plot(sampler.samples, result["outcomes"], out / f"{name}.png", title)
    print(f"wrote {out / (name + '.json')} and {out / (name + '.png')}")


if __name__ == "__main__":
    main()
