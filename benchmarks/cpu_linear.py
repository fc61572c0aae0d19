"""What one target forward costs on CPU by the number of tokens fed, stock vs PackedLinear.

Speculation pays when scoring γ + 1 tokens costs little more than one. This measures a forward of
n new tokens on top of a 300-token KV cache of the default model (median of repeats, cache
cropped back after each), for the model as transformers builds it and after
`use_packed_linear` (flashspec_core/backends/cpu_linear.py), at each thread count given.

    python benchmarks/cpu_linear.py --threads 1,2 --out bench_out/cpu_linear
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from flashspec_core.backends.cpu_linear import use_packed_linear
from flashspec_core.models import load_model

TOKENS = (1, 2, 3, 5, 9, 17)


@torch.inference_mode()
def forward_ms(model, context: int, n: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(n)
    vocab = model.config.vocab_size
    cache = DynamicCache()
    model(torch.randint(0, vocab, (1, context), generator=gen), past_key_values=cache, use_cache=True)
    times = []
    for _ in range(repeats):
        x = torch.randint(0, vocab, (1, n), generator=gen)
        start = time.perf_counter()
        model(x, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        cache.crop(-n)
    times.sort()
    return 1000 * times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="bench_out/cpu_linear")
    args = parser.parse_args()
    stock = load_model(None).model
    packed = load_model(None).model
    use_packed_linear(packed)
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, model in (("stock", stock), ("packed", packed)):
            forward_ms(model, args.context, 1, 2)  # warm-up
            ms = {n: forward_ms(model, args.context, n, args.repeats) for n in TOKENS}
            rows.append({"threads": threads, "model": name, "ms": ms})
    print(f"\nforward ms of n new tokens after a {args.context}-token cache (median of {args.repeats})")
    print(f"{'threads':>7} {'linear':<8}" + "".join(f"{f'n={n}':>9}" for n in TOKENS) + f"{'n=5 / n=1':>11}")
    for r in rows:
        ms = r["ms"]
        print(f"{r['threads']:>7} {r['model']:<8}" + "".join(f"{ms[n]:>9.1f}" for n in TOKENS)
              + f"{ms[5] / ms[1]:>11.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_linear.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "cpu_linear.png")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.plot(TOKENS, [r["ms"][n] for n in TOKENS], marker="o", linestyle="-" if r["model"] == "packed" else "--",
                label=f"{r['model']}, {r['threads']} thread(s)")
    ax.set_xlabel("tokens fed in one forward (γ + 1 when verifying)")
    ax.set_ylabel("ms per forward")
    ax.set_title("SmolLM2-135M forward on CPU: stock nn.Linear vs PackedLinear")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
