"""Constrained decoding on the default model: forced tool calls over the 50-tool suite.

Configurations (all greedy, all constrained by the call's JSON schema, so all must emit the same
tokens): plain constrained decoding (no speculation), the grammar-forced draft alone
(forced tokens only), the grammar-forced draft with grammar-filtered prompt-lookup copies, and
the Thompson router over {none, grammar, prompt_lookup} × γ. Cases run interleaved (each case
under every configuration before the next case) so that drifting load on a shared machine hits
all configurations alike. Prints a table, writes a PNG and a JSON under --out; never asserts.

    python benchmarks/constrained.py --out bench_out/constrained
    python benchmarks/constrained.py --engines     # mask speed: xgrammar vs llguidance vs outlines-core
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import torch

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.constrained import GrammarForcedDraft, tool_call_schema
from flashspec_core.constrained.tool_suite import TOOL_SUITE, forced_call_messages
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.loading import load_target
from flashspec_core.routing.fixed import FixedRouter

CONFIGS = ("plain", "forced", "forced+copy", "router")


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0  # after the first step, whose time is mostly the prompt's prefill
    decode_seconds: float = 0.0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    valid: int = 0
    calls: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def make_engine(name: str, target, gamma: int) -> SpecEngine:
    if name == "plain":
        return SpecEngine(target, [], router=FixedRouter(Arm(NO_DRAFT, 0)))
    if name == "forced":
        return SpecEngine(target, [GrammarForcedDraft(lookup_ngram=0)], router=FixedRouter(Arm("grammar", gamma)))
    if name == "forced+copy":
        return SpecEngine(target, [GrammarForcedDraft()], router=FixedRouter(Arm("grammar", gamma)))
    return SpecEngine(target, [GrammarForcedDraft(), PromptLookupDraft()], router="thompson", gammas=(2, 4, 8))


def run_case(engine: SpecEngine, case: dict, max_new_tokens: int, tally: Tally) -> None:
    schema = tool_call_schema([case["tool"]])
    messages = forced_call_messages(case["tool"], case["request"])
    start = time.perf_counter()
    res = engine.generate(messages, max_new_tokens=max_new_tokens, json_schema=schema, hint="tool")
    tally.seconds += time.perf_counter() - start
    tally.tokens += len(res.token_ids)
    first = res.stats.records[0]
    tally.decode_tokens += len(res.token_ids) - first.emitted
    tally.decode_seconds += res.stats.seconds - first.seconds
    tally.steps += res.stats.steps
    tally.drafted += res.stats.drafted
    tally.accepted += res.stats.accepted
    tally.calls += 1
    tally.outputs.append(res.token_ids)
    try:
        jsonschema.validate(json.loads(res.text), schema)
        tally.valid += 1
    except (json.JSONDecodeError, jsonschema.ValidationError):
        pass


def decode_benchmark(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    target = load_target(None)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise ValueError(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    engines = {c: make_engine(c, target, args.gamma) for c in configs}
    cases = TOOL_SUITE[: args.cases]
    warm = cases[0]
    for engine in engines.values():  # compile the grammar vocabulary and warm the kernels once
        engine.generate(forced_call_messages(warm["tool"], warm["request"]), max_new_tokens=4,
                        json_schema=tool_call_schema([warm["tool"]]))
    tallies = {c: Tally() for c in configs}
    for i, case in enumerate(cases):
        order = configs[i % len(configs):] + configs[: i % len(configs)]
        for c in order:
            run_case(engines[c], case, args.max_new_tokens, tallies[c])
        print(f"case {i + 1}/{len(cases)} {case['tool']['function']['name']}: "
              + ", ".join(f"{c} {tallies[c].tokens_per_second:.1f} tok/s" for c in configs), flush=True)
    report(args, configs, tallies, engines)


def report(args, configs, tallies: dict[str, Tally], engines: dict[str, SpecEngine]) -> None:
    base = tallies[configs[0]]
    same = {c: sum(a == b for a, b in zip(base.outputs, tallies[c].outputs)) for c in configs}
    header = (f"{'config':<12} {'tok/s':>7} {'speedup':>8} {'decode tok/s':>12} {'speedup':>8} {'tokens':>7} "
              f"{'steps':>6} {'tok/step':>8} {'accept':>7} {'valid':>7} {'same as ' + configs[0]:>14}")
    print(header)
    rows = []
    for c in configs:
        t = tallies[c]
        row = {
            "config": c, "tokens_per_second": round(t.tokens_per_second, 2),
            "speedup": round(t.tokens_per_second / base.tokens_per_second, 2) if base.tokens_per_second else None,
            "decode_tokens_per_second": round(t.decode_tokens_per_second, 2),
            "decode_speedup": round(t.decode_tokens_per_second / base.decode_tokens_per_second, 2)
            if base.decode_tokens_per_second else None,
            "tokens": t.tokens, "steps": t.steps, "tokens_per_step": round(t.tokens / t.steps, 2) if t.steps else 0,
            "acceptance": round(t.accepted / t.drafted, 3) if t.drafted else None,
            "valid": f"{t.valid}/{t.calls}", "identical": f"{same[c]}/{t.calls}", "seconds": round(t.seconds, 1),
        }
        rows.append(row)
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(f"{c:<12} {row['tokens_per_second']:>7.2f} {row['speedup']:>7.2f}x "
              f"{row['decode_tokens_per_second']:>12.2f} {row['decode_speedup']:>7.2f}x {t.tokens:>7} {t.steps:>6} "
              f"{row['tokens_per_step']:>8.2f} {acc:>7} {row['valid']:>7} {row['identical']:>14}")
    router = engines.get("router")
    arms = router.router_summary().get("tool", {}) if router else {}
    if arms:
        pulls = {a: s["pulls"] for a, s in arms.items() if s["pulls"]}
        print("router pulls in the tool domain:", dict(sorted(pulls.items(), key=lambda kv: -kv[1])))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cases": args.cases, "max_new_tokens": args.max_new_tokens, "gamma": args.gamma, "threads": args.threads,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows,
            "router_pulls": {a: s["pulls"] for a, s in arms.items()}}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["config"] for r in rows]
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [r["tokens_per_second"] for r in rows], 0.4, label="per call (with prefill)")
    ax1.bar([i + 0.2 for i in x], [r["decode_tokens_per_second"] for r in rows], 0.4, label="decode only")
    ax1.set_xticks(list(x), names)
    ax1.legend()
    ax1.set_ylabel("tokens / s")
    ax1.set_title("Constrained tool calls, default model (CPU)")
    ax2.bar(names, [r["tokens_per_step"] for r in rows], color="tab:green")
    ax2.set_ylabel("tokens per target forward")
    ax2.set_title("Tokens per step")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------- grammar engine comparison

ENGINE_SCHEMA = tool_call_schema([TOOL_SUITE[8]["tool"]])  # book_flight: enums, bounded ints, optional keys
ENGINE_CALL = {"name": "book_flight", "arguments": {"origin": "San Francisco", "destination": "Tokyo Haneda",
                                                    "date": "2025-03-14", "passengers": 2, "cabin": "business"}}


def _time_trace(step, ids: list[int]) -> list[float]:
    per = []
    for tok in ids:
        start = time.perf_counter()
        step(tok)
        per.append(time.perf_counter() - start)
    return per


def _xgrammar(tokenizer, vocab: int, ids: list[int]):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[ids[-1]])
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        ENGINE_SCHEMA, any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - start
    matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)

    def step(tok):
        matcher.fill_next_token_bitmask(bitmask)
        assert matcher.accept_token(tok)
    return compile_s, _time_trace(step, ids)


def _llguidance(tokenizer, vocab: int, ids: list[int]):
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        ENGINE_SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)

    def step(tok):
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        assert matcher.consume_token(tok)
    return compile_s, _time_trace(step, ids)


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte (outlines-core wants bytes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _outlines_core(tokenizer, vocab: int, ids: list[int]):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    decoder, eos = _byte_decoder(), ids[-1]
    mapping: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i != eos:
            raw = bytes(decoder[c] for c in token) if all(c in decoder for c in token) else token.encode()
            mapping.setdefault(raw, []).append(i)
    regex = build_regex_from_schema(json.dumps(ENGINE_SCHEMA), r"[ ]?")
    start = time.perf_counter()
    index = Index(regex, Vocabulary(eos, mapping))
    compile_s = time.perf_counter() - start
    guide, mask = Guide(index), torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def step(tok):
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        if tok != eos:
            guide.advance(tok)
    return compile_s, _time_trace(step, ids)


def engines_benchmark(args: argparse.Namespace) -> None:
    import numpy as np

    target = load_target(None)
    tokenizer, vocab = target.tokenizer, target.model.get_output_embeddings().weight.shape[0]
    text = json.dumps(ENGINE_CALL, separators=(", ", ": "))
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    print(f"trace: {len(ids)} tokens of a book_flight call; vocabulary {vocab}; {args.repeats} repeats, best kept")
    print(f"{'engine':<14} {'compile ms':>10} {'mean µs/token':>14} {'p50':>7} {'p99':>8}")
    for name, fn in (("xgrammar", _xgrammar), ("llguidance", _llguidance), ("outlines-core", _outlines_core)):
        try:
            runs = [fn(tokenizer, vocab, ids) for _ in range(args.repeats)]
        except ImportError:
            print(f"{name:<14} not installed")
            continue
        compile_s = min(r[0] for r in runs)
        per = min((np.asarray(r[1]) * 1e6 for r in runs), key=lambda a: a.mean())
        print(f"{name:<14} {compile_s * 1e3:>10.1f} {per.mean():>14.1f} {np.percentile(per, 50):>7.1f} "
              f"{np.percentile(per, 99):>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=len(TOOL_SUITE))
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--gamma", type=int, default=8, help="γ of the fixed grammar-draft arms")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a loaded 2-core box)")
    parser.add_argument("--out", default="bench_out/constrained")
    parser.add_argument("--engines", action="store_true", help="compare grammar engines' mask speed instead")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.engines:
        engines_benchmark(args)
    else:
        decode_benchmark(args)


if __name__ == "__main__":
    main()
