"""The demo: an agent-like stream of steps on the default model, against what a user runs instead.

Baselines: transformers' `generate` and, when llama-cpp-python is installed, llama.cpp's own
decoding of the same GGUF file (flashspec_workloads.baselines), whatever backend the engine runs
on. Greedy on every side, so the engine must produce exactly the tokens of the plain decoder that
shares its backend (transformers' by default); the demo checks that and reports the speed-ups
measured in this run on this machine, whose CPU it names.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from tqdm import tqdm

from flashspec_core.backends import llama_cpp
from flashspec_core.backends.calibration import machine_line
from flashspec_core.engine import SpecEngine
from flashspec_core.results import GenerationResult
from flashspec_workloads.baselines import LlamaCppGreedy, hf_generate, stock_default_model
from flashspec_workloads.dev import demo_workload

# What the LangChain and LlamaIndex adapters pass for these steps (tools bound, retrieval
# synthesis); chat and code are left to the engine's prompt classifier.
ADAPTER_HINTS = {"tool", "rag"}


def _race(name: str, run: Callable[[list[int], int], tuple[list[int], float]], prompts: list[list[int]],
          budgets: list[int], outputs: list[list[int]]) -> tuple[float, int]:
    """Run one baseline over the steps; returns its tokens/s and how many steps matched `outputs`."""
    tokens, seconds, same = 0, 0.0, 0
    for ids, budget, ours in tqdm(list(zip(prompts, budgets, outputs)), desc=name, unit="step"):
        theirs, took = run(ids, budget)
        tokens, seconds, same = tokens + len(theirs), seconds + took, same + (theirs == ours)
    rate = tokens / seconds
    print(f"{name}: {tokens} tokens in {seconds:.2f} s = {rate:.1f} tok/s")
    return rate, same


def run_demo(max_new_tokens: int = 64, baseline: bool = True) -> None:
    engine = SpecEngine.from_default()
    steps = demo_workload(max_new_tokens=max_new_tokens)
    prompts = [engine.encode([s.messages], s.max_new_tokens)[0] for s in steps]
    budgets = [s.max_new_tokens for s in steps]
    print(f"{machine_line()}; target on {engine.backend}")
    rows, spec_tokens, spec_seconds, outputs = [], 0, 0.0, []
    for step, ids in tqdm(list(zip(steps, prompts)), desc="flashspec", unit="step"):
        start = time.perf_counter()
        res = engine.generate(ids, max_new_tokens=step.max_new_tokens,
                              hint=step.domain if step.domain in ADAPTER_HINTS else None)
        assert isinstance(res, GenerationResult) and res.stats is not None  # one prompt: one result
        spec_seconds += time.perf_counter() - start
        arms = Counter(a for a in res.stats.arms)
        rows.append((step.domain, res.stats.domain, arms.most_common(1)[0][0], res.stats.drafted,
                     res.stats.accepted, len(res.token_ids), res.tokens_per_second))
        spec_tokens += len(res.token_ids)
        outputs.append(res.token_ids)
    print(f"\n{'step':>4} {'workload':<8} {'domain':<8} {'draft (most used)':<20} {'drafted':>7} {'accepted':>8} "
          f"{'tokens':>6} {'tok/s':>7}")
    for i, (wl, dom, arm, drafted, accepted, n, tps) in enumerate(rows):
        print(f"{i:>4} {wl:<8} {dom:<8} {arm:<20} {drafted:>7} {accepted:>8} {n:>6} {tps:>7.1f}")
    spec_rate = spec_tokens / spec_seconds
    print(f"\nflashspec ({engine.backend}): {spec_tokens} tokens in {spec_seconds:.2f} s = {spec_rate:.1f} tok/s")
    if not baseline:
        return
    stock = stock_default_model()
    pad = engine.tokenizer.pad_token_id
    hf_rate, hf_same = _race("HF generate", lambda ids, n: hf_generate(stock, ids, n, pad), prompts, budgets, outputs)
    print(f"speed-up over HF generate: {spec_rate / hf_rate:.2f}x")
    same, plain = hf_same, "HF generate"
    if llama_cpp.available() and engine.gguf is not None:
        # What a CPU user runs on the same GGUF file, with its own defaults (every thread).
        llama = LlamaCppGreedy(engine.gguf, engine.eos_ids)
        lc_rate, lc_same = _race("llama.cpp (llama-cpp-python)", llama, prompts, budgets, outputs)
        print(f"speed-up over llama.cpp: {spec_rate / lc_rate:.2f}x")
        if engine.backend == "llama.cpp":
            # Past 256 tokens its multi-threaded one-token steps round differently from the
            # engine's (backends/llama_cpp.py), so a step may differ at a near-tie.
            same, plain = lc_same, "llama.cpp"
    else:
        print(f"(llama.cpp not installed: {llama_cpp.INSTALL})")
    print(f"identical to {plain} greedy: {same}/{len(steps)} steps")
