"""How often the target calls a tool on its own under tool_choice="auto", through the LangChain adapter.

Forced calls are decoded under the tool's schema and always parse; under "auto" nothing is forced
(forcing would change the target's output), so whether a call comes out is the model's choice. This
measures that choice: each of the 50 requests of the tool suite (flashspec_core/constrained/
tool_suite.py) with its tool and two others bound, and ten requests that need no tool, greedy. It
also takes another tool-prompt template (`--tools-header FILE`, a str.format template with a
`{tools}` field, as `flashspec_integrations.prompts.TOOLS_HEADER`), to tell a prompt problem from a
model one.

    python benchmarks/auto_tool_calls.py --out bench_out/auto_tool_calls
"""
from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

from langchain_core.messages import HumanMessage
from tqdm import tqdm

import flashspec_integrations.prompts as prompts
from flashspec_core.constrained.tool_suite import TOOL_SUITE
from flashspec_integrations.langchain import ChatFlashSpec

NO_TOOL_REQUESTS = [
    "Hi! How are you today?", "Write a haiku about autumn leaves.", "What is the capital of France?",
    "Explain what a linked list is in two sentences.", "Tell me a joke about cats.",
    "Thank you, that's all I needed.", "Who wrote Romeo and Juliet?", "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish.", "What does HTTP stand for?",
]
OUTCOMES = ("right tool", "other tool", "invalid call", "prose")


def outcome(message, wanted: str | None) -> str:
    names = [c["name"] for c in message.tool_calls]
    if wanted is not None and wanted in names:
        return "right tool"
    if names:
        return "other tool"
    return "invalid call" if message.invalid_tool_calls else "prose"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools-header", default=None, help="file with another tool-prompt template")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default="bench_out/auto_tool_calls")
    args = parser.parse_args()
    if args.tools_header:
        prompts.TOOLS_HEADER = Path(args.tools_header).read_text()
    rng = random.Random(0)
    tools = [entry["tool"] for entry in TOOL_SUITE]
    cases = [(e["tool"], e["request"]) for e in TOOL_SUITE] + [(None, r) for r in NO_TOOL_REQUESTS]
    counts = {"tool request": Counter(), "no-tool request": Counter()}
    rows = []
    for tool, request in tqdm(cases, desc="auto tool choice"):
        bound = ([tool] if tool else []) + rng.sample([t for t in tools if t is not tool], 2)
        rng.shuffle(bound)
        model = ChatFlashSpec(max_tokens=args.max_tokens, no_repeat_ngram_size=3).bind_tools(bound)
        reply = model.invoke([HumanMessage(request)])
        wanted = tool["function"]["name"] if tool else None
        result = outcome(reply, wanted)
        counts["tool request" if tool else "no-tool request"][result] += 1
        rows.append({"request": request, "wanted": wanted, "outcome": result, "content": reply.content,
                     "tool_calls": reply.tool_calls, "invalid_tool_calls": reply.invalid_tool_calls})
    print(f"\ntool_choice='auto', greedy, max_tokens={args.max_tokens}, header: {args.tools_header or 'default'}")
    print(f"{'requests':<16}{'n':>4}" + "".join(f"{o:>14}" for o in OUTCOMES))
    for kind, c in counts.items():
        print(f"{kind:<16}{sum(c.values()):>4}" + "".join(f"{c[o]:>14}" for o in OUTCOMES))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"counts": counts, "rows": rows}, indent=1, default=str))
    plot(counts, out / "auto_tool_calls.png")


def plot(counts: dict[str, Counter], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    kinds = list(counts)
    left = [0] * len(kinds)
    for i, o in enumerate(OUTCOMES):
        widths = [counts[k][o] for k in kinds]
        ax.barh(kinds, widths, left=left, color=f"C{i}", label=o)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("requests")
    ax.set_title("What the target does under tool_choice='auto'")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
