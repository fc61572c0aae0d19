"""A seeded soak of an engine: many callers, random settings, cancels, deadlines and bad input.

Each caller thread sends one request after another until the time is up, each of a kind drawn from
the seed (plain or streamed, greedy or sampled, stop strings, a domain, a JSON schema, an abandoned
stream, a cancel while queued, a deadline too short, input the engine must refuse). Every request
must end, with a result or the error its kind expects. The report counts `outcomes` by how requests
ended, `hung` ones (unanswered `hang_s` after the time was up: must be 0), `running` rows and
`queued` requests once every caller is done (both must be 0: anything else is a leak), and resident
memory at start and end. The kinds in full: docs/workloads.md, "Soaks".
"""
from __future__ import annotations

import os
import random
import resource
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flashspec_core.handle import RequestCancelled, RequestHandle
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.scheduler import EngineBusy

KINDS = ("plain", "stream", "abandon", "cancel", "deadline", "schema", "bad")
DOMAINS = (None, "chat", "code", "tool", "rag")
STOPS = (None, ["\n\n"], [".", "!"], ["}"])
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["answer"]}


class SoakEngine(Protocol):
    """What the soak calls (flashspec_core.engine.SpecEngine has it)."""

    running: int
    queued: int

    def submit(self, prompts: Sequence[Any], max_new_tokens: int = ..., **kwargs: Any) -> RequestHandle: ...


@dataclass
class SoakReport:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)
    hung: int = 0
    running: int = 0
    queued: int = 0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    seconds: float = 0.0

    @property
    def unexpected(self) -> dict[str, int]:
        """Outcomes no kind of request should have (an engine fault, a bug)."""
        return {k: v for k, v in self.outcomes.items()
                if k not in ("ok", "cancelled", "deadline", "busy", "bad_input")}


def rss_mb(pid: int | None = None) -> float:
    """Resident memory (MB) of process `pid` (None: this one) from /proc where there is one; this
    process's peak elsewhere, 0 for another process that is gone."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if pid is None else 0.0


def processes(title: str, under: int) -> list[int]:
    """Pids of the descendants of process `under` on this machine whose command line contains
    `title` (Ray names each worker process after its actor: "ray::ServeReplica:<app>:<deployment>")."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:  # pid (comm) state ppid ...
                    parents[int(entry.name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue

    def descends(pid: int) -> bool:
        for _ in range(64):
            pid = parents.get(pid, 0)
            if pid == under:
                return True
            if pid <= 1:
                return False
        return False

    found = []
    for pid in parents:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if title.encode() in cmdline.read() and descends(pid):
                    found.append(pid)
        except OSError:
            continue
    return sorted(found)


def _settings(rng: random.Random, max_tokens: int, kind: str) -> dict[str, Any]:
    """One request's engine arguments for `kind`."""
    sampled = rng.random() < 0.5
    settings: dict[str, Any] = {
        "max_new_tokens": rng.randint(1, max_tokens),
        "sampling": SamplingParams(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 20]),
                                   top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**31)) if sampled else None,
        "stop": rng.choice(STOPS), "domain": rng.choice(DOMAINS),
        "stream": kind in ("stream", "abandon", "cancel"),
    }
    if kind == "deadline":
        settings["timeout"] = rng.uniform(0.001, 0.2)
    if kind == "schema":
        settings["json_schema"] = SCHEMA
    if kind == "bad":
        settings.update(rng.choice([{"max_new_tokens": 0}, {"max_new_tokens": 10**7},
                                    {"sampling": {"temperature": -1.0}}, {"stop": [""] * 3 + [123]}]))
    return settings


def _one(engine: SoakEngine, prompt: Any, kind: str, settings: dict[str, Any], rng: random.Random,
         hang_s: float) -> str:
    """Send one request and say how it ended; raises TimeoutError if it is not answered in hang_s."""
    try:
        handle = engine.submit([prompt], **settings)
    except ValueError:
        return "bad_input"
    except EngineBusy:
        return "busy"
    try:
        if kind == "cancel":
            handle.cancel()
        elif kind == "abandon":
            for i, _ in enumerate(handle):
                if i >= rng.randint(0, 3):
                    handle.cancel()  # what a closed stream does
                    break
        elif settings["stream"]:
            for _ in handle:
                pass
        handle.wait(hang_s)
        return "ok"
    except RequestCancelled:
        return "cancelled"
    except TimeoutError:
        if not handle.done:
            raise
        return "deadline"
    except ValueError:
        return "bad_input"
    except EngineBusy:
        return "busy"


def soak(engine: SoakEngine, prompts: Sequence[Any], seconds: float, callers: int = 6, seed: int = 0,
         max_tokens: int = 32, hang_s: float = 60.0, kinds: Sequence[str] = KINDS) -> SoakReport:
    """Run the soak for `seconds` with `callers` threads (see the module doc); never hangs past
    seconds + 2 * hang_s, counting what did as `hung`."""
    report = SoakReport(rss_start_mb=rss_mb())
    lock = threading.Lock()
    end = time.monotonic() + seconds
    start = time.monotonic()

    def caller(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < end:
            kind = rng.choice(kinds)
            settings = _settings(rng, max_tokens, kind)
            try:
                outcome = _one(engine, rng.choice(prompts), kind, settings, rng, hang_s)
            except TimeoutError:
                outcome = "hung"
            except Exception as exc:  # counted: the report says what failed
                outcome = type(exc).__name__
            with lock:
                report.requests += 1
                report.outcomes[outcome] += 1

    threads = [threading.Thread(target=caller, args=(i,), daemon=True, name=f"soak-{i}") for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, end - time.monotonic()) + 2 * hang_s)
    report.hung = report.outcomes.pop("hung", 0) + sum(t.is_alive() for t in threads)
    settle = time.monotonic() + hang_s  # a row ends at its next step boundary after its request does
    while (engine.running or engine.queued) and time.monotonic() < settle:
        time.sleep(0.05)
    report.running, report.queued = engine.running, engine.queued
    report.seconds = time.monotonic() - start
    report.rss_end_mb = rss_mb()
    return report
