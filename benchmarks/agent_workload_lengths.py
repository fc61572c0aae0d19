"""Prompt lengths of the agent workloads, in tokens of the default model, per kind and domain.

Speculative decoding's gain depends on how much of a step is prefill (long prompts) and on how
much of a prompt an earlier step already sent (loops), so the workload's shape is reported
next to any speed figure measured on it. Tokens are counted on the chat-template rendering the
engine sends; "shared" is the share of a loop step's tokens that the previous step of the same
episode already sent (its prompt is a prefix of this one).

    python benchmarks/agent_workload_lengths.py --steps 96 --split heldout
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from flashspec_core.models import load_model
from flashspec_core.prompts import render_messages
from flashspec_workloads.agent import KINDS, agent_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="heldout", choices=["tune", "heldout"])
    args = parser.parse_args()
    tokenizer = load_model(None).tokenizer
    print(f"agent_workload(n_steps={args.steps}, seed={args.seed}, split={args.split!r}); "
          f"tokens of the default model's tokenizer (chat template applied)")
    print(f"{'kind':<12} {'domain':<6} {'steps':>5} {'min':>6} {'p10':>6} {'median':>6} {'p90':>6} "
          f"{'max':>6} {'shared':>7}")
    for kind in KINDS:
        lengths: dict[str, list[int]] = defaultdict(list)
        shared: dict[str, list[float]] = defaultdict(list)
        previous: list[int] = []
        for step in agent_workload(kind, args.steps, args.seed, split=args.split):
            ids = tokenizer(render_messages(tokenizer, step.messages), add_special_tokens=False).input_ids
            lengths[step.domain].append(len(ids))
            common = next((i for i, (a, b) in enumerate(zip(ids, previous)) if a != b), min(len(ids), len(previous)))
            shared[step.domain].append(common / len(ids))
            previous = ids
        for domain in sorted(lengths):
            xs = sorted(lengths[domain])
            deciles = statistics.quantiles(xs, n=10) if len(xs) > 1 else xs * 9
            print(f"{kind:<12} {domain:<6} {len(xs):>5} {xs[0]:>6} {deciles[0]:>6.0f} "
                  f"{statistics.median(xs):>6.0f} {deciles[-1]:>6.0f} {xs[-1]:>6} "
                  f"{statistics.mean(shared[domain]):>6.0%}")


if __name__ == "__main__":
    main()
