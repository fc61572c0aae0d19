"""The router's host cost per decode step, without a model: select, the arm's draft call, update.

A graphed target step on a GPU costs a few milliseconds, so the router's host work is a visible
share of it (gpu_bench.py's "host" column). This drives the router the engine builds
(`make_router`'s Thompson router over prompt lookup and the suffix cache at γ 2/4/8 plus plain
decoding) through synthetic requests that look like RAG agent steps: a retrieved document of
`--lengths` tokens, an output that copies spans of it, a live token list that grows by what each
step's proposal matched + 1, as the engine's step (`step.Stepper`) extends it, and StepRecords with
a fixed 2.1 ms verify time. Finished outputs go to the suffix cache between requests, through the
drafts' `end`.

Columns: µs per step of `router.select`, of the chosen arm's draft call (the engine's own), of
`router.update` (full-information copy scoring, bandit rounds), and their sum. Rows: that router
in memory (what gpu_bench.py's "engine router" runs), the same with a SQLite store in a temporary
folder (`SpecEngine.from_default` persists; writes are batched, FLUSH_EVERY), and a FixedRouter on
prompt_lookup@4, the fixed arm the router competes with. Each cell is the fastest of `--repeats`
runs (one untimed warm-up run first): other processes on the machine only ever add time. Never
asserts: a measurement.

    PYTHONPATH=. python benchmarks/router_overhead.py [--lengths 256 1024 3072] [--repeats 5]
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.backends.calibration import cpu_model
from flashspec_core.drafts import PromptLookupDraft, SuffixCacheDraft
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.records import StepRecord
from flashspec_core.routing import BanditRouter, FixedRouter, RouterStore
from flashspec_core.routing.store_writer import FLUSH_EVERY

GAMMAS = (2, 4, 8)
VOCAB = 32_000
VERIFY_SECONDS = 2.1e-3  # an H200 target step (gpu_bench.py)
GREEDY = SamplingParams()


def make_request(rng: random.Random, length: int, out_tokens: int) -> tuple[list[int], list[int]]:
    """A prompt of `length` tokens (a document whose phrases recur, as text's do) and the output
    the target will produce: spans copied from the document between phrases of its own."""
    phrases = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(max(8, length // 40))]
    prompt: list[int] = []
    while len(prompt) < length:
        prompt += rng.choice(phrases) if rng.random() < 0.3 else [rng.randrange(VOCAB) for _ in range(8)]
    prompt = prompt[:length]
    output: list[int] = []
    while len(output) < out_tokens:
        if rng.random() < 0.6:
            start = rng.randrange(length - 20)
            output += prompt[start:start + rng.randint(5, 20)]
        else:
            output += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    return prompt, output[:out_tokens]


def run(router, drafts: dict, requests: list[tuple[list[int], list[int]]]) -> tuple[list[float], int]:
    """Seconds spent in select, the draft call and update over all steps, and the step count."""
    spent = [0.0, 0.0, 0.0]
    steps = 0
    for prompt, output in requests:
        for d in drafts.values():
            d.begin([prompt])
        seq = list(prompt)
        while len(seq) - len(prompt) < len(output):
            t0 = time.perf_counter()
            arm = router.select("rag")
            t1 = time.perf_counter()
            proposal = drafts[arm.draft].propose([seq], arm.gamma, GREEDY).tokens[0] if arm.gamma else []
            t2 = time.perf_counter()
            truth = output[len(seq) - len(prompt):]
            agree = [p == t for p, t in zip(proposal, truth)]
            matched = agree.index(False) if False in agree else len(agree)  # greedy verify's accepted count
            context_len = len(seq)
            seq.extend(truth[:matched + 1])
            record = StepRecord(domain="rag", arm=arm, drafted=len(proposal), accepted=matched,
                                emitted=min(matched + 1, len(truth)), draft_seconds=t2 - t1,
                                verify_seconds=VERIFY_SECONDS, context_len=context_len, sequence=seq)
            t3 = time.perf_counter()
            router.update(record)
            t4 = time.perf_counter()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
            spent[2] += t4 - t3
            steps += 1
        for d in drafts.values():
            d.end([prompt], [seq[len(prompt):]])
    return spent, steps


def measure(make_router, length: int, requests: int, out_tokens: int, repeats: int, seed: int) -> list[float]:
    """Fastest µs per step of select, draft, update and their sum over `repeats` fresh routers."""
    results = []
    for r in range(repeats + 1):  # the first run warms caches and allocators, untimed
        rng = random.Random(seed)
        work = [make_request(rng, length, out_tokens) for _ in range(requests)]
        drafts = {d.name: d for d in (PromptLookupDraft(), SuffixCacheDraft())}
        router = make_router(drafts)
        spent, steps = run(router, drafts, work)
        if r:
            results.append([s / steps * 1e6 for s in spent] + [sum(spent) / steps * 1e6])
    return [min(col) for col in zip(*results)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 3072])
    parser.add_argument("--requests", type=int, default=8, help="requests per run")
    parser.add_argument("--out-tokens", type=int, default=192, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory()
    stores = itertools.count()

    def thompson(drafts: dict, store: bool = False) -> BanditRouter:  # make_router("thompson", ...) with a seed
        arms = [Arm(NO_DRAFT, 0)] + [Arm(name, g) for name in drafts for g in GAMMAS]
        path = Path(tmp.name) / f"router{next(stores)}.sqlite"  # a fresh store per run
        return BanditRouter(arms, "thompson", free_drafts=drafts, seed=args.seed,
                            store=RouterStore(path) if store else None)

    configs = {"router (thompson)": thompson, "router + store": lambda d: thompson(d, store=True),
               "fixed prompt_lookup@4": lambda d: FixedRouter(Arm("prompt_lookup", 4))}
    print(f"router host cost per step: {args.requests} requests x {args.out_tokens} output tokens, "
          f"fastest of {args.repeats}; the store is written every {FLUSH_EVERY} updates")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPU threads, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads, unused here), load average {os.getloadavg()[0]:.2f}")
    print(f"{'configuration':<24}{'context':>8}{'select µs':>11}{'draft µs':>10}{'update µs':>11}{'total µs':>10}")
    for length in args.lengths:
        for name, make in configs.items():
            sel, draft, upd, total = measure(make, length, args.requests, args.out_tokens, args.repeats, args.seed)
            print(f"{name:<24}{length:>8}{sel:>11.1f}{draft:>10.1f}{upd:>11.1f}{total:>10.1f}")


if __name__ == "__main__":
    main()
