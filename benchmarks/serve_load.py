"""Load on the OpenAI-compatible endpoint: 1 and 2 replicas, concurrency 1..32, and a replica killed mid-run.

Starts Ray on this machine, deploys `flashspec-agents serve` with each replica count in turn, and
drives it from a bounded async client (127.0.0.1 only: a fixed number of requests per level, each
with a timeout, so the run always ends) with the dev workload's prompts. Per level: requests/s,
output tokens/s, p50/p99 latency and errors. Then, with two replicas under load, one replica's
process is killed (SIGKILL): requests in flight must fail with a clear error or be retried, none
may hang, Ray must restart the replica, and the router ledger must keep every step it had.

    python benchmarks/serve_load.py --out bench_out/serve                 # CPU, this machine
    python benchmarks/serve_load.py --device cuda --out bench_out/serve   # one GPU per replica

Writes results.json and serve_load.png under --out and prints the table (CPU model, threads).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import signal
import sqlite3
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flashspec_workloads.common import openai_messages
from flashspec_workloads.dev import dev_workload

MODEL = "SmolLM2-135M-Instruct"
HOST = "127.0.0.1"


@dataclass
class Level:
    replicas: int
    concurrency: int
    requests: int
    seconds: float
    tokens: int
    latencies: list[float] = field(default_factory=list, repr=False)
    errors: list[str] = field(default_factory=list)
    retried: list[str] = field(default_factory=list)  # first attempts that failed, then were retried
    pids: dict[int, int] = field(default_factory=dict)  # replica pid -> requests it answered
    infos: list[dict] = field(default_factory=list, repr=False)
    firsts: list[float] = field(default_factory=list, repr=False)  # streamed: seconds to the first content
    stream: bool = False

    def row(self) -> dict:
        lat = sorted(self.latencies)
        pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")
        ok = len(self.latencies)
        first = sorted(self.firsts)
        return {"stream": self.stream, "ttft_p50_s": first[len(first) // 2] if first else None,
                "replicas": self.replicas, "concurrency": self.concurrency, "requests": self.requests,
                "ok": ok, "errors": len(self.errors), "retried": len(self.retried), "req_per_s": ok / self.seconds,
                "tok_per_s": self.tokens / self.seconds, "p50_s": pct(0.5), "p99_s": pct(0.99),
                "mean_batch_rows": statistics.mean(i["batch_rows"] for i in self.infos) if self.infos else 0.0}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bodies(n: int, max_new_tokens: int | None, seed: int, steps_file: str | None = None) -> list[dict]:
    """`n` request bodies from the dev workload (greedy, as agent steps usually are), or from a
    JSON file of its steps (`gpu_bench.py --steps-file`'s format) on a host without ShareGPT."""
    if steps_file:
        from flashspec_workloads.common import Step

        saved = [Step(**s) for s in json.loads(Path(steps_file).read_text())]
        if len(saved) < n:
            raise ValueError(f"--steps-file holds {len(saved)} steps; this run needs {n}")
        steps = [s if max_new_tokens is None else dataclasses.replace(s, max_new_tokens=max_new_tokens)
                 for s in saved[:n]]
    else:
        steps = dev_workload(n_steps=n, seed=seed, max_new_tokens=max_new_tokens)
    return [{"model": MODEL, "messages": openai_messages(s.messages), "max_tokens": s.max_new_tokens,
             "temperature": 0} for s in steps]


def auth_headers() -> dict[str, str]:
    """The server's key, when it was started with one ($FLASHSPEC_API_KEY, which `start` reads too)."""
    key = os.environ.get("FLASHSPEC_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


async def _streamed(client: httpx.AsyncClient, url: str, body: dict) -> dict | str:
    """A streamed request read to its end: a body shaped as the plain response's (usage, the
    `flashspec` field) plus `first_s`, the seconds to the first content, or what went wrong."""
    start, first, data = time.perf_counter(), None, {}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=streamed) as res:
        if res.status_code != 200:
            return f"HTTP {res.status_code}: {(await res.aread())[:200]!r}"
        async for line in res.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return f"error event: {event['error']}"
            delta = (event.get("choices") or [{}])[0].get("delta") or {}
            if first is None and (delta.get("content") or delta.get("tool_calls")):
                first = time.perf_counter() - start
            data.update({k: event[k] for k in ("usage", "flashspec") if event.get(k)})
    if "usage" not in data or "flashspec" not in data:
        return "the stream ended without its usage or flashspec chunk"
    return {**data, "first_s": first if first is not None else time.perf_counter() - start}


async def attempt(client: httpx.AsyncClient, url: str, body: dict, timeout: float, stream: bool = False) -> dict | str:
    """One request: the response body, or what went wrong (no answer within `timeout` included)."""
    try:
        if stream:
            return await asyncio.wait_for(_streamed(client, url, body), timeout)
        res = await asyncio.wait_for(client.post(url, json=body), timeout)
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if res.status_code != 200:
        return f"HTTP {res.status_code}: {res.text[:200]}"
    return res.json()


async def one(client: httpx.AsyncClient, url: str, body: dict, level: Level, timeout: float, retries: int,
              stream: bool = False) -> None:
    """A request retried on failure up to `retries` times, as the `openai` client (and so
    ChatOpenAI and OpenAILike) does by default; first failures are counted apart."""
    start = time.perf_counter()
    for left in range(retries, -1, -1):
        data = await attempt(client, url, body, timeout, stream)
        if isinstance(data, dict):
            break
        (level.retried if left else level.errors).append(data)
    else:
        return
    level.latencies.append(time.perf_counter() - start)
    if "first_s" in data:
        level.firsts.append(data["first_s"])
    level.tokens += data["usage"]["completion_tokens"]
    info = data["flashspec"]
    level.infos.append(info)
    level.pids[info["pid"]] = level.pids.get(info["pid"], 0) + 1


async def run_level(base: str, work: list[dict], replicas: int, concurrency: int, timeout: float,
                    retries: int = 0, on_progress=None, stream: bool = False) -> Level:
    """`len(work)` requests, at most `concurrency` in flight; each bounded by `timeout`."""
    level = Level(replicas, concurrency, len(work), 0.0, 0, stream=stream)
    queue: asyncio.Queue = asyncio.Queue()
    for body in work:
        queue.put_nowait(body)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=auth_headers()) as client:
        async def worker() -> None:
            while not queue.empty():
                await one(client, base + "/chat/completions", queue.get_nowait(), level, timeout, retries, stream)
                if on_progress is not None:
                    on_progress(level)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        level.seconds = time.perf_counter() - start
    return level


