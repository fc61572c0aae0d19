"""The default target's forward by kernel, width and context: the native layer stack against the rest.

A forward of W new tokens after a cached context of L tokens, on the `hf` CPU runner of the
default model (a GGUF target), with each kernel it offers forced: stock fp32 `F.linear`, the GGUF
block kernel (products from blocks, the rest in torch), and the native layer stack
(`backends/decode_layers.c`). Kernels interleaved per repetition, medians; the context is random
tokens fed once per L. Prints the machine line and a table, writes a PNG.

    python benchmarks/native_context.py --out bench_out/native_context
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flashspec_core.backends import make_runner
from flashspec_core.backends.calibration import machine_line
from flashspec_core.loading import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,1500,3500")
    parser.add_argument("--widths", default="1,5,9")
    parser.add_argument("--kernels", default="stock,gguf-blocks,gguf-native")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="bench_out/native_context")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    target = load_target(None)
    runner = make_runner(target, "hf", target.tokenizer.pad_token_id or 0, max(contexts) + max(widths) + 64)
    kernels = [k for k in args.kernels.split(",") if k in runner.kernels()]
    vocab = target.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ms: dict[str, dict[str, float]] = {k: {} for k in kernels}
    for ctx in contexts:
        runner.reset(1)
        prefix = torch.randint(0, vocab, (ctx,), generator=gen).tolist()
        runner.use_kernel("stock")
        runner.forward_to([prefix])
        for width in widths:
            samples = {k: [] for k in kernels}
            for rep in range(args.repeats + 1):  # the first round warms up
                extra = torch.randint(0, vocab, (width,), generator=gen).tolist()
                for kernel in kernels:
                    runner.use_kernel(kernel)
                    start = time.perf_counter()
                    runner.forward_to([prefix + extra], keep_logits=width)
                    if rep:
                        samples[kernel].append(time.perf_counter() - start)
            for kernel in kernels:
                ms[kernel][f"L={ctx} W={width}"] = 1e3 * statistics.median(samples[kernel])
    cols = list(next(iter(ms.values())))
    lines = [machine_line(), "ms per forward of W new tokens after L cached ones (medians)",
             f"{'kernel':<14}" + "".join(f"{c:>14}" for c in cols)]
    lines += [f"{k:<14}" + "".join(f"{ms[k][c]:>14.1f}" for c in cols) for k in kernels]
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": machine_line(), "ms": ms}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for i, kernel in enumerate(kernels):
        ax.bar([j + i * 0.8 / len(kernels) for j in range(len(cols))], [ms[kernel][c] for c in cols],
               width=0.8 / len(kernels), label=kernel)
    ax.set_xticks([j + 0.4 - 0.4 / len(kernels) for j in range(len(cols))], cols, rotation=30, fontsize=8)
    ax.set_ylabel("ms per forward")
    ax.set_title(machine_line()[:90], fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "native_context.png", dpi=120)
    print(f"plot: {out / 'native_context.png'}")


if __name__ == "__main__":
    main()
