"""Tool calls the model chooses (tool_choice="auto"): validity with and without the structural tag,
how often the default model calls, and what the tag costs on chat steps.

Three parts, all greedy on the default model (or --target), each with the constraint and without it
(an engine the adapters see as one without `json_schema=`: free output, parsed leniently):

1. BFCL-style requests through the LangChain adapter, `bind_tools(tools)` with the choice left to
   the model: each of the 50 tool-suite requests with its tool and two other suite tools bound
   ("multiple"), and 10 requests no tool answers ("irrelevance"). Outcome per request: a valid call
   of the right tool, of another bound tool; an invalid call opened with `<tool_call>`, cut by the
   token limit or complete; a JSON object outside any tag that the lenient parser takes for a call
   but that is not valid (the tag constrains tagged calls only); prose.
2. Primed calls: the same 50 requests rendered with the Hermes tool prompt and the assistant turn
   begun with `<tool_call>\n`, decoded by the engine, under `tool_tags(..., opened=...)` or not.
   A call is valid when it parses, names a bound tool and its arguments validate.
3. Chat steps with tools bound: prompts that want prose, rendered with the tools listed, decoded
   with the tag and without it, the same prompt ids, per fixed arm (plain decoding: one masked
   position a step; prompt lookup at γ = 8: nine), in ABBA order; wall seconds per step (the
   request's set-up, steps and commits; the prompt's prefill excluded), each configuration's
   fastest run per prompt (a shared machine only ever adds time), averaged over prompts; the
   seconds spent in the grammar's own work, timed inside those calls (its share of a step without
   it); and whether the tokens are the same.

    python benchmarks/auto_tool_calls.py --out bench_out/auto_tool_calls
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import jsonschema
import torch
from langchain_core.messages import HumanMessage

import flashspec_integrations.prompts as prompts
from flashspec_core import constrained
from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.constrained import Constraint, tool_tags
from flashspec_core.constrained.tool_suite import TOOL_SUITE
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.handle import RequestHandle
from flashspec_core.loading import load_target
from flashspec_core.results import GenerationResult
from flashspec_core.routing.fixed import FixedRouter
from flashspec_integrations.langchain import ChatFlashSpec
from flashspec_integrations.prompts import render_prompt
from flashspec_integrations.tool_calls import CALL_OPEN, parse_tool_calls

NO_TOOL_REQUESTS = [
    "Hi! How are you today?", "Write a haiku about autumn leaves.", "What is the capital of France?",
    "Explain what a linked list is in two sentences.", "Tell me a joke about cats.",
    "Thank you, that's all I needed.", "Who wrote Romeo and Juliet?", "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish.", "What does HTTP stand for?",
]
CHAT_REQUESTS = NO_TOOL_REQUESTS + [
    "Why is the sky blue?", "Describe a good breakfast.", "What is a prime number?", "How do plants grow?",
    "Name three famous painters.", "What is the difference between weather and climate?",
]
OUTCOMES = ("right tool", "other tool", "cut at limit", "invalid tagged", "untagged JSON", "prose")
OPENED = CALL_OPEN + "\n"


class Recording:
    """The engine as the adapter calls it (`flashspec_core.engine_protocol.Engine`), with every
    request's handle kept, so the reply's raw text can be read after the call."""

    def __init__(self, engine: SpecEngine) -> None:
        self._engine = engine
        self.handles: list[RequestHandle] = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def submit(self, prompts, options, /, *, stream=False) -> RequestHandle:
        self.handles.append(self._engine.submit(prompts, options, stream=stream))
        return self.handles[-1]

    @property
    def last(self) -> GenerationResult:
        return self.handles[-1].wait()[0]


class WithoutGrammar(Recording):
    """The engine as the adapters see one that cannot decode under a grammar: free output."""

    constrains = False


def schemas_of(tools: list[dict]) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


def valid(name: str | None, args: dict | None, schemas: dict[str, dict]) -> bool:
    if name not in schemas or not isinstance(args, dict):
        return False
    try:
        jsonschema.validate(args, schemas[name])
    except jsonschema.ValidationError:
        return False
    return True


def outcome(calls: list[tuple[str | None, dict | None]], wanted: str | None, schemas: dict[str, dict],
            text: str, finish_reason: str) -> str:
    """What a reply holds: valid calls (of the wanted tool, or another), an invalid call opened
    with `<tool_call>` (cut by the token limit, or complete), a JSON object outside any tag that
    the lenient parser takes for a call but that is not valid, or prose."""
    if not calls:
        return "prose"
    if all(valid(n, a, schemas) for n, a in calls):
        return "right tool" if wanted in [n for n, _ in calls] else "other tool"
    if CALL_OPEN not in text:
        return "untagged JSON"
    return "cut at limit" if finish_reason == "length" else "invalid tagged"


def cases(rng: random.Random) -> list[tuple[str, str | None, str, list[dict]]]:
    tools = [entry["tool"] for entry in TOOL_SUITE]
    out = []
    for tool, request in [(e["tool"], e["request"]) for e in TOOL_SUITE] + [(None, r) for r in NO_TOOL_REQUESTS]:
        bound = ([tool] if tool else []) + rng.sample([t for t in tools if t is not tool], 2)
        rng.shuffle(bound)
        out.append(("multiple" if tool else "irrelevance", tool["function"]["name"] if tool else None, request, bound))
    return out


def part_auto(engine: SpecEngine, max_tokens: int, limit: int, rows: list) -> dict:
    """1: the adapter with the choice left to the model, with and without the tag."""
    counts: dict[str, Counter] = {}
    for grammar in (True, False):
        recorder = Recording(engine) if grammar else WithoutGrammar(engine)
        model = ChatFlashSpec(engine=recorder, max_tokens=max_tokens, no_repeat_ngram_size=3)
        every = cases(random.Random(0))
        for kind, wanted, request, bound in every[:limit] + every[len(TOOL_SUITE):]:
            reply = model.bind_tools(bound).invoke([HumanMessage(request)])
            raw = recorder.last
            calls = [(c["name"], c["args"]) for c in reply.tool_calls] + \
                    [(c["name"], None) for c in reply.invalid_tool_calls]
            result = outcome(calls, wanted, schemas_of(bound), raw.text, raw.finish_reason)
            counts.setdefault(f"{kind} {'with' if grammar else 'without'} tag", Counter())[result] += 1
            rows.append({"part": "auto", "grammar": grammar, "request": request, "wanted": wanted,
                         "outcome": result, "text": raw.text, "calls": calls})
    return counts


def part_primed(engine: SpecEngine, max_tokens: int, limit: int, rows: list) -> dict:
    """2: the assistant turn begun with the tag, so a call is open from the first token."""
    counts: dict[str, Counter] = {}
    for _kind, wanted, request, bound in cases(random.Random(0))[:limit]:
        text = render_prompt(engine.tokenizer, [{"role": "user", "content": request}], bound) + OPENED
        ids = engine.tokenizer(text, add_special_tokens=False).input_ids
        for grammar in (True, False):
            spec = tool_tags(bound, opened=OPENED, parallel=False) if grammar else None
            # Free output stops where its call closes; under the tag the grammar ends the reply there.
            stop = None if grammar else ["</tool_call>"]
            res = engine.generate(ids, max_new_tokens=max_tokens, stop=stop, json_schema=spec, hint="tool")
            closed = res.text if grammar or res.finish_reason == "length" else res.text + "</tool_call>"
            _, parsed = parse_tool_calls(OPENED + closed, list(schemas_of(bound)),
                                         res.finish_reason != "length")
            calls = [(c.name, c.arguments) for c in parsed] or [(None, None)]
            result = outcome(calls, wanted, schemas_of(bound), OPENED + res.text, res.finish_reason)
            counts.setdefault(f"primed {'with' if grammar else 'without'} tag", Counter())[result] += 1
            rows.append({"part": "primed", "grammar": grammar, "request": request, "wanted": wanted,
                         "outcome": result, "text": res.text})
    return counts


class GrammarClock:
    """Seconds spent in the constraint's own work (built per request, masks along each draft path,
    commits), timed inside the engine's calls: a measure of its cost that a busy shared machine
    slows in proportion, where the difference of two end-to-end timings drowns in noise."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> GrammarClock:
        self._saved = (constrained.constraint_for, Constraint.mask_logits, Constraint.commit)
        constrained.constraint_for = self._timed(self._saved[0])
        Constraint.mask_logits = self._timed(self._saved[1])
        Constraint.commit = self._timed(self._saved[2])
        return self

    def __exit__(self, *exc) -> None:
        constrained.constraint_for, Constraint.mask_logits, Constraint.commit = self._saved

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def part_cost(target, max_tokens: int, reps: int, limit: int, rows: list) -> dict:
    """3: wall seconds per step of chat steps with tools bound, with and without the tag."""
    tools = [e["tool"] for e in TOOL_SUITE[:3]]
    spec = tool_tags(tools)
    out = {}
    for arm in (Arm(NO_DRAFT, 0), Arm("prompt_lookup", 8)):
        engine = SpecEngine(target, [PromptLookupDraft()], router=FixedRouter(arm))
        per_step: dict[bool, list[float]] = {True: [], False: []}
        grammar_per_step: list[float] = []
        same = 0
        for request in CHAT_REQUESTS[:limit]:
            ids = engine.tokenizer(render_prompt(engine.tokenizer, [{"role": "user", "content": request}], tools),
                                   add_special_tokens=False).input_ids
            engine.generate(ids, max_new_tokens=4, json_schema=spec)  # the prompt's prefix cached alike for both
            runs: dict[bool, list] = {True: [], False: []}
            for rep in range(reps):
                for grammar in ((False, True) if rep % 2 == 0 else (True, False)):  # ABBA: no order favoured
                    with GrammarClock() as clock:
                        t0 = time.perf_counter()
                        res = engine.generate(ids, max_new_tokens=max_tokens, json_schema=spec if grammar else None,
                                              hint="tool")
                        wall = time.perf_counter() - t0  # the request's set-up, steps and commits
                    runs[grammar].append(((wall - res.stats.prefill_seconds) / res.stats.steps, res))
                    if grammar:
                        grammar_per_step.append(clock.seconds / res.stats.steps)
            for grammar in (False, True):  # each configuration's least-disturbed run on this prompt
                per_step[grammar].append(min(s for s, _ in runs[grammar]))
            same += runs[True][0][1].token_ids == runs[False][0][1].token_ids
            rows.append({"part": "cost", "arm": str(arm), "request": request,
                         "opened_a_call": CALL_OPEN in runs[True][0][1].text,
                         "ms_per_step": {str(g): [1e3 * s for s, _ in runs[g]] for g in runs}})
        without, with_tag = statistics.mean(per_step[False]), statistics.mean(per_step[True])
        ratios = sorted(t / f for f, t in zip(per_step[False], per_step[True]))
        grammar_ms = 1e3 * statistics.median(grammar_per_step)
        out[str(arm)] = {"ms_per_step_without": 1e3 * without, "ms_per_step_with": 1e3 * with_tag,
                         "ratio": with_tag / without, "ratio_median": statistics.median(ratios),
                         "ratio_range": [ratios[0], ratios[-1]], "grammar_ms_per_step": grammar_ms,
                         "grammar_share": grammar_ms / (1e3 * without),
                         "identical_outputs": f"{same}/{len(CHAT_REQUESTS[:limit])}"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="a target of your own; default: SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--primed-tokens", type=int, default=160)
    parser.add_argument("--chat-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--parts", default="auto,primed,cost")
    parser.add_argument("--limit", type=int, default=len(TOOL_SUITE), help="suite requests (and chat prompts) to run")
    parser.add_argument("--tools-header", default=None,
                        help="another tool-prompt template (a str.format template with a {tools} field)")
    parser.add_argument("--out", default="bench_out/auto_tool_calls")
    args = parser.parse_args()
    if args.tools_header:
        prompts.TOOLS_HEADER = Path(args.tools_header).read_text()
    parts = args.parts.split(",")
    target = load_target(args.target)
    engine = SpecEngine.from_default() if args.target is None else SpecEngine(target)
    rows: list = []
    results: dict = {"machine": {"cpu": platform.processor() or platform.machine(),
                                 "torch_threads": torch.get_num_threads()}}
    start = time.time()
    if "auto" in parts:
        results["auto"] = part_auto(engine, args.max_tokens, args.limit, rows)
    if "primed" in parts:
        results["primed"] = part_primed(engine, args.primed_tokens, args.limit, rows)
    if "cost" in parts:
        results["cost"] = part_cost(target, args.chat_tokens, args.reps, args.limit, rows)
    results["seconds"] = round(time.time() - start, 1)
    for part in ("auto", "primed"):
        if part in results:
            print(f"\n{part}: greedy, max_tokens={args.max_tokens if part == 'auto' else args.primed_tokens}")
            print(f"{'requests':<28}{'n':>4}" + "".join(f"{o:>16}" for o in OUTCOMES))
            for kind, c in results[part].items():
                print(f"{kind:<28}{sum(c.values()):>4}" + "".join(f"{c[o]:>16}" for o in OUTCOMES))
    if "cost" in results:
        print(f"\nchat steps with tools bound, {args.chat_tokens} tokens, {args.reps} runs of each per prompt (ABBA), "
              "each prompt's fastest run, mean over prompts")
        print(f"{'arm':<18}{'ms/step without':>16}{'ms/step with':>14}{'ratio':>8}{'median ratio':>14}"
              f"{'grammar ms/step':>17}{'share':>8}{'same tokens':>13}")
        for arm, r in results["cost"].items():
            print(f"{arm:<18}{r['ms_per_step_without']:>16.2f}{r['ms_per_step_with']:>14.2f}{r['ratio']:>8.3f}"
                  f"{r['ratio_median']:>14.3f}{r['grammar_ms_per_step']:>17.3f}{100 * r['grammar_share']:>7.2f}%"
                  f"{r['identical_outputs']:>13}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**results, "rows": rows}, indent=1, default=str))
    print(f"\n{results['seconds']} s; results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
