"""The `flashspec-agents` console script: `demo`, `generate`, `calibrate`, `distill` and `serve`.

`demo` runs an agent-like stream of steps (chat, code, tool calls, answers over a pasted
document) through the default engine, then the same steps through plain HF `generate`, and
reports the speedup measured in that one run. `generate` streams one prompt to the terminal.
`calibrate` times the target's forward on this machine again; `distill` trains a draft;
`serve` runs the OpenAI-compatible endpoint.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flashspec_core.processors.sampling import SamplingParams


def _load_prompt(args: argparse.Namespace) -> str | list[dict]:
    if args.chat_file:
        path = Path(args.chat_file)
        if not path.is_file():
            raise SystemExit(f"--chat-file: {path} does not exist")
        try:
            messages = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--chat-file: {path} is not valid JSON ({exc})") from exc
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise SystemExit("--chat-file: expected a JSON list of {'role': ..., 'content': ...} messages")
        return messages
    if args.prompt is None:
        raise SystemExit("give a prompt, or --chat-file with a JSON list of chat messages")
    return [{"role": "user", "content": args.prompt}] if args.chat else args.prompt


def cmd_generate(args: argparse.Namespace) -> int:
    from flashspec_core.engine import SpecEngine

    prompt = _load_prompt(args)  # bad input is reported before the model loads
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    engine = SpecEngine.from_default() if args.model is None else SpecEngine.from_pretrained(args.model)
    last = None
    for chunk in engine.stream(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                               stop=args.stop or None, domain=args.domain):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    sys.stdout.write("\n")
    if args.stats and last is not None and last.stats is not None:
        print(json.dumps(last.stats.as_dict()), file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from flashspec_integrations.demo import run_demo

    run_demo(max_new_tokens=args.max_new_tokens, baseline=not args.no_baseline)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Time the target's forward per width and kernel on this machine again, cache and print it."""
    from flashspec_core.backends.calibration import STEADY, calibrate, machine_line, model_id
    from flashspec_core.engine import SpecEngine
    from flashspec_core.loading import CPU_GAMMAS, load_target
    from flashspec_core.models import vocab_size

    target = load_target(args.model)
    engine = SpecEngine(target, [], router="fixed", backend=args.backend, calibrate=False)
    runner = engine.runner
    if not runner.kernels() or runner.device.type != "cpu":
        raise ValueError("calibrate times CPU targets; this one runs on "
                         f"{runner.device} (its costs are learned by the router as it runs)")
    widths = [1] + [g + 1 for g in CPU_GAMMAS]
    cal = calibrate(runner, model_id(target.model), engine.backend, widths, vocab_size(target.model), force=True,
                    context=min(256, engine.context_window // 2))
    print(f"{machine_line()}; backend {engine.backend}")
    print(cal.table())
    if cal.spread > STEADY:
        print(f"not cached: repeated forwards differed by {cal.spread:.2f}x (the machine was busy); "
              "run it again when the machine is idle", file=sys.stderr)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    """Train a draft on ShareGPT's conversations; prints a JSON summary (weights, card, final metrics)."""
    from dataclasses import fields

    from flashspec_core.distill.command import run_distill
    from flashspec_core.distill.options import DistillOptions
    from flashspec_workloads.sharegpt import sharegpt_conversations

    opts = DistillOptions(**{f.name: getattr(args, f.name) for f in fields(DistillOptions)})
    summary = run_distill(opts,
                          conversations=lambda: sharegpt_conversations(split=None, domain=None, starts_only=False))
    print(json.dumps(summary, default=str))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from flashspec_integrations.serve.command import cmd_serve as run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashspec-agents", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="agent-like stream on the default model, with the speedup over HF generate")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--no-baseline", action="store_true", help="skip the plain HF generate comparison")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="stream one prompt to the terminal")
    gen.add_argument("prompt", nargs="?", help="the prompt text")
    gen.add_argument("--chat-file", help="a JSON file holding a list of chat messages")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--model", help="target: a .gguf file, a local folder or a cached HF id")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--domain", help="force the step's domain (chat, code, tool, rag, json, ...)")
    gen.add_argument("--stats", action="store_true", help="print speculation stats to stderr")
    gen.set_defaults(func=cmd_generate)

    cal = sub.add_parser("calibrate", help="time the target's forward per width on this machine and keep the "
                                           "fastest kernels (done once automatically; this re-runs it)")
    cal.add_argument("--model", help="target: a .gguf file, a local folder or a cached HF id (default: embedded)")
    cal.add_argument("--backend", default="auto", help="hf, llama.cpp or auto (the engine's choice)")
    cal.set_defaults(func=cmd_calibrate)

    from flashspec_core.distill.options import add_arguments as add_distill_arguments

    distill = sub.add_parser("distill", help="train a draft for a target by self-distillation (see docs/distill.md)")
    add_distill_arguments(distill)
    distill.set_defaults(func=cmd_distill)

    from flashspec_integrations.serve.command import add_arguments as add_serve_arguments  # no Ray import

    serve = sub.add_parser("serve", help="an OpenAI-compatible endpoint on Ray Serve (needs the 'serve' extra)")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
