"""Accuracy of the prompt domain classifier without hints, on the labelled prompt set.

The router keeps one bandit per domain; a step classified into the wrong domain learns from and
is decided by another kind of step's statistics. This prints, per side of the split, the
accuracy, each label's recall and precision and the confusion matrix (rows: true label,
columns: predicted), and the classifier's time on the longest prompts. Tune on 'tune' only
(`--errors` lists its misclassified prompts); 'heldout' is the figure to report.

    python benchmarks/domain_accuracy.py                 # both sides
    python benchmarks/domain_accuracy.py --split tune --errors
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

from flashspec_core.routing.domains import classify_prompt
from flashspec_workloads.labelled import LABELS, LabelledPrompt, labelled_prompts


def confusion(items: tuple[LabelledPrompt, ...]) -> Counter:
    return Counter((item.label, classify_prompt(item.text)) for item in items)


def report(split: str, items: tuple[LabelledPrompt, ...], errors: bool) -> float:
    counts = confusion(items)
    predicted = sorted({p for _, p in counts} | set(LABELS), key=lambda x: (x not in LABELS, x))
    right = sum(n for (t, p), n in counts.items() if t == p)
    accuracy = right / len(items)
    print(f"\n{split}: {len(items)} prompts, accuracy {accuracy:.1%}")
    print(f"{'true/predicted':<17}" + "".join(f"{p:>7}" for p in predicted) + f"{'recall':>8}")
    for label in LABELS:
        row = [counts[(label, p)] for p in predicted]
        print(f"{label:<17}" + "".join(f"{n:>7}" for n in row) + f"{counts[(label, label)] / max(1, sum(row)):>8.0%}")
    precision = [counts[(p, p)] / max(1, sum(n for (_, q), n in counts.items() if q == p)) for p in predicted]
    print(f"{'precision':<17}" + "".join(f"{x:>7.0%}" for x in precision))
    if errors:
        for item in items:
            guess = classify_prompt(item.text)
            if guess != item.label:
                print(f"  {item.label} -> {guess}  {item.source}  {item.text[:150]!r}")
    return accuracy


def timing(items: tuple[LabelledPrompt, ...], repeats: int = 21) -> None:
    """Median time per prompt (over `repeats` calls, so a busy machine's hiccups drop out)."""
    medians = []
    for item in items:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            classify_prompt(item.text)
            times.append(time.perf_counter() - start)
        medians.append((statistics.median(times), len(item.text)))
    longest = sorted(medians, key=lambda m: m[1])[-10:]
    print(f"\nclassifier time, median of {repeats} calls per prompt: over all {len(items)} prompts "
          f"median {statistics.median(m for m, _ in medians) * 1e6:.0f} µs, slowest "
          f"{max(m for m, _ in medians) * 1e6:.0f} µs; on the 10 longest ({longest[0][1]}-{longest[-1][1]} "
          f"characters) slowest {max(m for m, _ in longest) * 1e6:.0f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=["tune", "heldout", "both"], default="both")
    parser.add_argument("--errors", action="store_true", help="list misclassified prompts (tune only)")
    args = parser.parse_args()
    splits = ["tune", "heldout"] if args.split == "both" else [args.split]
    for split in splits:
        report(split, labelled_prompts(split), args.errors and split == "tune")
    timing(tuple(i for s in splits for i in labelled_prompts(s)))


if __name__ == "__main__":
    main()
