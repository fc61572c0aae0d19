"""Calibration: the kernel kept per width is the one measured fastest on this machine, the result
is cached per fingerprint, and the engine hands the measured costs to the router."""
from __future__ import annotations

import json
import random
import time

import pytest
import torch
from helpers import tiny_loaded

from flashspec_core.backends import calibration
from flashspec_core.backends.calibration import Calibration, calibrate, machine_line
from flashspec_core.backends.cpu_linear import BLOCKS, PACKED, PackedLinear
from flashspec_core.backends.cpu_static import StaticCachedModel
from flashspec_core.backends.hf import CachedModel
from flashspec_core.backends.native_layers import NATIVE, NATIVE_4ROW
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine


class FakeTime:
    """Stands in for the `time` module calibration reads: a forward's "sleep" advances the clock by
    exactly its length, so the kernel choices and the steadiness verdict below do not depend on how
    busy the test machine is (a stretched real sleep once made a steady runner read as busy)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def strftime(self, fmt: str) -> str:
        return time.strftime(fmt)


@pytest.fixture
def fake_time(monkeypatch):
    monkeypatch.setattr(calibration, "time", FakeTime())


class SleepyRunner:
    """Kernel "slow_at_1" takes long at width 1, "slow_wide" at every other width."""

    def __init__(self):
        self.kernel = None
        self.calls = 0

    def kernels(self):
        return ("slow_at_1", "slow_wide")

    def use_kernel(self, name):
        self.kernel = name

    def reset(self, batch_size):
        pass

    def forward_to(self, sequences, active=None, keep_logits=1):
        self.calls += 1
        narrow = keep_logits == 1
        calibration.time.sleep(0.004 if (self.kernel == "slow_at_1") == narrow else 0.0005)
        return torch.zeros(len(sequences), keep_logits, 8)


def test_the_faster_kernel_is_kept_per_width_and_cached(flashspec_cache_dir, fake_time):
    runner = SleepyRunner()
    cal = calibrate(runner, "sleepy-1", "fake", [1, 3, 5], vocab=8)
    assert cal.spread == 1.0
    assert cal.best[1] == "slow_wide" and cal.best[3] == cal.best[5] == "slow_at_1"
    assert cal.kernel_for(4) == "slow_at_1" and cal.kernel_for(1) == "slow_wide"
    assert cal.forward_seconds()[1] < 0.003
    calls = runner.calls
    fresh = SleepyRunner()
    again = calibrate(fresh, "sleepy-1", "fake", [1, 3, 5], vocab=8)
    assert again.best == cal.best and fresh.calls == 0 and runner.calls == calls, "a second load reads the cache"
    assert "CPU:" in cal.table() and "kept" in cal.table()


def test_an_unmeasured_width_takes_the_kernel_cheapest_on_the_line_between_its_neighbours():
    cal = Calibration(key="k", cpu="c", threads=2, measured_at="now",
                      seconds={"native": {1: 1.0, 9: 2.0, 128: 30.0}, "stock": {1: 6.0, 9: 7.0, 128: 20.0}},
                      best={})
    # native's line from 9 to 128 crosses stock's at width 9 + 5 * 119 / 15 = 48.67
    assert [cal.kernel_for(w) for w in (1, 5, 9, 10, 30, 48, 49, 128, 2000)] == [
        "native", "native", "native", "native", "native", "native", "stock", "stock", "stock"]
    assert cal.seconds_of("native", 5) == pytest.approx(1.5)
    assert cal.seconds_of("stock", 2000) == pytest.approx(20.0 + 13.0 / 119 * 1872)
    assert cal.width_seconds(30) == pytest.approx(2.0 + 28.0 * 21 / 119)
    assert cal.seconds_of("missing", 5) == float("inf")


class BusyRunner(SleepyRunner):
    """A forward that takes 0.5 ms or 5 ms at random: the machine is busy with something else."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)

    def forward_to(self, sequences, active=None, keep_logits=1):
        self.calls += 1
        calibration.time.sleep(self.rng.choice((0.0005, 0.005)))
        return torch.zeros(len(sequences), keep_logits, 8)


