"""The host's share of a scheduler step, by phase, with a target whose forward costs nothing.

A step of many rows is the device's forward plus the host's work around it: the router's choice of
each row's arm, the drafts' proposals, the forward's inputs, verifying on the host what the device
did not, committing tokens and checking stop strings, handing text to callers, the router's
learning. On a GPU with graphs the forward of 64 rows costs a few milliseconds, so the host's part
decides the step's time. This drives the real engine (`SpecEngine`: scheduler, stepper, router,
prompt lookup and suffix-cache drafts, the default model's tokenizer) with a runner whose forward
returns seeded logits at once (`FreeRunner`), so what is timed is the host's work alone.

Workload: `--rows` callers at once (threads), each running its share of agent-shaped requests one
after another: prompts of 200-1,500 tokens whose phrases recur, domains tool / rag / code / chat,
budgets of 64-192 tokens; greedy, temperature 0.7, top-p 0.9 at temperature 1, and greedy with a
stop string, in turn; every other request streamed. The free target's next token is a fixed hash
of the last two tokens (a spike over seeded noise), so outputs fall into loops the copy drafts
learn to propose, as agents' outputs quote their inputs; sampled rows leave the spike now and then.

Phases (each timed exclusive of the phases it calls; `time.perf_counter` around methods wrapped by
this script only, so the engine itself carries no instrumentation): `select` (router.select),
`draft` (the step's proposals), `budget` (the token budget's cut and learning, with graphs), `plan`
(building the forward's inputs), `verify` (verify on the host), `commit` (appending tokens, stop
strings, the step's records), `learn` (router.update), `deliver` (text and results to the handles,
retiring rows), `admit` (admission and prefill bookkeeping), `other` (the rest of the loop's turn).
`forward` is the free runner's own time (not host work of the engine); `flush` (the router's store
writes) runs on a thread of its own. Per configuration the repeat with the lowest host ms per step
is shown (one untimed warm-up first). Never asserts: a measurement.

    PYTHONPATH=. python benchmarks/host_step.py [--rows 1 8 64] [--repeats 3] [--graphs] [--out bench_out/host_step]

`--graphs` runs the free runner as a graphed one (as on a GPU): greedy rows are verified with the
forward (`score_step`), prompts are fed apart from the steps.
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flashspec_core.step as step_module
from flashspec_core import SpecEngine
from flashspec_core.backends.base import TargetRunner, WhileWaiting
from flashspec_core.backends.calibration import machine_line
from flashspec_core.backends.prefix import common_prefix
from flashspec_core.drafts import PromptLookupDraft, SuffixCacheDraft
from flashspec_core.loading import load_target
from flashspec_core.models import LoadedModel
from flashspec_core.processors.paths import PathProcessors
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.stopping import RowOutput

DOMAINS = ("tool", "rag", "code", "chat")
STOP = " Observation"
SETTINGS = (SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9), None)
PHRASES = ("Thought: I should call the search tool with the user's query. Action: search(query=\"flights to Oslo\")"
           " Observation: 3 results found. The first result says the cheapest flight leaves at 7:40 from gate B12."
           " def parse(row): return {key: value for key, value in row.items() if value is not None}"
           " The retrieved document states that the policy applies to every contract signed after March.")
HOST_PHASES = ("select", "draft", "budget", "plan", "verify", "commit", "learn", "deliver", "admit", "other")
SPIKE = 14.0  # the chain token's logit over the noise: sampled rows follow it most of the time


class FreeRunner(TargetRunner):
    """A target runner whose forward costs (almost) nothing: the logits after a token are seeded
    noise over the vocabulary plus `SPIKE` at `next_token` of the last two tokens. It keeps each
    row's tokens as a real runner keeps its cache (prefix reuse, rollback) but computes nothing.
    graphs: act as a graphed runner (greedy rows verified with the forward, as a CUDA graph does)."""

    def __init__(self, vocab: int, words: Sequence[int], graphs: bool, seed: int = 0) -> None:
        self.device = torch.device("cpu")
        self.use_graphs = graphs
        self.words = list(words)
        generator = torch.Generator().manual_seed(seed)
        self.noise = torch.randn(vocab, generator=generator) * 2.0  # [V]
        self.held: list[list[int]] = [[]]
        self.seconds = 0.0  # time spent in this runner's own forwards

    def step_seconds(self) -> dict[int, float]:
        """With graphs, a replay-time table shaped like a GPU's (flat at few rows, a wide step dearer
        at many), so the token budget does its host work as it would there."""
        if not self.use_graphs:
            return {}
        return {w: 2e-3 * (1 + w * len(self.held) / 256) for w in (1, 2, 3, 5, 9, 17)}

    def next_token(self, a: int, b: int) -> int:
        return self.words[((a * 1_000_003 + b) * 2_654_435_761 >> 7) % len(self.words)]

    def begin(self, batch_size: int) -> None:
        self.reset(batch_size)

    def reset(self, batch_size: int) -> None:
        self.held = [[] for _ in range(batch_size)]

    def resize(self, rows: int) -> None:
        self.held = self.held[:rows] + [[] for _ in range(rows - len(self.held))]

    def prefix_len(self, row: int, sequence: Sequence[int]) -> int:
        return common_prefix(self.held[row], sequence)

    def forward_to(self, sequences: Sequence[Sequence[int]], active: Sequence[bool] | None = None,
                   keep_logits: int = 1) -> torch.Tensor:
        raise NotImplementedError("FreeRunner scores rows with score_rows")

    def _logits(self, sequence: Sequence[int], need: int) -> torch.Tensor:
        """[need, V]: the logits after each of the last `need` tokens of `sequence`."""
        ends = range(len(sequence) - need, len(sequence))
        spikes = [self.next_token(sequence[j - 1] if j else 0, sequence[j]) for j in ends]
        logits = self.noise.repeat(need, 1)
        logits[torch.arange(need), torch.tensor(spikes)] += SPIKE
        return logits

    def score_rows(self, sequences: Sequence[Sequence[int] | None], needs: Sequence[int]) -> list[torch.Tensor | None]:
        start = time.perf_counter()
        out: list[torch.Tensor | None] = [None] * len(sequences)
        for b, (sequence, need) in enumerate(zip(sequences, needs)):
            if sequence is not None and need > 0:
                self.held[b] = list(sequence)
                out[b] = self._logits(sequence, need)
        self.seconds += time.perf_counter() - start
        return out

    def score_step(self, sequences: Sequence[Sequence[int]], needs: Sequence[int],
                   drafts: Sequence[Sequence[int] | None], active: Sequence[bool],
                   while_waiting: WhileWaiting | None = None,
                   ) -> tuple[list[list[int] | None], list[torch.Tensor | None]] | None:
        if not self.use_graphs:
            return None
        start = time.perf_counter()
        verified: list[list[int] | None] = [None] * len(sequences)
        logits: list[torch.Tensor | None] = [None] * len(sequences)
        for b, (sequence, need, draft) in enumerate(zip(sequences, needs, drafts)):
            if not active[b]:
                continue
            self.held[b] = list(sequence)
            if draft is None:
                logits[b] = self._logits(sequence, need)
                continue
            context = list(sequence[:len(sequence) - len(draft)])
            tokens = []
            for proposed in [*draft, None]:
                token = self.next_token(context[-2] if len(context) > 1 else 0, context[-1])
                tokens.append(token)
                if token != proposed:
                    break
                context.append(token)
            verified[b] = [len(tokens) - 1, *tokens]
        self.seconds += time.perf_counter() - start
        if while_waiting is not None:
            while_waiting(lambda: False)
        return verified, logits


class PhaseClock:
    """Exclusive seconds per phase: each wrapped call's time less that of the wrapped calls inside
    it, per thread. Wrapping is done by this script (`wrap`); nothing is timed in the engine."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner = getattr(owner, name)
        clock = self

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = clock._local.__dict__.setdefault("stack", [])
            frame = [0.0]  # seconds spent in wrapped calls inside this one
            stack.append(frame)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                stack.pop()
                clock.seconds[phase] += spent - frame[0]
                if stack:
                    stack[-1][0] += spent

        had = name in vars(owner) if isinstance(owner, type) else name in getattr(owner, "__dict__", {})
        setattr(owner, name, timed)
        keep = had or isinstance(owner, type)
        self._undo.append(lambda: setattr(owner, name, inner) if keep else delattr(owner, name))

    def ms_per_step(self, steps: int) -> dict[str, float]:
        """ms per scheduler step of each phase (the host's, the forward and the router's flush)."""
        return {p: self.seconds.get(p, 0.0) / steps * 1e3 for p in (*HOST_PHASES, "forward", "flush")}

    def undo(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def instrument(engine: SpecEngine, runner: FreeRunner) -> PhaseClock:
    """Wrap the engine's step phases (see the module doc) in a fresh clock."""
    clock = PhaseClock()
    scheduler, stepper, router = engine._scheduler, engine._stepper, engine.router
    clock.wrap(scheduler, "_turn", "other")
    clock.wrap(scheduler, "_admit", "admit")
    clock.wrap(scheduler, "_deliver", "deliver")
    clock.wrap(stepper, "_prefilled", "admit")
    clock.wrap(stepper, "step", "commit")  # the step's own lines: committing tokens, records
    clock.wrap(stepper, "_propose", "draft")
    clock.wrap(stepper.budget, "cut", "budget")
    clock.wrap(stepper.budget, "learn", "budget")
    clock.wrap(stepper, "_score", "plan")
    clock.wrap(stepper, "_mixed", "plan")
    clock.wrap(stepper, "_fused", "plan")
    clock.wrap(step_module, "verify_rows", "verify")
    clock.wrap(RowOutput, "append", "commit")
    clock.wrap(PathProcessors, "commit", "commit")
    clock.wrap(router, "select", "select")
    clock.wrap(router, "update", "learn")
    clock.wrap(router, "flush", "flush")
    clock.wrap(runner, "score_rows", "forward")
    clock.wrap(runner, "score_step", "forward")
    return clock


def make_engine(rows: int, graphs: bool, seed: int) -> tuple[SpecEngine, FreeRunner]:
    """The real engine over a tiny model with the default model's tokenizer, its runner replaced
    by a FreeRunner: every part of a step is the engine's but the forward."""
    tokenizer = load_target(None).tokenizer
    vocab = len(tokenizer)
    config = LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    loaded = LoadedModel(model, tokenizer, "free")
    engine = SpecEngine(loaded, [PromptLookupDraft(), SuffixCacheDraft()], router="thompson", calibrate=False,
                        backend="hf", max_batch=rows, max_context=4096)
    words = sorted(set(tokenizer.encode(PHRASES, add_special_tokens=False)))
    runner = FreeRunner(vocab, words, graphs, seed)
    engine.runner = runner
    runner.resize(len(engine._scheduler._slots))
    return engine, runner


def make_requests(n: int, words: Sequence[int], seed: int) -> list[dict[str, Any]]:
    """n agent-shaped requests (see the module doc), each the `submit` arguments of one call."""
    rng = random.Random(seed)
    phrases = [[rng.choice(words) for _ in range(rng.randint(4, 14))] for _ in range(64)]
    out = []
    for i in range(n):
        length = rng.randint(200, 1500)
        prompt: list[int] = []
        while len(prompt) < length:
            prompt += rng.choice(phrases) if rng.random() < 0.6 else [rng.choice(words) for _ in range(6)]
        setting = SETTINGS[i % len(SETTINGS)]
        sampling = SamplingParams() if setting is None else setting
        if not sampling.greedy:
            sampling = sampling.model_copy(update={"seed": seed * 1000 + i})
        out.append({"prompt": prompt[:length], "max_new_tokens": rng.randint(64, 192), "sampling": sampling,
                    "stop": STOP if setting is None else None, "domain": DOMAINS[i % len(DOMAINS)],
                    "stream": i % 2 == 0})
    return out


def run(engine: SpecEngine, requests: list[dict[str, Any]], callers: int) -> list[list[int]]:
    """`callers` threads, each taking the next request when its last one ended; every output."""

    def one(r: dict[str, Any]) -> list[int]:
        options = {k: r[k] for k in ("max_new_tokens", "sampling", "stop", "domain")}
        handle = engine.submit([r["prompt"]], stream=r["stream"], **options)
        if r["stream"]:
            return [t for chunk in handle for t in chunk.token_ids]
        return list(handle.wait()[0].token_ids)

    with ThreadPoolExecutor(max_workers=callers) as pool:
        return list(pool.map(one, requests))


def measure(rows: int, graphs: bool, repeats: int, per_row: int, seed: int) -> dict[str, Any]:
    """The repeat with the lowest host ms per step: ms per step by phase, steps, tokens."""
    best: dict[str, Any] | None = None
    for r in range(repeats + 1):
        engine, runner = make_engine(rows, graphs, seed)
        words = runner.words
        run(engine, make_requests(max(4, rows), words, seed + 1000 + r), rows)  # warm-up, untimed
        work = make_requests(rows * per_row, words, seed + r)
        clock = instrument(engine, runner)
        steps0 = engine._scheduler.steps
        start = time.perf_counter()
        outputs = run(engine, work, rows)
        wall = time.perf_counter() - start
        steps = engine._scheduler.steps - steps0
        clock.undo()
        engine.close()
        phases = clock.ms_per_step(steps)
        result = {"rows": rows, "graphs": graphs, "steps": steps, "tokens": sum(map(len, outputs)),
                  "wall_s": wall, "host_ms": sum(phases[p] for p in HOST_PHASES), "phases_ms": phases}
        if r and (best is None or result["host_ms"] < best["host_ms"]):
            best = result
    assert best is not None
    return best


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    labels = [f"{r['rows']} rows{' (graphs)' if r['graphs'] else ''}" for r in results]
    bottom = [0.0] * len(results)
    for phase in HOST_PHASES:
        values = [r["phases_ms"][phase] for r in results]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("host ms per step")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64], help="concurrent rows (callers, max_batch)")
    parser.add_argument("--requests-per-row", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graphs", action="store_true", help="the free runner acts as a graphed one (a GPU's path)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out/host_step")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    results = [measure(rows, args.graphs, args.repeats, args.requests_per_row, args.seed) for rows in args.rows]
    title = (f"host ms per scheduler step by phase, free target forward{' (graphed)' if args.graphs else ''}; "
             f"lowest of {args.repeats}")
    print(machine_line())
    print(title)
    cols = "".join(f"{p:>8}" for p in HOST_PHASES)
    print(f"{'rows':>5}{'steps':>7}{'tok/step':>9}{'host ms':>9}{'-verify':>9}{cols}{'forward':>9}{'flush':>7}")
    for r in results:
        ph = r["phases_ms"]
        print(f"{r['rows']:>5}{r['steps']:>7}{r['tokens'] / r['steps']:>9.1f}{r['host_ms']:>9.2f}"
              f"{r['host_ms'] - ph['verify']:>9.2f}"
              + "".join(f"{ph[p]:>8.2f}" for p in HOST_PHASES) + f"{ph['forward']:>9.2f}{ph['flush']:>7.2f}")
    (out / "host_step.json").write_text(json.dumps({"machine": machine_line(), "title": title, "results": results,
                                                     "args": vars(args)}, indent=1))
    plot(results, out / "host_step.png", f"{machine_line()}\n{title}")


if __name__ == "__main__":
    main()
