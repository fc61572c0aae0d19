"""`chain.batch` of 8 RAG questions against 8 sequential `chain.invoke`s, on the default model.

The chain is the LCEL RAG chain of examples/langchain_rag_chain.py (offline retriever over local
documents -> retrieval-synthesis prompt -> ChatFlashSpec -> text). Sequential invokes decode one
question at a time; `chain.batch` submits every question's call at once, and the calls decode side
by side in the engine's running batch ("rows": the most rows one decode step held). Greedy, so both
must give the same answers (column "same"). One untimed warm-up call first (weights, caches); then
each mode `--repeats` times, alternating, and the fastest run of each is reported.

    FLASHSPEC_CACHE_DIR=/tmp/fscache python benchmarks/chain_batch.py [--max-tokens 48] [--repeats 2]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from langchain_core.callbacks import BaseCallbackHandler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from langchain_rag_chain import build_chain, build_retriever

from flashspec_core.backends.calibration import cpu_model
from flashspec_integrations.langchain import ChatFlashSpec

QUESTIONS = [
    "How long does the Aurora kettle take to boil water?",
    "How often should I descale the kettle?",
    "How many browning levels does the Brisk toaster have?",
    "How long is the warranty on Aurora appliances?",
    "Within how many days can I return an unused appliance?",
    "How powerful is the Vortex blender's motor?",
    "How fast do orders ship?",
    "Above what order value is delivery free?",
]


class BatchSizes(BaseCallbackHandler):
    """Records the output tokens of every model call and the most rows one engine step held."""

    def __init__(self, engine: Any) -> None:
        self.sizes: list[int] = [0]
        self.tokens = 0
        real = engine._stepper.step
        engine._stepper.step = lambda rows, *rest: (self.sizes.append(len(rows)), real(rows, *rest))[1]
        self._restore = lambda: setattr(engine._stepper, "step", real)

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.tokens += response.generations[0][0].message.usage_metadata["output_tokens"]


def run(chain, engine: Any, mode: str) -> tuple[float, list[str], BatchSizes]:
    rec = BatchSizes(engine)
    config = {"callbacks": [rec]}
    start = time.perf_counter()
    if mode == "sequential":
        answers = [chain.invoke(q, config=config) for q in QUESTIONS]
    else:
        answers = chain.batch(QUESTIONS, config=config)
    seconds = time.perf_counter() - start
    rec._restore()
    return seconds, answers, rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    model = ChatFlashSpec(max_tokens=args.max_tokens)
    chain = build_chain(model, build_retriever())
    chain.invoke(QUESTIONS[0])  # warm-up: loads the weights
    engine = model.get_engine()
    load_before = os.getloadavg()[0]
    best: dict[str, tuple[float, list[str], BatchSizes]] = {}
    for _ in range(args.repeats):
        for mode in ("sequential", "batch"):
            result = run(chain, engine, mode)
            if mode not in best or result[0] < best[mode][0]:
                best[mode] = result
    seq_seconds, seq_answers = best["sequential"][:2]
    rows = []
    for mode, (seconds, answers, rec) in best.items():
        rows.append({
            "mode": mode, "seconds": round(seconds, 2), "tokens": rec.tokens,
            "tokens_per_second": round(rec.tokens / seconds, 1), "speedup": round(seq_seconds / seconds, 2),
            "most_rows_in_a_step": max(rec.sizes),
            "same": sum(a == b for a, b in zip(answers, seq_answers)),
        })
    env = {"cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "max_tokens": args.max_tokens, "questions": len(QUESTIONS), "repeats": args.repeats,
           "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    print(f"chain.batch vs sequential invoke: {len(QUESTIONS)} RAG questions, greedy, max_tokens={args.max_tokens}, "
          f"best of {args.repeats}")
    print(f"CPU: {env['cpu']}, {os.cpu_count()} cores, torch {env['torch']}, {env['torch_threads']} threads, "
          f"load average {env['load_average'][0]} before / {env['load_average'][1]} after, {env['date']}")
    print(f"{'mode':<12}{'seconds':>9}{'tokens':>8}{'tok/s':>8}{'speedup':>9}{'rows':>7}{'same':>6}")
    for r in rows:
        print(f"{r['mode']:<12}{r['seconds']:>9.2f}{r['tokens']:>8}{r['tokens_per_second']:>8.1f}"
              f"{r['speedup']:>8.2f}x{r['most_rows_in_a_step']:>7}{r['same']:>4}/{len(QUESTIONS)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        plot(rows, args.out.with_suffix(".png"), f"chain.batch vs sequential invoke, {len(QUESTIONS)} RAG questions, "
             f"max_tokens={args.max_tokens}\n{env['cpu']}, {env['torch_threads']} threads, {env['date']}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([r["mode"] for r in rows], [r["tokens_per_second"] for r in rows], color=["C0", "C1"])
    for i, r in enumerate(rows):
        ax.text(i, r["tokens_per_second"], f"{r['speedup']:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