def test_a_measurement_taken_on_a_busy_machine_is_used_but_not_cached(flashspec_cache_dir, fake_time):
    runner = BusyRunner()
    cal = calibrate(runner, "busy-1", "fake", [1, 3], vocab=8, longer=0)
    assert cal.spread > calibration.STEADY and set(cal.best) == {1, 3, 128}
    path = flashspec_cache_dir / calibration.CALIBRATION_FILE
    assert cal.key not in (json.loads(path.read_text()) if path.exists() else {})
    calls = runner.calls
    assert calibrate(runner, "busy-1", "fake", [1, 3], vocab=8, longer=0) is cal and runner.calls == calls, (
        "the same process keeps it")
    calibration._UNSTEADY.clear()  # a new process
    steady = calibrate(SleepyRunner(), "busy-1", "fake", [1, 3], vocab=8, longer=0)
    assert steady.spread <= calibration.STEADY and steady.key in json.loads(path.read_text())


def test_a_damaged_cache_or_another_machine_measures_again(flashspec_cache_dir, fake_time, monkeypatch):
    calibrate(SleepyRunner(), "sleepy-2", "fake", [1, 3], vocab=8)
    path = flashspec_cache_dir / calibration.CALIBRATION_FILE
    path.write_text("{not json")
    runner = SleepyRunner()
    calibrate(runner, "sleepy-2", "fake", [1, 3], vocab=8)
    assert runner.calls > 0
    json.loads(path.read_text())  # rewritten whole
    monkeypatch.setattr(calibration, "cpu_model", lambda: "Another CPU")
    runner = SleepyRunner()
    calibrate(runner, "sleepy-2", "fake", [1, 3], vocab=8)
    assert runner.calls > 0, "another CPU is another fingerprint"
    from flashspec_core.backends import blockq

    monkeypatch.setattr(blockq, "source_key", lambda: "an edited kernel")
    runner = SleepyRunner()
    calibrate(runner, "sleepy-2", "fake", [1, 3], vocab=8)
    assert runner.calls > 0, "another version of the block kernel is measured again"


def slower(real_call, pause: float):
    """real_call, then `pause` more seconds on the fake clock (the `fake_time` fixture): the real
    kernels run, and only the pauses count, so the slowed kernel loses however busy the machine."""
    def call(*args, **kwargs):
        out = real_call(*args, **kwargs)
        calibration.time.sleep(pause)
        return out
    return call


@pytest.mark.parametrize("runner_cls", [CachedModel, StaticCachedModel])
def test_an_artificially_slow_packed_kernel_loses_to_stock(flashspec_cache_dir, monkeypatch, runner_cls, fake_time):
    loaded = tiny_loaded(16, seed=0)
    runner = runner_cls(loaded.model, pad_token_id=15)
    if runner.kernels() == ("stock",):
        pytest.skip("this torch build cannot pack linear weights")
    real = PackedLinear.forward

    def slow(self, x):
        if self.choice.name == PACKED:
            return slower(real, 0.002)(self, x)
        return real(self, x)

    monkeypatch.setattr(PackedLinear, "forward", slow)
    cal = calibrate(runner, f"tiny-slow-packed-{runner_cls.__name__}", "hf", [1, 5], vocab=16)
    assert set(cal.best.values()) == {"stock"}


@pytest.mark.parametrize("slow", ["fp32", BLOCKS, NATIVE])
def test_the_gguf_kernels_are_kept_only_where_they_are_measured_faster(flashspec_cache_dir, monkeypatch,
                                                                       default_target, slow, fake_time):
    """slow: "fp32" slows the stock and packed kernels; BLOCKS the block kernel and the native stack
    (which runs on the same blocks); NATIVE the native stack alone (in either tile setting)."""
    from flashspec_core.backends import blockq
    from flashspec_core.backends.native_layers import NativeLayers

    if not blockq.available():
        pytest.skip("no C compiler for the block kernel")
    if default_target.model.get_output_embeddings().weight.device.type != "cpu":
        pytest.skip("the default target is on a GPU here; the block kernel is a CPU kernel")
    runner = StaticCachedModel(default_target.model, pad_token_id=0, gguf=default_target.gguf)
    assert {BLOCKS, NATIVE, NATIVE_4ROW} <= set(runner.kernels())
    from flashspec_core.backends import cpu_linear

    real, real_blocks, real_native = PackedLinear.forward, cpu_linear.block_linear, NativeLayers.__call__

    def slowed(self, x):
        if self.choice.name != BLOCKS and slow != BLOCKS:
            calibration.time.sleep(0.0005)  # 211 layers: ~0.1 s a forward
        return real(self, x)

    def slowed_blocks(*args, **kwargs):  # every product from blocks, stacked ones too
        if slow == BLOCKS:  # 121 products a forward (q|k|v, o, gate|up, down, the head): 0.12 s
            return slower(real_blocks, 0.001)(*args, **kwargs)
        return real_blocks(*args, **kwargs)

    def slowed_native(self, *args):
        if slow != "fp32":
            return slower(real_native, 0.1)(self, *args)
        return real_native(self, *args)

    monkeypatch.setattr(PackedLinear, "forward", slowed)
    monkeypatch.setattr(cpu_linear, "block_linear", slowed_blocks)
    monkeypatch.setattr(NativeLayers, "__call__", slowed_native)
    # longer=0: the kept kernels are chosen from the timings at `context`; the per-token slopes
    # (timed after another 1,024 tokens) are not asserted here and cost most of the time.
    cal = calibrate(runner, f"default-slow-{slow}", "hf", [1, 3], vocab=default_target.model.config.vocab_size,
                    context=32, longer=0)
    kept = set(cal.best.values())
    if slow == NATIVE:
        assert not kept & {NATIVE, NATIVE_4ROW}, cal.table()
    else:
        assert bool(kept & {BLOCKS, NATIVE, NATIVE_4ROW}) == (slow == "fp32"), cal.table()


