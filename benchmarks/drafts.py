"""Trained drafts on the default model, per domain, on held-back ShareGPT dev prompts (CPU).

For each domain (chat, code) and each prompt, every configuration decodes greedily in turn
(interleaved, so drifting load on a shared machine hits all of them alike): plain HF `generate`,
HF prompt-lookup assisted generation, and the engine with a FixedRouter on one arm per run
(plain decoding, prompt lookup and each shipped trained draft at each γ). All must produce the
same tokens. The engine's plain arm ("none") separates what the engine's CPU linear layers gain
(cpu_linear.py) from what speculation gains on top.

Reported per arm and domain: mean accepted length (draft tokens accepted per step), acceptance
rate α = accepted / drafted, cost ratio c = draft seconds per drafted token / plain HF seconds per
token, the verify step's cost in plain-token units, tokens/s and the speedup over plain HF.

    python benchmarks/drafts.py --prompts 4 --max-new-tokens 64 --gammas 2,4 --out bench_out/drafts

Uses torch's default thread count; on a machine shared with other busy processes pass
`--threads 1` (two threads there spin against the other processes).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.drafts.prompt_lookup import PromptLookupDraft
from flashspec_core.drafts.trained import WEIGHTS_DIR, shipped_drafts
from flashspec_core.engine import SpecEngine
from flashspec_core.loading import load_target
from flashspec_core.routing.fixed import FixedRouter
from flashspec_workloads.baselines import hf_generate, stock_default_model
from flashspec_workloads.sharegpt import sharegpt_conversations

PROMPT_CHARS = (40, 600)


def dev_prompts(domain: str, n: int) -> list[list[dict[str, str]]]:
    """The first `n` dev-split ShareGPT first-turn prompts of a domain, of modest length."""
    out = []
    for conv in sharegpt_conversations(split="dev", domain=domain):
        if PROMPT_CHARS[0] <= len(conv.prompt[-1]["content"]) <= PROMPT_CHARS[1]:
            out.append(conv.prompt)
        if len(out) == n:
            break
    return out


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(None)
    drafts = [PromptLookupDraft()] + [d for d in shipped_drafts(target) if not args.drafts or d.name in args.drafts]
    gammas = [int(g) for g in args.gammas.split(",")]
    engines = {"none": SpecEngine(target, [], router=FixedRouter(Arm(NO_DRAFT, 0)), verify_backend="torch",
                                  backend="hf")}
    engines |= {f"{d.name}@{g}": SpecEngine(target, [d], router=FixedRouter(Arm(d.name, g)), verify_backend="torch",
                                           backend="hf")
               for d in drafts for g in ([args.lookup_gamma] if d.name == "prompt_lookup" else gammas)}
    base = next(iter(engines.values()))
    stock = stock_default_model()
    totals: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for domain in args.domains.split(","):
        prompts = dev_prompts(domain, args.prompts)
        for messages in tqdm(prompts, desc=f"{domain} prompts", unit="prompt"):
            ids = base.encode([messages], args.max_new_tokens)[0]
            ref, seconds = hf_generate(stock, ids, args.max_new_tokens, base.tokenizer.pad_token_id)
            cell = totals[("hf_generate", domain)]
            cell["tokens"] += len(ref)
            cell["seconds"] += seconds
            cell["same"] += 1
            cell["runs"] += 1
            out, seconds = hf_generate(stock, ids, args.max_new_tokens, base.tokenizer.pad_token_id,
                                       prompt_lookup_num_tokens=args.lookup_gamma)
            cell = totals[("hf_prompt_lookup", domain)]
            for k, v in (("tokens", len(out)), ("seconds", seconds), ("same", out == ref), ("runs", 1)):
                cell[k] += v
            for name, engine in engines.items():
                start = time.perf_counter()
                res = engine.generate(messages, max_new_tokens=args.max_new_tokens, domain=domain)
                seconds = time.perf_counter() - start
                cell = totals[(name, domain)]
                st = res.stats
                for k, v in (("tokens", len(res.token_ids)), ("seconds", seconds), ("same", res.token_ids == ref),
                             ("runs", 1), ("steps", st.steps), ("drafted", st.drafted), ("accepted", st.accepted),
                             ("draft_seconds", sum(r.draft_seconds for r in st.records)),
                             ("verify_seconds", sum(r.verify_seconds for r in st.records))):
                    cell[k] += v
    return summarise(totals)


def summarise(totals) -> dict:
    rows = []
    for (arm, domain), c in totals.items():
        hf = totals[("hf_generate", domain)]
        hf_tok = hf["seconds"] / max(hf["tokens"], 1)  # seconds per token of plain decoding
        row = {"arm": arm, "domain": domain, "runs": int(c["runs"]), "identical": int(c["same"]),
               "tokens": int(c["tokens"]), "tok_s": c["tokens"] / c["seconds"],
               "speedup": (c["tokens"] / c["seconds"]) / (hf["tokens"] / hf["seconds"])}
        if c.get("steps"):
            row["verify_cost"] = (c["verify_seconds"] / c["steps"]) / hf_tok
        if c.get("drafted"):
            row.update({"accept_len": c["accepted"] / c["steps"], "alpha": c["accepted"] / c["drafted"],
                        "c": (c["draft_seconds"] / c["drafted"]) / hf_tok})
        rows.append(row)
    return {"rows": rows}


def table(result: dict) -> str:
    lines = ["| domain | configuration | tok/s | speedup vs HF generate | identical | mean accepted length | α | c "
             "| verify cost (× one plain token) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["domain"], -r["speedup"])):
        extra = (f"{r['accept_len']:.2f} | {r['alpha']:.3f} | {r['c']:.3f}" if "alpha" in r else "– | – | –")
        extra += f" | {r['verify_cost']:.2f}" if "verify_cost" in r else " | –"
        lines.append(f"| {r['domain']} | {r['arm']} | {r['tok_s']:.2f} | {r['speedup']:.2f}× | "
                     f"{r['identical']}/{r['runs']} | {extra} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({r["domain"] for r in result["rows"]})
    arms = sorted({r["arm"] for r in result["rows"]})
    speed = {(r["arm"], r["domain"]): r["speedup"] for r in result["rows"]}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(domains)
    for i, domain in enumerate(domains):
        ax.bar([a + i * width for a in range(len(arms))], [speed.get((arm, domain), 0) for arm in arms], width,
               label=domain)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([a + width * (len(domains) - 1) / 2 for a in range(len(arms))], arms, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain HF generate")
    ax.set_title("Trained drafts on SmolLM2-135M-Instruct, CPU, greedy, ShareGPT dev prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def card_section(result: dict, name: str, command: str) -> str:
    rows = [r for r in result["rows"] if r["arm"].startswith(name + "@")]
    lines = ["| domain | γ | mean accepted length | α | c | speedup vs HF generate |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["domain"], r["arm"])):
        lines.append(f"| {r['domain']} | {r['arm'].split('@')[1]} | {r['accept_len']:.2f} | {r['alpha']:.3f} | "
                     f"{r['c']:.3f} | {r['speedup']:.2f}× |")
    return f"`{command}` (CPU, greedy, dev prompts):\n\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default="chat,code")
    parser.add_argument("--prompts", type=int, default=4, help="dev prompts per domain")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gammas", default="2,4")
    parser.add_argument("--lookup-gamma", type=int, default=3, help="γ of prompt lookup (HF and engine)")
    parser.add_argument("--drafts", default="", help="comma list of shipped draft names (default: all)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default; 1 on a busy shared CPU)")
    parser.add_argument("--out", default="bench_out/drafts")
    parser.add_argument("--update-cards", action="store_true", help="write the results into the shipped model cards")
    parser.add_argument("--from-json", help="re-render table, plot and cards from an earlier drafts.json; run nothing")
    args = parser.parse_args()
    args.drafts = [d for d in args.drafts.split(",") if d]
    result = json.loads(Path(args.from_json).read_text()) if args.from_json else run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafts.json").write_text(json.dumps(result, indent=1))
    (out / "drafts.md").write_text(table(result) + "\n")
    plot(result, out / "drafts.png")
    print(table(result))
    if args.update_cards:
        from flashspec_core.distill.card import update_card_section

        command = "python benchmarks/drafts.py " + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in (("prompts", args.prompts), ("max_new_tokens", args.max_new_tokens), ("gammas", args.gammas)))
        for card in WEIGHTS_DIR.glob("*.md"):
            update_card_section(card, "Measured in the engine (CPU)", card_section(result, card.stem, command))


if __name__ == "__main__":
    main()
