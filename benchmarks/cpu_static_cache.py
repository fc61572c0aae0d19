"""The CPU target runners side by side: transformers' DynamicCache (`backends.hf.CachedModel`) against the
static cache over live slots (`backends/cpu_static.py`), and HF `generate` as the reference.

Measures, for the default model in one process: ms per decoded token after contexts of each
`--contexts` length (median over `--tokens` steps; HF `generate`'s steps are timed between the
calls of a logits processor, so its prefill is left out), seconds to prefill a `--prefill`-token
prompt from an empty cache and after a reused 256-token prefix, and the engine's plain decoding
(`fixed:none`, tokens/s over whole calls) against HF `generate` on the longest prompts of the
independent agent workload, with both runners, checking that the tokens are HF's.

    python benchmarks/cpu_static_cache.py --contexts 256,1024,2300 --tokens 24 --prompts 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.backends.calibration import machine_line
from flashspec_core.backends.cpu_linear import STOCK
from flashspec_core.backends.cpu_static import StaticCachedModel
from flashspec_core.backends.hf import CachedModel
from flashspec_core.engine import SpecEngine
from flashspec_core.loading import load_target
from flashspec_core.routing.fixed import FixedRouter
from flashspec_workloads.agent import agent_workload
from flashspec_workloads.baselines import hf_generate, stock_default_model


class _Clock(LogitsProcessor):
    """Records when `generate` scores each position: the gaps are its decode steps."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_decode_ms(model, prompt: list[int], tokens: int, pad: int) -> float:
    clock = _Clock()
    with torch.inference_mode():
        model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       max_new_tokens=tokens + 1, do_sample=False, pad_token_id=pad,
                       logits_processor=LogitsProcessorList([clock]))
    return 1e3 * statistics.median(b - a for a, b in zip(clock.times, clock.times[1:]))


def runners_decode_ms(configs, prompt: list[int], tokens: int) -> list[float]:
    """Median ms per decode step of each (runner, kernel), stepped in turn so load hits them alike."""
    seqs, logits = [], []
    for runner, kernel in configs:
        runner.use_kernel(kernel)
        runner.reset(1)
        seqs.append(list(prompt))
        logits.append(runner.forward_to([prompt]))
    times = [[] for _ in configs]
    for _ in range(tokens):
        for i, (runner, kernel) in enumerate(configs):
            runner.use_kernel(kernel)
            seqs[i].append(int(logits[i][0, -1].argmax()))
            start = time.perf_counter()
            logits[i] = runner.forward_to([seqs[i]])
            times[i].append(time.perf_counter() - start)
    return [1e3 * statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,1024,2300")
    parser.add_argument("--tokens", type=int, default=24, help="decode steps timed per context")
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=4, help="longest agent-workload prompts for the engine")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(None)
    pad = target.tokenizer.pad_token_id
    stock = stock_default_model()
    old = CachedModel(target.model, pad)  # both swap the same model's linears (one shared choice)
    new = StaticCachedModel(target.model, pad)
    vocab = target.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    print(machine_line())

    print(f"\nms per decoded token after a context (median of {args.tokens} steps; the runners step in turn, "
          f"HF generate's best of 2 runs)")
    configs = [(f"{name} {kernel}", cls(target.model, pad), kernel) for name, cls in (("DynamicCache", CachedModel),
               ("static", StaticCachedModel)) for kernel in old.kernels()]
    print(f"{'context':>8}{'HF generate':>14}" + "".join(f"{label:>20}" for label, _, _ in configs))
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        hf = min(hf_decode_ms(stock, prompt, args.tokens, pad) for _ in range(2))
        row = runners_decode_ms([(runner, kernel) for _, runner, kernel in configs], prompt, args.tokens)
        print(f"{context:>8}{hf:>14.1f}" + "".join(f"{ms:>20.1f}" for ms in row), flush=True)
    del configs

    prefill_rows(stock, old, new, vocab, gen, args.prefill)
    engine_rows(target, stock, pad, old, new, args)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prefill_rows(stock, old, new, vocab: int, gen: torch.Generator, n: int) -> None:
    """Seconds to prefill n tokens from empty, and n - 256 after a reused 256-token prefix."""
    prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
    other = prompt[:256] + torch.randint(0, vocab, (n - 256,), generator=gen).tolist()
    print(f"\nseconds to prefill {n} tokens from empty, and the last {n - 256} after a reused 256-token prefix "
          f"(best of 5 interleaved rounds; stock kernel)")
    best = {"HF forward": [float("inf")], "DynamicCache": [float("inf")] * 2, "static": [float("inf")] * 2}

    def fresh(runner):
        runner.reset(1)
        runner.forward_to([prompt])

    def reuse(runner):
        runner.reset(1)
        runner.forward_to([prompt[:256]])
        return _seconds(lambda: runner.forward_to([other]))

    for _ in range(5):
        with torch.inference_mode():
            best["HF forward"][0] = min(best["HF forward"][0],
                                        _seconds(lambda: stock(torch.tensor([prompt]), logits_to_keep=1)))
        for label, runner in (("DynamicCache", old), ("static", new)):
            runner.use_kernel(STOCK)
            best[label] = [min(best[label][0], _seconds(lambda: fresh(runner))), min(best[label][1], reuse(runner))]
    for label, times in best.items():
        print(f"{label:<16}" + "".join(f"{t:>8.2f}" for t in times), flush=True)


def engine_rows(target, stock, pad, old, new, args) -> None:
    """The engine's plain decoding on the longest agent prompts, with each runner, vs HF generate;
    the three run each prompt in turn, so load changes hit them alike."""
    steps = agent_workload(kind="independent", n_steps=48, seed=0, split="heldout")
    engines = {}
    for label, runner in (("engine, DynamicCache", old), ("engine, static", new)):
        engine = SpecEngine(target, [], router=FixedRouter(Arm(NO_DRAFT, 0)), backend="hf")
        runner.plan = engine.runner.plan  # the engine's calibration
        engine.runner = runner  # the benchmark's swap: make_runner picks the static one
        engines[label] = engine
    prompts = [engine.encode([s.messages], args.max_new_tokens)[0] for s in steps]
    prompts = sorted(prompts, key=len)[-args.prompts:]
    print(f"\nengine fixed:none vs HF generate, {len(prompts)} prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.max_new_tokens} new tokens, greedy; tokens/s over whole calls; "
          f"kernels kept by the calibration: {dict((w, new.plan.kernel_for(w)) for w in (1, 5, 128))}")
    hf_generate(stock, prompts[0][:64], 2, pad)  # first-call costs
    for engine in engines.values():
        engine.generate(prompts[0][:64], max_new_tokens=2)
    tokens = {label: 0 for label in ["HF generate", *engines]}
    seconds = dict.fromkeys(tokens, 0.0)
    same = dict.fromkeys(engines, 0)
    for p in prompts:
        ref, secs = hf_generate(stock, p, args.max_new_tokens, pad)
        tokens["HF generate"] += len(ref)
        seconds["HF generate"] += secs
        for label, engine in engines.items():
            start = time.perf_counter()
            out = engine.generate(p, max_new_tokens=args.max_new_tokens).token_ids
            seconds[label] += time.perf_counter() - start
            tokens[label] += len(out)
            same[label] += out == ref
    hf_rate = tokens["HF generate"] / seconds["HF generate"]
    for label in tokens:
        rate = tokens[label] / seconds[label]
        tail = f"  same as HF {same[label]}/{len(prompts)}" if label in same else ""
        print(f"{label:<24}{rate:>8.1f}{rate / hf_rate:>7.2f}x{tail}", flush=True)


if __name__ == "__main__":
    main()
