"""Verify-step latency on one GPU: the fused Triton kernel against the torch reference.

    python benchmarks/verify_kernel.py [--out DIR] [--quick]
    python benchmarks/verify_kernel.py --plot DIR/verify_kernel.json   # PNG from saved results

Both backends get the same bf16 logits, drafts and uniforms (T = 0.7), are captured in CUDA
graphs and timed by replay (triton.testing.do_bench_cudagraph, median), so host overhead is left
out of both; inputs rotate over several copies so that repeated steps do not read from L2. Every
configuration also checks that both backends return the same tokens. Prints a table and writes
verify_kernel.json / .csv (and .png where matplotlib is present) into --out.

Bytes: the fewest a step must move, B(γ+1)V·2 for the bf16 logits plus, for model drafts, B·V·4
for the fp32 q row at the stopping position; "%HBM" is that over the time, against a measured
device-to-device copy.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
from pathlib import Path

import torch

L2_BYTES = 60 * 2**20


def hbm_ceiling_gbs() -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def launch_floor_us() -> float:
    """Replay time of an empty one-program Triton kernel: no kernel launch can beat it."""
    import triton
    import triton.language as tl
    import triton.testing

    @triton.jit
    def _empty(x_ptr):
        tl.store(x_ptr, 1)

    x = torch.zeros(1, device="cuda", dtype=torch.int32)
    _empty[(1,)](x)
    return triton.testing.do_bench_cudagraph(lambda: _empty[(1,)](x), rep=50, return_mode="median") * 1e3


def make_inputs(bsz: int, vocab: int, gamma: int, model: bool, gen: torch.Generator) -> dict:
    """logits [B, γ+1, V] bf16, drafts [B, γ], q [B, γ, V] fp32 or None, uniforms [B, γ+1]."""
    from flashspec_core.processors.sampling import SamplingParams, probs_from_logits

    logits = (torch.randn(bsz, gamma + 1, vocab, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    sp = SamplingParams(temperature=0.7)
    q = None
    if model:
        noisy = logits[:, :gamma].float() + torch.randn(bsz, gamma, vocab, device="cuda", generator=gen)
        q = probs_from_logits(noisy, sp)
        drafts = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(bsz, gamma)
    else:
        p = probs_from_logits(logits[:, :gamma], sp)
        drafts = torch.multinomial(p.reshape(-1, vocab), 1, generator=gen).view(bsz, gamma)
    uniforms = torch.rand(bsz, gamma + 1, device="cuda", generator=gen)
    return {"logits": logits, "drafts": drafts, "q": q, "uniforms": uniforms}


def min_bytes(bsz: int, vocab: int, gamma: int, model: bool) -> int:
    return bsz * (gamma + 1) * vocab * 2 + (bsz * vocab * 4 if model else 0)


def bench_one(bsz: int, vocab: int, gamma: int, model: bool, gen: torch.Generator) -> dict:
    import triton.testing

    from flashspec_core.processors.sampling import SamplingParams
    from flashspec_core.verify.reference import verify_torch
    from flashspec_core.verify.triton import verify_triton

    sp = SamplingParams(temperature=0.7)
    set_bytes = min_bytes(bsz, vocab, gamma, False) + (bsz * gamma * vocab * 4 if model else 0)
    n_sets = max(1, min(8, math.ceil(3 * L2_BYTES / set_bytes), (16 << 30) // set_bytes))
    sets = [make_inputs(bsz, vocab, gamma, model, gen) for _ in range(n_sets)]
    turn = itertools.count()

    def kernel():
        s = sets[next(turn) % n_sets]
        return verify_triton(s["logits"], s["drafts"], s["q"], sp, s["uniforms"], check_finite=False)

    def reference():
        s = sets[next(turn) % n_sets]
        return verify_torch(s["logits"], s["drafts"], s["q"], sp, s["uniforms"])

    same_n, token_diffs = True, 0
    for s in sets:
        got = verify_triton(s["logits"], s["drafts"], s["q"], sp, s["uniforms"])
        want = verify_torch(s["logits"], s["drafts"], s["q"], sp, s["uniforms"])
        same_n &= bool(torch.equal(got[0], want[0]))
        token_diffs += int((got[1] != want[1]).any(-1).sum())
    row = {"B": bsz, "V": vocab, "gamma": gamma, "drafts": "model" if model else "onehot",
           "same_n_accepted": same_n, "rows_checked": bsz * n_sets, "token_diffs": token_diffs,
           "min_bytes": min_bytes(bsz, vocab, gamma, model)}
    for name, fn in (("kernel_us", kernel), ("torch_us", reference)):
        try:
            row[name] = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
        except RuntimeError:  # not capturable: time eagerly (host overhead included)
            row[name] = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3
    sets = None  # the closures above hold it: freed before the cache is emptied
    torch.cuda.empty_cache()
    return row


def eager_us(bsz: int, vocab: int, gamma: int, check_finite: bool) -> float:
    """Eager call of verify_triton, host-side wrapper and launch included."""
    import triton.testing

    from flashspec_core.processors.sampling import SamplingParams
    from flashspec_core.verify.triton import verify_triton

    s = make_inputs(bsz, vocab, gamma, False, torch.Generator(device="cuda").manual_seed(1))
    sp = SamplingParams(temperature=0.7)
    return triton.testing.do_bench(
        lambda: verify_triton(s["logits"], s["drafts"], None, sp, s["uniforms"], check_finite=check_finite),
        warmup=20, rep=100, return_mode="median") * 1e3


def sweep(gen: torch.Generator) -> None:
    """Kernel time under other launch plans, to check the heuristic in verify/triton.py:_plan."""
    import triton.testing

    from flashspec_core.processors.sampling import SamplingParams
    from flashspec_core.verify.triton import _plan, verify_triton

    sp = SamplingParams(temperature=0.7)
    print("| drafts | B | V | γ | plan (BLOCK, TILES) | kernel µs |")
    print("|---|---:|---:|---:|---|---:|")
    for model, bsz, vocab, gamma in ((False, 8, 128256, 4), (True, 8, 128256, 4), (False, 64, 128256, 8),
                                     (False, 256, 128256, 8), (True, 256, 262144, 8)):
        s = make_inputs(bsz, vocab, gamma, model, gen)
        auto = _plan(bsz, gamma + 1, vocab, None, None)
        for block, tiles in sorted({auto, (2048, 1), (4096, 1), (4096, 4), (8192, 1), (8192, 2), (8192, 4)}):
            us = triton.testing.do_bench_cudagraph(
                lambda: verify_triton(s["logits"], s["drafts"], s["q"], sp, s["uniforms"], block=block,
                                      tiles=tiles, check_finite=False), rep=30, return_mode="median") * 1e3
            mark = " (auto)" if (block, tiles) == auto else ""
            print(f"| {'model' if model else 'onehot'} | {bsz} | {vocab} | {gamma} | {block}, {tiles}{mark} "
                  f"| {us:.1f} |", flush=True)


def profile_host() -> None:
    """Where the ~75 µs of host time of an eager call go (cProfile, top functions by own time)."""
    import cProfile
    import pstats

    from flashspec_core.processors.sampling import SamplingParams
    from flashspec_core.verify.triton import verify_triton

    s = make_inputs(8, 128256, 4, False, torch.Generator(device="cuda").manual_seed(1))
    sp = SamplingParams(temperature=0.7)

    def calls() -> None:
        for _ in range(500):
            verify_triton(s["logits"], s["drafts"], None, sp, s["uniforms"], check_finite=False)
        torch.cuda.synchronize()

    calls()
    profiler = cProfile.Profile()
    profiler.runcall(calls)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def plot(results: dict, path: Path) -> bool:
    """Latency against B at γ = 4, one panel per draft kind; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in results["rows"] if r["gamma"] == 4]
    kinds = sorted({r["drafts"] for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for vocab in sorted({r["V"] for r in rows}):
            pts = sorted((r["B"], r["kernel_us"], r["torch_us"]) for r in rows
                         if r["drafts"] == kind and r["V"] == vocab)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"triton V={vocab}")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=line.get_color(),
                    label=f"torch V={vocab}")
        ax.set(xscale="log", yscale="log", xlabel="batch B", ylabel="µs per verify step",
               title=f"{kind} drafts, γ = 4, bf16, {results['device']}")
        ax.axhline(30, color="grey", lw=0.8, ls=":")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--quick", action="store_true", help="B in {1, 8}, V = 128256, γ = 4 only")
    parser.add_argument("--plot", type=Path, help="only draw the PNG from this saved JSON")
    parser.add_argument("--sweep", action="store_true", help="also time launch plans (BLOCK, TILES)")
    parser.add_argument("--profile-host", action="store_true",
                        help="only profile the host side of 500 eager calls (B=8, V=128256, γ=4)")
    args = parser.parse_args()
    if args.plot:
        results = json.loads(args.plot.read_text())
        out = args.plot.with_suffix(".png")
        sys.exit(0 if plot(results, out) else "matplotlib is not installed")

    if args.profile_host:
        profile_host()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    batches, vocabs, gammas = (1, 8, 32, 64, 256), (32000, 49152, 128256, 262144), (1, 4, 8)
    if args.quick:
        batches, vocabs, gammas = (1, 8), (128256,), (4,)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "hbm_gbs": hbm_ceiling_gbs(), "launch_floor_us": launch_floor_us(), "rows": []}
    import triton

    results["triton"] = triton.__version__
    results["eager_us_B8_V128256_g4"] = {"check_finite": eager_us(8, 128256, 4, True),
                                         "no_check": eager_us(8, 128256, 4, False)}
    for model, bsz, vocab, gamma in itertools.product((False, True), batches, vocabs, gammas):
        row = bench_one(bsz, vocab, gamma, model, gen)
        token_diffs = row["token_diffs"]
        row["pct_hbm"] = 100 * row["min_bytes"] / (row["kernel_us"] * 1e-6) / (results["hbm_gbs"] * 1e9)
        results["rows"].append(row)
        print(f"{row['drafts']:>6} B={bsz:<3} V={vocab:<6} γ={gamma}: kernel {row['kernel_us']:8.1f} µs"
              f"  torch {row['torch_us']:8.1f} µs  diffs={token_diffs}/{row['rows_checked']}",
              file=sys.stderr, flush=True)

    (args.out / "verify_kernel.json").write_text(json.dumps(results, indent=1))
    with open(args.out / "verify_kernel.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results["rows"][0]))
        writer.writeheader()
        writer.writerows(results["rows"])
    plot(results, args.out / "verify_kernel.png")

    print(f"{results['device']}, torch {results['torch']}, triton {results['triton']}; "
          f"HBM copy ceiling {results['hbm_gbs']:.0f} GB/s; empty-kernel graph replay "
          f"{results['launch_floor_us']:.2f} µs; eager call B=8 V=128256 γ=4: "
          f"{results['eager_us_B8_V128256_g4']['no_check']:.1f} µs "
          f"({results['eager_us_B8_V128256_g4']['check_finite']:.1f} µs with check_finite)")
    print("| drafts | B | V | γ | kernel µs | torch µs | speed-up | min MB | %HBM | same n_acc | token diffs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in results["rows"]:
        print(f"| {r['drafts']} | {r['B']} | {r['V']} | {r['gamma']} | {r['kernel_us']:.1f} | "
              f"{r['torch_us']:.1f} | {r['torch_us'] / r['kernel_us']:.1f}x | "
              f"{r['min_bytes'] / 1e6:.1f} | {r['pct_hbm']:.0f} | {'yes' if r['same_n_accepted'] else 'NO'} | "
              f"{r['token_diffs']}/{r['rows_checked']} |")
    if args.sweep:
        sweep(gen)


if __name__ == "__main__":
    main()
