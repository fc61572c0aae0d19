"""What one target forward costs on a GPU at the widths speculation feeds: eager against graphed.

The table that tells a user where speculation pays on their model: if a forward over γ+1 tokens
costs about what one token costs, every accepted draft token is nearly free. Models: the default
model's shape (SmolLM2-135M) and Llama-style 1B and 8B shapes, all with random weights built from
a config (speed does not depend on the values), bf16, batch 1, after a `--context`-token cache.

    python benchmarks/gpu_forward_cost.py --out bench_out/gpu_forward_cost

Rows: transformers' eager forward with its dynamic cache (what the engine ran on CUDA before),
our static-cache forward run eagerly, the same replayed from a CUDA graph (`cuda_graph.py`), and
the fewer-kernel ("fused") forward replayed from a graph (the engine's CUDA path).
Times are medians of CUDA-event-timed repetitions after warm-up; capture time is reported apart.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from flashspec_core.backends.cuda_graph import GraphedModel

SHAPES = {
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "Llama-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "Llama-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


# The default model itself (its GGUF, installed), loaded as NF4 with bitsandbytes (needs the
# `quant` extra): what the `nf4` draft and an NF4 target cost on this GPU.
NF4 = "SmolLM2-135M-nf4"


def build(shape: str, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rope_theta=100000.0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


VARIANTS = {"static eager": (False, False), "graphed, HF ops": (True, False), "graphed, fused": (True, True)}
# A 4-bit model's weights cannot be concatenated: its graphs run bitsandbytes' kernels unfused.
NF4_VARIANTS = {"static eager": (False, False), "graphed, HF ops": (True, False)}


@torch.inference_mode()
def measure(shape: str, widths: list[int], context: int, reps: int, dtype: torch.dtype) -> dict:
    if shape == NF4:
        from flashspec_core.models import load_model

        model, variants = load_model(None, device="cuda", dtype=dtype, load_in_4bit=True).model, NF4_VARIANTS
    else:
        model, variants = build(shape, dtype), VARIANTS
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context + max(widths)), device="cuda")
    out: dict[str, dict[int, float]] = {"hf eager": {}, **{label: {} for label in variants}}
    capture = {}
    for w in widths:
        cache = DynamicCache()
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True)

        def hf_step():
            cache.crop(context)
            model(input_ids=ids[:, context:context + w], past_key_values=cache, use_cache=True, logits_to_keep=w)

        for _ in range(3):
            hf_step()
        out["hf eager"][w] = median_ms(hf_step, reps)
    for label, (graphs, fuse) in variants.items():
        runner = GraphedModel(model, 0, graphs=graphs, fuse=fuse)
        seq = ids[0, :context].tolist()
        runner.forward_to([seq], keep_logits=1)
        for w in widths:
            path = ids[0, :context + w].tolist()
            start = time.perf_counter()
            runner.forward_to([path], keep_logits=w)  # captures this width's graph
            torch.cuda.synchronize()
            if graphs:
                capture[w] = time.perf_counter() - start  # the last graphed variant's
            for _ in range(3):
                runner.forward_to([path], keep_logits=w)
            out[label][w] = median_ms(lambda: runner.forward_to([path], keep_logits=w), reps)
    model = None  # the closures above hold it: freed before the cache is emptied
    torch.cuda.empty_cache()
    return {"ms": out, "capture_s": capture}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)} and {NF4!r}")
    parser.add_argument("--widths", default="1,3,5,9")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default="bench_out/gpu_forward_cost")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    name = torch.cuda.get_device_name()
    results = {}
    print(f"GPU: {name}; torch {torch.__version__}; bf16, batch 1, {args.context}-token cache; ms per forward")
    print(f"{'model':<18}{'forward':<16}" + "".join(f"{'w=' + str(w):>9}" for w in widths))
    for shape in args.shapes.split(","):
        res = results[shape] = measure(shape, widths, args.context, args.reps, torch.bfloat16)
        for label, row in res["ms"].items():
            print(f"{shape:<18}{label:<16}" + "".join(f"{row[w]:>9.2f}" for w in widths))
        print(f"{shape:<18}{'capture (s)':<16}" + "".join(f"{res['capture_s'][w]:>9.2f}" for w in widths))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"gpu": name, "context": args.context, "results": results}, indent=1))
    plot(results, widths, out / "gpu_forward_cost.png", name)


def plot(results: dict, widths: list[int], path: Path, gpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4))
    for ax, (shape, res) in zip(axes if len(results) > 1 else [axes], results.items()):
        for label, row in res["ms"].items():
            ax.plot(widths, [row[w] for w in widths], marker="o", label=label)
        ax.set_title(shape)
        ax.set_xlabel("tokens per forward (γ+1)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"Target forward cost on {gpu}, bf16, batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