def test_the_engine_calibrates_its_cpu_runner_and_seeds_the_router(flashspec_cache_dir):
    loaded = tiny_loaded(16, seed=0)
    engine = SpecEngine(loaded, [PromptLookupDraft()], router="thompson", gammas=(2, 4), backend="hf")
    cal = engine.calibration
    assert isinstance(cal, Calibration) and {1, 3, 5} <= set(cal.best)
    assert engine.runner.plan is cal
    costs = engine.router._costs
    assert {w: costs.at_width(w) for w in cal.best} == cal.forward_seconds() and costs.context == cal.context
    for w, slope in cal.slopes.items():
        assert costs(w, cal.context + 100) == pytest.approx(cal.forward_seconds()[w] + 100 * slope)
    off = SpecEngine(loaded, [PromptLookupDraft()], router="thompson", backend="hf", calibrate=False)
    assert off.calibration is None and not off.router._costs


class ContextRunner(SleepyRunner):
    """One kernel whose forward costs 4 µs per cached token at width 1 and 12 µs at width 3."""

    def kernels(self):
        return ("only",)

    def forward_to(self, sequences, active=None, keep_logits=1):
        self.calls += 1
        calibration.time.sleep(0.0005 + (4e-6 if keep_logits == 1 else 12e-6) * (len(sequences[0]) - keep_logits))
        return torch.zeros(len(sequences), keep_logits, 8)


def test_each_decode_widths_cost_per_cached_token_is_measured(flashspec_cache_dir, fake_time):
    cal = calibrate(ContextRunner(), "context-1", "fake", [1, 3], vocab=8, context=64, longer=512)
    assert cal.context == 64 and set(cal.slopes) == {1, 3}, "the prefill chunk is not timed twice"
    assert cal.slopes[1] == pytest.approx(4e-6, rel=0.3) and cal.slopes[3] == pytest.approx(12e-6, rel=0.3)
    assert "µs/ctx tok" in cal.table()
    assert calibrate(ContextRunner(), "context-2", "fake", [1, 3], vocab=8, longer=0).slopes == {}


def test_machine_line_names_the_cpu_and_threads():
    line = machine_line()
    assert line.startswith("CPU: ") and f"{torch.get_num_threads()} threads" in line


def test_machine_line_says_when_the_instruction_set_is_narrowed(monkeypatch):
    """A table timed with the AVX2 kernels forced on an AVX-512 CPU must not read as this CPU's own."""
    for name in ("FLASHSPEC_KERNEL_FLAGS", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                 "FLASHSPEC_LLAMA_CPU_VARIANT"):
        monkeypatch.delenv(name, raising=False)
    assert "narrowed" not in machine_line()
    monkeypatch.setenv("FLASHSPEC_KERNEL_FLAGS", "-mavx2 -mfma")
    monkeypatch.setenv("FLASHSPEC_LLAMA_CPU_VARIANT", "haswell")
    line = machine_line()
    assert "narrowed: FLASHSPEC_KERNEL_FLAGS=-mavx2 -mfma FLASHSPEC_LLAMA_CPU_VARIANT=haswell" in line
