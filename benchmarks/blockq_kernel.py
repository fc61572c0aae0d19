"""The GGUF block kernel against fp32 `F.linear` on the default model's layer shapes.

Times one pass of M tokens through the 30 layers' seven matrices (each layer its own weights, so
nothing stays in cache between layers, as in a real forward) and through the 49152 x 576 tied head:
fp32 weights with `F.linear` (what transformers runs) against the same weights as Q4_1 (layers) and
Q8_0 (head) blocks with `backends/blockq.py`, in its tiles of one row and of four
(`blockq.set_tile_rows`). Random blocks of the file's shapes; medians of `--repeats`. Prints the
machine line and a table, writes a PNG.

    python benchmarks/blockq_kernel.py --out bench_out/blockq_kernel
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import random_blocks  # the tests' maker of random blocks

from flashspec_core.backends import blockq
from flashspec_core.backends.calibration import machine_line

LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
WIDTHS = (1, 2, 3, 5, 9, 17, 33, 65, 129)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="tokens per pass, comma-separated")
    parser.add_argument("--out", default="bench_out/blockq_kernel")
    args = parser.parse_args()
    if not blockq.available():
        raise SystemExit("the block kernel could not be built here (no C compiler)")
    layers = [[random_blocks("q4_1", n, k, seed=i * 7 + j) for j, (n, k) in enumerate(LAYER_SHAPES)]
              for i in range(args.layers)]
    dense = [[b.dequantize() for b in layer] for layer in layers]
    head = random_blocks("q8_0", 49152, 576, seed=1)
    head_dense = head.dequantize()
    rows = []
    with torch.inference_mode():
        for m in [int(w) for w in args.widths.split(",")]:
            xs = {k: torch.randn(m, k) for _, k in LAYER_SHAPES}
            row = {"layers fp32": timed(lambda: [F.linear(xs[w.shape[1]], w) for ws in dense for w in ws],
                                        args.repeats)}
            for tile in blockq.TILE_ROWS:  # tiles of 1 and of 4 rows: the calibration's two choices
                blockq.set_tile_rows(tile)
                row[f"layers {tile}-row"] = timed(
                    lambda: [blockq.block_linear(xs[b.in_features], b) for bs in layers for b in bs], args.repeats)
            row["head fp32"] = timed(lambda: F.linear(xs[576], head_dense), args.repeats)
            for tile in blockq.TILE_ROWS:
                blockq.set_tile_rows(tile)
                row[f"head {tile}-row"] = timed(lambda: blockq.block_linear(xs[576], head), args.repeats)
            blockq.set_tile_rows(1)
            rows.append((m, row))
    print(machine_line())
    print(f"ms per pass of M tokens: {args.layers} layers x 7 matrices (Q4_1), and the 49152 x 576 head (Q8_0)")
    names = list(rows[0][1])
    print(f"{'M':>3}" + "".join(f"{n:>15}" for n in names))
    for m, row in rows:
        print(f"{m:>3}" + "".join(f"{row[n]:>15.2f}" for n in names))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        ax.plot([m for m, _ in rows], [r[n] for _, r in rows], marker="o", label=n)
    ax.set_xlabel("tokens per pass (M)")
    ax.set_ylabel("ms")
    ax.set_title(machine_line(), fontsize=6)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "blockq_kernel.png", dpi=120)
    print(f"plot: {out / 'blockq_kernel.png'}")


if __name__ == "__main__":
    main()
