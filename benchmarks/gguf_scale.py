"""The CPU engine's kernels on 1B- and 1.5B-shaped Q4_K_M files, beside llama.cpp on the same file.

Each shape is written at run time with gguf-py, random weights and a synthetic byte-level BPE
vocabulary (nothing is downloaded; the text is meaningless, the cost is real): Llama-3.2-1B's
config (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256, tied head,
rope theta 500000) and Qwen2.5-1.5B's (hidden 1536, 28 layers, 12 heads, 2 kv heads, intermediate
8960, vocab 151936, q/k/v biases, tied head). The F16 file is quantized to Q4_K_M by llama.cpp's
own quantizer (llama-cpp-python's `llama_model_quantize`), then loaded as a user would
(`flashspec_core.models.load_model(path)`, the CPU runner `make_runner(..., "hf", ...)`).

Timed: after a 256-token context, a forward of 1 new token (a decode step) and of 8 (a verify of
7 drafted tokens), logits at every new position, on the runner with each kernel it offers forced,
and llama.cpp's `eval` of the same tokens on the same file (llama-cpp-python, n_threads = torch's
thread count, logits at every position). Kernels and llama.cpp interleaved per repetition,
medians after a warm-up round. Shapes run one at a time, each freed before the next. Prints the
machine line and a table, writes results.json and a PNG to --out.

    python benchmarks/gguf_scale.py --out bench_out/gguf_scale
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from flashspec_core.backends import make_runner
from flashspec_core.backends.calibration import machine_line
from flashspec_core.backends.llama_cpp import load_cpu_backends
from flashspec_core.models import load_model

LLAMA_CPP = "llama.cpp"
SHAPES = {
    "llama-3.2-1b": dict(arch="llama", hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, vocab=128256,
                         theta=500000.0, eps=1e-5, ctx=131072, bias=False, pre="llama-bpe"),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden=1536, layers=28, heads=12, kv_heads=2, inter=8960, vocab=151936,
                         theta=1000000.0, eps=1e-6, ctx=32768, bias=True, pre="qwen2"),
}


def byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
    """`size` tokens of a byte-level BPE vocabulary (GPT-2's byte alphabet, then pairs, then
    triples...) and the merges that build them; the last token is an end-of-text control token."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    base = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    tokens, merges, seen = list(base), [], set(base)
    left = 0
    while len(tokens) < size - 1:
        for char in base:
            new = tokens[left] + char
            if new not in seen:
                seen.add(new)
                tokens.append(new)
                merges.append(f"{tokens[left]} {char}")
                if len(tokens) == size - 1:
                    break
        left += 1
    return tokens + ["<|endoftext|>"], merges