def ledger_steps(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT COALESCE(SUM(steps), 0) FROM domain_stats").fetchone()[0])


async def kill_run(base: str, work: list[dict], concurrency: int, timeout: float, retries: int, ledger: Path) -> dict:
    """Two replicas under load; one is SIGKILLed once a third of the requests are answered."""
    killed: dict = {}

    def maybe_kill(level: Level) -> None:
        if killed or len(level.latencies) < len(work) // 3:
            return
        victim = max(level.pids, key=level.pids.get)
        known.update(level.pids)
        killed.update(pid=victim, after=len(level.latencies), ledger_steps_before=ledger_steps(ledger))
        os.kill(victim, signal.SIGKILL)

    known: set[int] = set()
    level = await run_level(base, work, 2, concurrency, timeout, retries, maybe_kill)
    # Ray restarts the replica; wait for it (bounded) and read what its router started from.
    restarted = next((i for i in level.infos if i["pid"] not in known), None) if killed else None
    deadline = time.monotonic() + 240
    async with httpx.AsyncClient(timeout=timeout, headers=auth_headers()) as client:
        while killed and restarted is None and time.monotonic() < deadline:
            probe = Level(2, 1, 1, 0.0, 0)
            await one(client, base + "/chat/completions", work[0], probe, timeout, 0)
            restarted = next((i for i in probe.infos if i["pid"] not in known), None)
            await asyncio.sleep(1.0)
    return {"level": level, "killed": killed, "restarted_pid": restarted and restarted["pid"],
            "restarted_warm_steps": restarted and restarted["warm_steps"], "ledger_steps_after": ledger_steps(ledger)}


def deploy(replicas: int, port: int, device: str | None, ledger: Path, max_batch_size: int, gpus: float) -> str:
    from ray import serve

    from flashspec_integrations.serve.command import APP_NAME, start

    if APP_NAME in serve.status().applications:
        serve.delete(APP_NAME)
    return start(replicas, port, HOST, device=device, gpus_per_replica=gpus, router_store=str(ledger),
                 max_batch_size=max_batch_size)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["replicas"], bool(r.get("stream"))) for r in rows if r.get("phase") == "steady"})
    for i, (replicas, stream) in enumerate(series):
        pts = [r for r in rows if (r["replicas"], bool(r.get("stream"))) == (replicas, stream)
               and r.get("phase") == "steady"]
        xs, colour = [r["concurrency"] for r in pts], f"C{i}"
        name = f"{replicas} replica(s){', streamed' if stream else ''}"
        ax1.plot(xs, [r["tok_per_s"] for r in pts], marker="o", color=colour, label=name)
        ax2.plot(xs, [r["p50_s"] for r in pts], marker="o", color=colour, label=f"{name} p50")
        ax2.plot(xs, [r["p99_s"] for r in pts], marker="x", color=colour, linestyle="--", label=f"{name} p99")
    for ax, label in ((ax1, "output tokens/s"), (ax2, "latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title.replace("; ", "\n", 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: list[dict]) -> str:
    head = ("| phase | streamed | replicas | clients | requests | ok | errors | retried | req/s | tok/s | p50 s "
            "| p99 s | TTFT p50 s | mean batch |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        ttft = "" if r.get("ttft_p50_s") is None else f"{r['ttft_p50_s']:.2f}"
        lines.append(f"| {r['phase']} | {'yes' if r.get('stream') else 'no'} | {r['replicas']} | {r['concurrency']} "
                     f"| {r['requests']} | {r['ok']} | {r['errors']} | {r['retried']} | {r['req_per_s']:.2f} "
                     f"| {r['tok_per_s']:.1f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {ttft} "
                     f"| {r['mean_batch_rows']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for one GPU per replica")
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--requests", type=int, default=8, help="requests per level (at least the concurrency)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="every step's budget (the dev workload's own when 0)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed requests after each deployment")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    parser.add_argument("--retries", type=int, default=1, help="retries of a failed request (openai's default is 2)")
    parser.add_argument("--phases", default="steady,kill", help="steady (every replica count), kill, or both")
    parser.add_argument("--kill-concurrency", type=int, default=8)
    parser.add_argument("--kill-requests", type=int, default=48)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--gpus-per-replica", type=float, default=1.0,
                        help="with --device cuda: 0.5 puts 2 replicas on one GPU")
    parser.add_argument("--steps-file", default=None,
                        help="JSON list of dev-workload steps (a GPU host without ShareGPT)")
    parser.add_argument("--stream", default="no",
                        help="no, yes, or both: steady levels streamed (SSE), plain, or each")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", default="bench_out/serve")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ledger = Path(tempfile.mkdtemp(prefix="serve-load-")) / "router.sqlite3"
    device = None if args.device == "cpu" else args.device
    budget = args.max_new_tokens or None
    levels = [int(c) for c in args.concurrency.split(",")]
    phases = set(args.phases.split(","))
    replica_counts = [int(r) for r in args.replicas.split(",")] if "steady" in phases else []
    modes = {"no": [False], "yes": [True], "both": [False, True]}[args.stream]
    per_config = args.warmup + len(modes) * sum(max(args.requests, c) for c in levels)
    work = bodies(len(replica_counts) * per_config + args.kill_requests, budget, seed=1, steps_file=args.steps_file)

    import ray
    import torch

    rows, cursor = [], 0
    load_before = os.getloadavg()[0]  # a shared machine's other work shows here

    def take(n: int) -> list[dict]:
        nonlocal cursor
        if cursor + n > len(work):
            raise AssertionError(f"the workload holds {len(work)} requests; {cursor + n} asked for")
        cursor += n
        return work[cursor - n:cursor]

    try:
        for replicas in replica_counts:
            base = deploy(replicas, args.port, "cpu" if device is None else device, ledger, args.max_batch_size,
                          args.gpus_per_replica)
            asyncio.run(run_level(base, take(args.warmup), replicas, min(4, args.warmup), args.timeout, args.retries))
            for stream, c in ((stream, c) for stream in modes for c in levels):
                level = asyncio.run(run_level(base, take(max(args.requests, c)), replicas, c, args.timeout,
                                              args.retries, stream=stream))
                rows.append({"phase": "steady", **level.row(), "error_samples": level.errors[:3],
                             "retried_samples": level.retried[:3]})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
        kill: dict = {}
        if "kill" in phases:
            base = deploy(2, args.port, "cpu" if device is None else device, ledger, args.max_batch_size,
                          args.gpus_per_replica)
            kill = asyncio.run(kill_run(base, take(args.kill_requests), args.kill_concurrency, args.timeout,
                                        args.retries, ledger))
            level = kill.pop("level")
            rows.append({"phase": "kill 1 of 2", **level.row(), "error_samples": level.errors[:5],
                         "retried_samples": level.retried[:5]})
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    machine = (f"{cpu_model()}, {os.cpu_count()} CPU threads (torch threads per replica: cores / replicas)"
               if device is None else f"{args.device}, host {cpu_model()}")
    title = (f"serve_load: {machine}; max_new_tokens {budget or 'workload'}; {time.strftime('%Y-%m-%d')}; "
             f"torch {torch.__version__}; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"\n{title}\n\n{table(rows)}\n")
    print("kill run:", json.dumps(kill))
    for r in rows:
        for kind in ("error", "retried"):
            for sample in r[f"{kind}_samples"]:
                print(f"{kind} ({r['phase']}, {r['replicas']} replicas, {r['concurrency']} clients): {sample}")
    (out / "results.json").write_text(json.dumps({"machine": machine, "title": title, "rows": rows, "kill": kill,
                                                  "args": vars(args)}, indent=2))
    plot(rows, out / "serve_load.png", title)
    print(f"wrote {out / 'results.json'} and {out / 'serve_load.png'}")


if __name__ == "__main__":
    main()
