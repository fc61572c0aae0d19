"""Measure, on the machine at hand, what a target forward costs at each width, and which kernel wins.

At first load the runner's candidate kernels are timed at the widths the engine feeds (1 and γ+1
for each γ, plus a prefill chunk), the fastest is kept per width, and the result is cached per CPU
fingerprint, model shape and backend in the cache folder; the router's cost model starts from these
seconds per width. Why per machine (the fastest kernel differs between CPUs): docs/backends.md,
"Calibration". A runner takes part by exposing `kernels()` (names it can switch between),
`use_kernel(name)` and `forward_to` (the `TargetRunner` contract, backends/base.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashspec_core.backends.base import TargetRunner
from flashspec_core.models import cache_root, vocab_size

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.json"
PREFILL_WIDTH = 128  # the prefill chunk timed alongside the decode widths
CONTEXT = 256  # tokens already in the cache when a width is timed (a short agent prompt)
# The kept kernel of each decode width is timed again this many tokens further on (a retrieved
# context's length), for the router's price of a pass by context (routing/forward_costs.py).
LONGER = 1024
# A measurement whose repetitions of one forward differ more than this (the median over kernels
# and widths of slowest / fastest) was taken while something else ran: it is used by this process
# (`_UNSTEADY`) but not cached, so the next process measures again.
STEADY = 1.5
_UNSTEADY: dict[str, Calibration] = {}
# ISA features that change which kernel wins; the fingerprint names those the CPU has.
_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
          "amx_bf16", "amx_int8", "asimd", "sve")


@dataclass
class Calibration:
    """What was measured: seconds per forward by kernel and width, and the kernel kept per width."""

    key: str
    cpu: str
    threads: int
    seconds: dict[str, dict[int, float]]  # kernel -> width -> median seconds of one forward
    measured_at: str = ""
    best: dict[int, str] = field(default_factory=dict)  # width -> kernel
    context: int = CONTEXT  # tokens cached when `seconds` were timed
    # Decode width -> extra seconds per cached token of its kept kernel (timed LONGER tokens on).
    slopes: dict[int, float] = field(default_factory=dict)
    spread: float = 1.0  # median over kernels and widths of a forward's slowest / fastest repetition

    def __post_init__(self) -> None:
        self.seconds = {k: {int(w): float(s) for w, s in v.items()} for k, v in self.seconds.items()}
        self.slopes = {int(w): float(s) for w, s in self.slopes.items()}
        widths = sorted({w for v in self.seconds.values() for w in v})
        self.best = {w: min(self.seconds, key=lambda k: self.seconds[k].get(w, float("inf"))) for w in widths}
        self._width_seconds: dict[int, float] = {}  # width_seconds' answers (a budget asks per step)

    def kernel_for(self, width: int) -> str:
        """The kernel with the least `seconds_of` at `width`; past the widest measured width, that
        width's choice (the prefill chunk's).

        A CPU step feeds every row's tokens in one ragged forward, so its width is any total from 1
        to the rows' drafts and prompt pieces together: between two measured widths a forward's
        cost is close to the line through them, and rounding to either end's choice would send a
        12-token step to the prefill chunk's kernel, which can cost 2.5x the decode kernel there.
        """
        if width in self.best:
            return self.best[width]
        if width > max(self.best):
            return self.best[max(self.best)]
        return min(self.seconds, key=lambda k: self.seconds_of(k, width))

    def seconds_of(self, kernel: str, width: int) -> float:
        """`kernel`'s seconds for a forward of `width` tokens: measured, or on the line through the
        measured widths around it (below the narrowest: its time; past the widest: the last two
        widths' line continued); inf for a kernel measured at fewer widths than that needs."""
        row = self.seconds.get(kernel, {})
        if width in row:
            return row[width]
        below = [w for w in row if w < width]
        above = [w for w in row if w > width]
        if not below and above:
            return row[min(above)]
        if below and above:
            lo, hi = max(below), min(above)
        elif len(below) >= 2:
            lo, hi = sorted(below)[-2:]
        else:
            return float("inf")
        return row[lo] + (row[hi] - row[lo]) * (width - lo) / (hi - lo)

    def width_seconds(self, width: int) -> float:
        """Seconds of one forward of `width` tokens with the kernel `kernel_for` picks."""
        if width not in self._width_seconds:
            self._width_seconds[width] = self.seconds_of(self.kernel_for(width), width)
        return self._width_seconds[width]

    def forward_seconds(self) -> dict[int, float]:
        """Width -> seconds of one forward with the kept kernel (the router's starting costs)."""
        return {w: self.seconds[k][w] for w, k in self.best.items()}

    def table(self) -> str:
        """The measured table, for the CLI and BENCHMARKS.md."""
        widths = sorted(self.best)
        col = max(9, 2 + max(len(k) for k in self.seconds))
        first = max(12, 1 + max(len(k) for k in self.seconds))
        lines = [f"CPU: {self.cpu}; torch threads: {self.threads}; ms per forward after a cached context "
                 f"(median of repetitions within {self.spread:.2f}x of each other)",
                 f"{'kernel':<{first}}" + "".join(f"{'w=' + str(w):>{col}}" for w in widths)]
        for name, row in self.seconds.items():
            lines.append(f"{name:<{first}}" + "".join(f"{row.get(w, float('nan')) * 1e3:>{col}.1f}" for w in widths))
        lines.append(f"{'kept':<{first}}" + "".join(f"{self.best[w]:>{col}}" for w in widths))
        if self.slopes:
            lines.append(f"{'µs/ctx tok':<{first}}" + "".join(
                f"{self.slopes[w] * 1e6:>{col}.2f}" if w in self.slopes else f"{'':>{col}}" for w in widths))
        return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name as lscpu prints it (falls back to platform.processor())."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The ISA flags among _FLAGS that this CPU reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [f for f in _FLAGS if f in have]
    except OSError:
        pass
    return []


# What narrows the instruction set below the CPU's own (the block kernels' build, torch's kernels,
# MKL, oneDNN, llama.cpp's CPU variant): a table timed under them says so.
_ISA_ENV = ("FLASHSPEC_KERNEL_FLAGS", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
            "FLASHSPEC_LLAMA_CPU_VARIANT")


def machine_line() -> str:
    """One line naming the CPU, its ISA flags and the thread count, for every benchmark table, and
    any instruction-set override in the environment (what another machine would run)."""
    narrowed = [f"{name}={os.environ[name]}" for name in _ISA_ENV if os.environ.get(name, "").strip()]
    return (f"CPU: {cpu_model()} ({os.cpu_count()} logical cores; {' '.join(cpu_flags()) or 'no flags read'}); "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads"
            + (f"; instruction set narrowed: {' '.join(narrowed)}" if narrowed else ""))


# Bumped when a runner's kernels change what they cost (2: llama.cpp's one-token passes moved
# to one thread; 3: "hf" on the CPU runs Llama-family models over a static cache; 4: GGUF
# targets may compute from the file's blocks; 5: and run their layer stack natively; 6: the
# decode widths' cost per cached token is measured too), so a cache
# measured by an older version is measured again. An edit of the block kernel's sources changes
# the key by itself (`blockq.source_key`).
RUNNERS_VERSION = "6"


def fingerprint(model_id: str, backend: str) -> str:
    """Key of a calibration: CPU model and flags, cores, torch version and threads, model, backend,
    the block kernel's version and the instruction set it is built for."""
    from flashspec_core.backends.blockq import build_flags, source_key

    parts = [cpu_model(), ",".join(cpu_flags()), str(os.cpu_count()), torch.__version__,
             str(torch.get_num_threads()), model_id, backend, RUNNERS_VERSION, source_key(),
             " ".join(build_flags())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def model_id(model: torch.nn.Module) -> str:
    """What the cost of a forward depends on: the config (not the weights) and the dtype."""
    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if config is not None else type(model).__name__
    dtype = next(model.parameters()).dtype
    return hashlib.sha256(f"{text}|{dtype}".encode()).hexdigest()[:16]


def _path() -> Path:
    return cache_root() / CALIBRATION_FILE


def _read_all() -> dict:
    try:
        data = json.loads(_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or damaged: measure again


def _write(cal: Calibration) -> None:
    """Add `cal` to the cache file, written to a temporary file and renamed (never half-written)."""
    data = _read_all()
    data[cal.key] = asdict(cal)
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache folder only costs a new measurement next time


def measure(runner: TargetRunner, widths: Sequence[int], key: str, vocab: int, reps: int = 3,
            context: int = CONTEXT, longer: int = LONGER) -> Calibration:
    """Time each kernel of `runner` at each width after `context` cached tokens; median of `reps`.
    Then each decode width's kept kernel after `context + longer` tokens: its cost per cached
    token (0 `longer` skips it).
    """
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (context,), generator=gen).tolist()
    samples = _time_forwards(runner, prefix, widths, lambda w: runner.kernels(), vocab, gen, reps)
    seconds = {k: {w: statistics.median(v) for w, v in rows.items()} for k, rows in samples.items()}
    spread = statistics.median(max(v) / max(min(v), 1e-9) for rows in samples.values() for v in rows.values())
    cal = Calibration(key, cpu_model(), torch.get_num_threads(), seconds, context=context,
                      measured_at=time.strftime("%Y-%m-%d %H:%M:%S"), spread=spread)
    if longer > 0:
        # Decode width -> extra seconds per cached token of its kept kernel (never below 0: a
        # line through two noisy points).
        decode = [w for w in sorted(cal.best) if w < PREFILL_WIDTH]
        prefix += torch.randint(0, vocab, (longer,), generator=gen).tolist()
        far = _time_forwards(runner, prefix, decode, lambda w: (cal.best[w],), vocab, gen, reps)
        cal.slopes = {w: max(0.0, (statistics.median(far[cal.best[w]][w]) - cal.seconds[cal.best[w]][w]) / longer)
                      for w in decode}
    runner.reset(1)
    return cal


def _time_forwards(runner: TargetRunner, prefix: list[int], widths: Sequence[int],
                   kernels: Callable[[int], Sequence[str]], vocab: int, gen: torch.Generator,
                   reps: int) -> dict[str, dict[int, list[float]]]:
    """Kernel -> width -> the seconds of each of `reps` forwards feeding `width` random tokens after
    `prefix`, for each kernel of `kernels(width)`.

    The prefix is fed once; each timed forward feeds its tokens after it (the runner rolls back to
    the shared prefix by itself). Kernels are interleaved per repetition, so a load change on the
    machine hits them alike; the first round is not timed (it warms caches, allocator and
    oneDNN's primitives).
    """
    samples: dict[str, dict[int, list[float]]] = {}
    runner.reset(1)
    runner.forward_to([prefix], keep_logits=1)
    for rep in range(reps + 1):
        for width in widths:
            extra = torch.randint(0, vocab, (width,), generator=gen).tolist()
            for kernel in kernels(width):
                runner.use_kernel(kernel)
                start = time.perf_counter()
                runner.forward_to([prefix + extra], keep_logits=width)
                if rep:
                    samples.setdefault(kernel, {}).setdefault(width, []).append(time.perf_counter() - start)
    return samples


def calibrate(runner: TargetRunner, model_key: str, backend: str, widths: Sequence[int], vocab: int,
              force: bool = False, context: int = CONTEXT, longer: int = LONGER) -> Calibration:
    """The cached calibration for this machine, model and backend, measured first if missing.

    `widths` are the decode widths (1 and γ+1); the prefill chunk is added. A cached entry that
    lacks one of the widths is measured again. A measurement taken while the machine was busy
    (`Calibration.spread` past STEADY) is used by this process but not cached: a kernel choice made
    under someone else's load would otherwise stay for good.
    """
    widths = sorted(set(widths) | {1, PREFILL_WIDTH})
    key = fingerprint(model_key, backend)
    cached = _read_all().get(key)
    if cached and not force:
        try:
            cal = Calibration(**cached)
            if set(widths) <= set(cal.best) and set(cal.seconds) == set(runner.kernels()):
                return cal
        except (TypeError, ValueError):
            pass
    unsteady = _UNSTEADY.get(key)
    if unsteady is not None and not force and set(widths) <= set(unsteady.best):
        return unsteady
    cal = measure(runner, widths, key, vocab, context=context, longer=longer)
    if cal.spread > STEADY:
        logger.warning("calibration: repeated forwards differed by %.2fx (the machine is busy); its kernel "
                       "choice is used by this process but not cached: `flashspec-agents calibrate` on an "
                       "idle machine keeps one", cal.spread)
        _UNSTEADY[key] = cal
        return cal
    _write(cal)
    return cal


def calibrate_runner(runner: TargetRunner, model: PreTrainedModel, backend: str, widths: Sequence[int],
                     context_window: int) -> Calibration | None:
    """The engine's calibration of `runner` (over `model`) at the decode `widths`, within the
    model's context window; None for a runner without kernels to time or off the CPU (a GPU's
    costs are learned by the router as it runs)."""
    if not runner.kernels() or runner.device.type != "cpu":
        return None
    context = min(CONTEXT, context_window // 2)
    longer = max(0, min(LONGER, context_window - context - PREFILL_WIDTH - 1))
    return calibrate(runner, model_id(model), backend, widths, vocab_size(model), context=context, longer=longer)