def write_f16(path: Path, shape: dict, seed: int = 0) -> None:
    """A random-weight model of `shape` as an F16 GGUF file (fp32 norms and biases), with a
    tokenizer transformers and llama.cpp both load."""
    import gguf

    hidden, heads, kv_heads, inter, vocab = (shape[k] for k in ("hidden", "heads", "kv_heads", "inter", "vocab"))
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), shape["arch"])
    writer.add_context_length(shape["ctx"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape["theta"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, merges = byte_level_vocab(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(shape["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (vocab - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab - 1)
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(seed)

    def matrix(name: str, out: int, inp: int) -> None:
        writer.add_tensor(name, (rng.standard_normal((out, inp), dtype=np.float32) * 0.02).astype(np.float16))

    def vector(name: str, size: int, mean: float, spread: float) -> None:
        writer.add_tensor(name, (mean + spread * rng.standard_normal(size, dtype=np.float32)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)  # tied: no output.weight
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    for layer in range(shape["layers"]):
        vector(f"blk.{layer}.attn_norm.weight", hidden, 1.0, 0.1)
        vector(f"blk.{layer}.ffn_norm.weight", hidden, 1.0, 0.1)
        for name, (out, inp) in shapes.items():
            matrix(f"blk.{layer}.{name}.weight", out, inp)
        if shape["bias"]:
            for name in ("attn_q", "attn_k", "attn_v"):
                vector(f"blk.{layer}.{name}.bias", shapes[name][0], 0.0, 0.1)
    vector("output_norm.weight", hidden, 1.0, 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(source: Path, target: Path, ftype: str, threads: int) -> None:
    """`source` re-quantized by llama.cpp's quantizer to `ftype` (as `llama-quantize` would; from
    an already quantized file too, as `--allow-requantize`)."""
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    params.allow_requantize = True
    tmp = target.with_name(f".{target.name}.tmp")
    if lc.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source}")
    os.replace(tmp, target)


def gguf_file(workdir: Path, name: str, shape: dict, threads: int) -> Path:
    """The Q4_K_M file of `shape` under `workdir`, written and quantized unless already there."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"{name}-L{shape['layers']}-V{shape['vocab']}"
    target = workdir / f"{tag}.Q4_K_M.gguf"
    if not target.exists():
        f16 = workdir / f"{tag}.F16.gguf"
        start = time.perf_counter()
        write_f16(f16, shape)
        print(f"{name}: wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - start:.0f} s)",
              flush=True)
        start = time.perf_counter()
        quantize(f16, target, "Q4_K_M", threads)
        f16.unlink()
        print(f"{name}: quantized to {target} ({target.stat().st_size / 2**30:.2f} GiB, "
              f"{time.perf_counter() - start:.0f} s)", flush=True)
    return target


def pause() -> None:
    """Let the last run's spinning worker threads (OpenMP's, llama.cpp's) go idle before the next."""
    time.sleep(0.1)


def bench_shape(path: Path, kernels_wanted: list[str] | None, context: int, widths: list[int], repeats: int,
                threads: int) -> tuple[dict[str, dict[int, float]], dict]:
    """ms per forward (median) by kernel and width, and facts about the loaded model."""
    import llama_cpp as lc

    load_cpu_backends()  # llama-cpp-python loads none: the variant this CPU runs best, as llama.cpp's tools do
    start = time.perf_counter()
    target = load_model(path, device="cpu")
    loaded_s = time.perf_counter() - start
    runner = make_runner(target, "hf", target.tokenizer.pad_token_id or 0, context + max(widths) + 64)
    offered = list(runner.kernels())
    kernels = [k for k in (kernels_wanted or offered) if k in offered]
    facts = {"runner": type(runner).__name__, "kernels": offered, "block_layers": getattr(runner, "block_layers", 0),
             "load_s": round(loaded_s, 1), "params": sum(p.numel() for p in target.model.parameters())}
    print(f"{path.name}: loaded in {loaded_s:.0f} s; {facts}", flush=True)
    vocab = target.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab - 1, (context,), generator=gen).tolist()
    runner.reset(1)
    runner.use_kernel(kernels[0] if "stock" not in offered else "stock")
    runner.forward_to([prefix])
    llm = lc.Llama(str(path), n_ctx=context + max(widths) + 64, n_batch=512, n_threads=threads,
                   n_threads_batch=threads, logits_all=True, verbose=False)
    llm.eval(prefix)
    names = kernels + [LLAMA_CPP]
    samples: dict[str, dict[int, list[float]]] = {k: {w: [] for w in widths} for k in names}
    for rep in range(repeats + 1):  # the first round warms up
        for width in widths:
            extra = torch.randint(0, vocab - 1, (width,), generator=gen).tolist()
            for name in names:
                pause()
                if name == LLAMA_CPP:
                    llm.n_tokens = context
                    begin = time.perf_counter()
                    llm.eval(extra)
                else:
                    runner.use_kernel(name)
                    begin = time.perf_counter()
                    runner.forward_to([prefix + extra], keep_logits=width)
                if rep:
                    samples[name][width].append(time.perf_counter() - begin)
        print(f"  round {rep} done", flush=True)
    llm.close()
    del llm, runner, target
    gc.collect()
    ms = {k: {w: 1e3 * statistics.median(v) for w, v in by_w.items()} for k, by_w in samples.items()}
    return ms, facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kernels", default=None, help="comma-separated; default: every kernel the runner offers")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--width", type=int, default=8, help="tokens of the verify forward")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (a quick check)")
    parser.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    parser.add_argument("--workdir", default="/tmp/gguf_scale", help="where the GGUF files are written")
    parser.add_argument("--out", default="bench_out/gguf_scale")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    widths = [1, args.width]
    kernels = args.kernels.split(",") if args.kernels else None
    results: dict[str, dict] = {}
    for name in args.shapes.split(","):
        shape = dict(SHAPES[name])
        shape["layers"] = args.layers or shape["layers"]
        shape["vocab"] = args.vocab or shape["vocab"]
        path = gguf_file(Path(args.workdir), name, shape, threads)
        ms, facts = bench_shape(path, kernels, args.context, widths, args.repeats, threads)
        results[name] = {"shape": shape, "file": str(path), "ms": ms, **facts}
    machine = f"{machine_line()}; llama.cpp CPU backend {load_cpu_backends() or 'built in'}"
    w = args.width
    lines = [machine, f"ms per forward of 1 and {w} new tokens after {args.context} cached ones (medians "
             f"of {args.repeats}); speed = llama.cpp's 1-token ms / this row's",
             f"{'shape':<14}{'kernel':<18}{'ms 1 tok':>10}{f'ms {w} tok':>10}{f'{w}/1':>8}{'speed':>8}"]
    for name, res in results.items():
        base = res["ms"][LLAMA_CPP][1]
        for kernel, by_w in res["ms"].items():
            lines.append(f"{name:<14}{kernel:<18}{by_w[1]:>10.1f}{by_w[w]:>10.1f}{by_w[w] / by_w[1]:>8.2f}"
                         f"{base / by_w[1]:>7.2f}x")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"machine": machine, "threads": threads, "context": args.context, "widths": widths, "repeats": args.repeats,
         "results": results}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        names = list(res["ms"])
        for i, width in enumerate(widths):
            ax.bar([j + i * 0.4 for j in range(len(names))], [res["ms"][k][width] for k in names], width=0.4,
                   label=f"{width} new token{'s' if width > 1 else ''}")
        ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=30, fontsize=8)
        ax.set_ylabel(f"ms per forward after {args.context} tokens")
        ax.set_title(f"{name} Q4_K_M (random weights)", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(machine, fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "gguf_scale.png", dpi=120)
    print(f"plot: {out / 'gguf_scale.png'}")


if __name__ == "__main__":
    main()
