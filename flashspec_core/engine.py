"""The decode loop: draft, verify, roll back, stream, stop.

Each step the router picks an arm (a draft source and γ) from past steps only; the draft proposes,
the target scores the proposal in one forward pass, `verify` accepts a prefix and appends the
recovered or bonus token, and the target's cache rolls back to what was verified. The output is
exactly the target's distribution whatever the arm; the arm only changes how fast it arrives.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Iterator, Sequence

import torch

from flashspec_core.backends import make_runner, resolve_backend
from flashspec_core.drafts import DraftSource
from flashspec_core.models import LoadedModel, eos_ids, vocab_size
from flashspec_core.processors.ngram_ban import OutputTokens, ban_repeated_ngrams, json_punctuation_tokens
from flashspec_core.processors.penalty import SeenTokens, penalize_paths
from flashspec_core.proposals import cut_to_lengths, step_proposal
from flashspec_core.prompts import PromptLike, encode_prompts, is_batch, prompt_text
from flashspec_core.results import GenerationResult, GenerationStats, StreamChunk
from flashspec_core.routing.domains import resolve_domain
from flashspec_core.processors.sampling import SamplingParams, request_generator, request_params
from flashspec_core.stopping import RowOutput
from flashspec_core.types import NO_DRAFT, Arm, Router, StepRecord
from flashspec_core.verify import BACKENDS, verify


class SpecEngine:
    """Exact speculative decoding over a pool of draft sources chosen per step by a router."""

    _default: "SpecEngine | None" = None
    _default_lock = threading.Lock()

    def __init__(
        self,
        target: LoadedModel,
        drafts: Sequence[DraftSource] = (),
        router: Router | str = "thompson",
        gammas: Sequence[int] | None = None,
        verify_backend: str = "auto",
        backend: str = "auto",
        calibrate: bool = True,
    ):
        """backend: where the target's forward runs ("hf", "llama.cpp"; "auto" picks llama.cpp for
        a GGUF target on the CPU when llama-cpp-python is installed, see backends/__init__.py).
        calibrate: time the target's forward per width on this machine at first use (cached per
        CPU in the cache folder) to pick the fastest kernel and seed the router's cost model.
        gammas: the γ of each draft's arms; None: `pool.default_gammas` (16 too on a GPU).
        """
        if gammas is None:
            from flashspec_core.pool import default_gammas

            gammas = default_gammas(target)
        if verify_backend not in BACKENDS:
            raise ValueError(f"verify_backend must be one of {BACKENDS}; got {verify_backend!r}")
        if not gammas or any(not isinstance(g, int) or not 1 <= g <= 16 for g in gammas):
            raise ValueError(f"gammas must be a non-empty list of ints in [1, 16]; got {list(gammas)!r}")
        names = [d.name for d in drafts]
        if len(set(names)) != len(names) or NO_DRAFT in names:
            raise ValueError(f"drafts must have distinct names other than {NO_DRAFT!r}; got {names}")
        self._target = target
        self.drafts: dict[str, DraftSource] = {d.name: d for d in drafts}
        self.arms = [Arm(NO_DRAFT, 0)] + [Arm(d.name, g) for d in drafts for g in gammas]
        if isinstance(router, str):
            from flashspec_core.routing import make_router

            router = make_router(router, self.arms, self.drafts)
        self.router: Router = router
        self.verify_backend = verify_backend
        self.eos_ids = eos_ids(target)
        self.context_window = int(getattr(target.model.config, "max_position_embeddings", 0) or 1 << 30)
        self._lock = threading.Lock()
        self._owner: int | None = None
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.backend = resolve_backend(backend, target)
        # Kept across requests: prefix reuse.
        self._target_runner = make_runner(target, self.backend, pad, self.context_window)
        self._device = target.model.get_output_embeddings().weight.device
        self._vocab = vocab_size(target.model)
        self.calibration = self._calibrate(gammas) if calibrate else None
        warm = getattr(self._target_runner, "warm", None)
        if callable(warm):  # CUDA graphs of every width the arms feed, captured now, not mid-request
            warm([1] + [g + 1 for g in gammas])
        self._json_tokens: torch.Tensor | None = None  # [V] bool, built on the first ban under a schema

    def _calibrate(self, gammas: Sequence[int]):
        """Measured forward cost per width on this machine (cached): the kernel per width, and the
        router's starting cost model. Only the CPU runners take part; a GPU's costs are learned."""
        runner = self._target_runner
        if not hasattr(runner, "kernels") or runner.device.type != "cpu":
            return None
        from flashspec_core.backends.calibration import CONTEXT, LONGER, PREFILL_WIDTH, calibrate, model_id

        widths = [1] + [g + 1 for g in gammas]
        context = min(CONTEXT, self.context_window // 2)
        longer = max(0, min(LONGER, self.context_window - context - PREFILL_WIDTH - 1))
        cal = calibrate(runner, model_id(self.target_model), self.backend, widths, vocab_size(self.target_model),
                        context=context, longer=longer)
        runner.plan = cal
        if hasattr(self.router, "set_forward_costs"):
            self.router.set_forward_costs(cal.forward_seconds(), cal.slopes, cal.context)
        if hasattr(self.router, "set_expected_goodput"):
            self._seed_router(cal.forward_seconds())
        return cal

    def _seed_router(self, forward_seconds: dict[int, float]) -> None:
        """The router's prior for each model-draft arm: the draft's measured acceptance priced at
        this machine's costs (routing/priors.py). A draft is timed here (~0.1 s) only if it has one."""
        from flashspec_core.routing.priors import draft_token_seconds, expected_goodput

        measured = {name: d for name, d in self.drafts.items() if getattr(d, "accepted_lengths", None)}
        costs = {name: draft_token_seconds(d, self._vocab) for name, d in measured.items()}
        accepted = {name: d.accepted_lengths for name, d in measured.items()}
        arms = [a for a in self.arms if a in getattr(self.router, "arms", ())]  # a router built for fewer arms
        self.router.set_expected_goodput(expected_goodput(arms, accepted, costs, forward_seconds))

    @classmethod
    def from_default(cls) -> "SpecEngine":
        """The embedded default target with the default draft pool and a Thompson router whose
        statistics persist, once per process."""
        with cls._default_lock:
            if cls._default is None:
                from flashspec_core.pool import default_drafts, default_gammas, load_target
                from flashspec_core.routing import make_router

                target = load_target(None)
                drafts = default_drafts(target)
                arms = [Arm(NO_DRAFT, 0)] + [Arm(d.name, g) for d in drafts for g in default_gammas(target)]
                router = make_router("thompson", arms, {d.name: d for d in drafts}, persist=True)
                cls._default = cls(target, drafts, router=router)
            return cls._default

    @classmethod
    def from_pretrained(
        cls,
        target: str | None = None,
        drafts: Sequence[str | DraftSource] | None = None,
        router: Router | str = "thompson",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        load_in_4bit: bool = False,
        gammas: Sequence[int] | None = None,
        verify_backend: str = "auto",
        backend: str = "auto",
    ) -> "SpecEngine":
        """target: None (embedded default), a .gguf file, a local folder or a cached HF id.

        drafts: names from `flashspec_core.pool.DRAFT_NAMES`, paths or HF ids of model drafts, or
        DraftSource objects; None gives the default pool.
        """
        from flashspec_core.pool import build_drafts, load_target

        loaded = load_target(target, device=device, dtype=dtype, load_in_4bit=load_in_4bit)
        pool = build_drafts(drafts, loaded, target, device=device, dtype=dtype)
        return cls(loaded, pool, router=router, gammas=gammas, verify_backend=verify_backend, backend=backend)

    @property
    def tokenizer(self):
        return self._target.tokenizer

    @property
    def target_model(self):
        return self._target.model

    @property
    def model_name(self) -> str:
        return self._target.name

    def router_summary(self) -> dict:
        """Per-domain arm choices and goodput, as the router reports them."""
        summary = getattr(self.router, "summary", None)
        return summary() if callable(summary) else {}

    # ----------------------------------------------------------------------------------- API

    def generate(
        self,
        prompt: PromptLike | Sequence[PromptLike],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: str | Sequence[str] | None = None,
        domain: str | None = None,
        hint: str | None = None,
        json_schema: dict | str | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (str, chat messages or token ids) or a list of them as a batch.

        json_schema: constrain the output to JSON valid against this schema (a forced tool call,
        structured output; {"type": "object"} for JSON mode): exactly the law of grammar-masked
        decoding of the target, not its law conditioned on a valid output (README, "What is
        exact"; flashspec_core.constrained, whose Grammar is also accepted).
        """
        batch = is_batch(prompt)
        prompts = list(prompt) if batch else [prompt]
        if not prompts:
            raise ValueError("prompt: the batch is empty; pass at least one prompt")
        rows, stats = None, None
        for rows, _, stats in self._run(prompts, max_new_tokens, sampling, stop, domain, hint, json_schema):
            pass
        results = [
            GenerationResult(r.text, list(r.token_ids), r.finish_reason or "length", s, prompt_tokens=s.prompt_tokens)
            for r, s in zip(rows, stats)
        ]
        return results if batch else results[0]

    def stream(
        self,
        prompt: PromptLike,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: str | Sequence[str] | None = None,
        domain: str | None = None,
        hint: str | None = None,
        json_schema: dict | str | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield text as it is verified; the last chunk carries finish_reason and stats."""
        if is_batch(prompt):
            raise ValueError("prompt: stream takes one prompt; use generate for a batch")
        for rows, new, stats in self._run([prompt], max_new_tokens, sampling, stop, domain, hint, json_schema):
            row = rows[0]
            delta = row.take_delta()
            if row.finished:
                yield StreamChunk(delta, new[0], row.finish_reason, stats[0])
            elif delta or new[0]:
                yield StreamChunk(delta, new[0])

    # ------------------------------------------------------------------------------ the loop

    def encode(self, prompts: Sequence[PromptLike], max_new_tokens: int) -> list[list[int]]:
        """The token ids `generate` would decode from for each prompt (chat template applied);
        ValueError when one does not fit the context window with `max_new_tokens`."""
        return encode_prompts(self.tokenizer, prompts, self._vocab, max_new_tokens, self.context_window)

    def _acquire(self) -> None:
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "this engine is still inside an unfinished stream in this thread; "
                "exhaust or close() that stream before starting another request"
            )
        self._lock.acquire()
        self._owner = threading.get_ident()

    def _release(self) -> None:
        self._owner = None
        self._lock.release()

    def _run(self, prompts, max_new_tokens, sampling, stop, domain, hint, json_schema=None):
        sampling, stops = request_params(max_new_tokens, sampling, stop)
        encoded = self.encode(prompts, max_new_tokens)
        constraint = None
        if json_schema is not None:
            from flashspec_core.constrained import constraint_for

            vocab = vocab_size(self.target_model)
            constraint = constraint_for(json_schema, self.tokenizer, vocab, self.eos_ids, encoded)
            hint = hint or "json"
        step_domain = resolve_domain(domain, hint, prompt_text(self.tokenizer, prompts[0]))
        self._acquire()
        try:
            yield from self._decode(encoded, max_new_tokens, sampling, stops, step_domain, constraint)
        finally:
            self._release()

    def _in_graph(self, sampling: SamplingParams, constraint) -> bool:
        """Whether steps may run forward and verification as one call of the runner (a CUDA-graph
        replay): no logits processor between them, and the verify backend the graph runs (torch
        ops for greedy steps, the Triton kernel for sampled ones) not pinned to another."""
        pinned_ok = self.verify_backend == "auto" or (self.verify_backend == "triton" and not sampling.greedy)
        return (sampling.repetition_penalty == 1.0 and not sampling.no_repeat_ngram_size
                and constraint is None and pinned_ok and hasattr(self._target_runner, "verify_step"))

    def _forward_and_verify(self, target, seqs, seen, outputs, drafts, draft_probs, active, sampling, constraint,
                            gen, first=None, while_waiting=None):
        """Score every row's context + draft in one target forward and verify; host lists out.

        seen, outputs: what the penalty and the n-gram ban read on the device (None when off).
        first: [B, 1, V] the prefill's logits after each whole prompt, on the first step: they
        score the first position, and the forward feeds only the draft (see `_prefill`).
        while_waiting: host work the graphed step runs while the GPU computes (not called otherwise).
        """
        if first is None and self._in_graph(sampling, constraint):
            fused = target.verify_step(seqs, drafts, active, sampling, draft_probs, gen, while_waiting)
            if fused is not None:
                return fused
        g = len(drafts[0])
        paths = [s + d for s, d in zip(seqs, drafts)]
        if first is None:
            logits = target.forward_to(paths, active, keep_logits=g + 1)
        elif g:
            logits = torch.cat([first, target.forward_to(paths, active, keep_logits=g).to(first.device)], dim=1)
        else:
            logits = first
        draft_tokens = torch.tensor(drafts, dtype=torch.long).view(len(seqs), g).to(logits.device, non_blocking=True)
        if seen is not None:
            logits = penalize_paths(logits, seen, draft_tokens, sampling.repetition_penalty)
        if constraint is not None:  # -inf where the grammar forbids, along each draft path
            logits = constraint.mask_logits(logits, drafts, active)
        if outputs is not None:
            exempt = None if constraint is None else self._json_punctuation(logits)
            logits = ban_repeated_ngrams(logits, outputs, draft_tokens, sampling.no_repeat_ngram_size, exempt)
        # A request's first step (the only eager one on CUDA graphs) verifies on torch ops unless
        # pinned: Triton compiles its kernel per shape at first use (0.36 s on an H200, against a
        # 2 ms step), and the router would charge that to the step's arm and verify width.
        backend = "torch" if first is not None and self.verify_backend == "auto" else self.verify_backend
        n_acc, out = verify(logits, draft_tokens, draft_probs, sampling, backend=backend, generator=gen)
        return n_acc.tolist(), out.tolist()

    def _learn(self, unlearned: list[StepRecord]) -> None:
        """Hand the router the finished steps it has not learned from yet."""
        while unlearned:
            self.router.update(unlearned.pop(0))

    def _json_punctuation(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] bool on the logits' device: tokens the n-gram ban leaves alone under a JSON schema; built once."""
        if self._json_tokens is None:
            self._json_tokens = json_punctuation_tokens(self.tokenizer, logits.shape[-1]).to(logits.device)
        return self._json_tokens

    def _prefill(self, target, prompts, stats) -> torch.Tensor:
        """Feed each whole prompt (past what the cache reuses) before the first step, timed apart
        from the steps, and return the logits after it: [B, 1, V].

        The first token is scored from the prompt's own forward, as plain decoding scores it
        (HF `generate` and llama.cpp alike): some kernels round a long batch differently from a
        short one (llama.cpp's prompt kernels moved logits by up to 0.7 against a one-token
        pass), so re-feeding the last prompt token with the first draft could break a near-tie
        the other way. The router scores arms on decode steps only: a long prompt's prefill
        would otherwise land on whichever arm the first step happened to pick.
        """
        reused = [target.prefix_len(b, p) for b, p in enumerate(prompts)]
        start = time.perf_counter()
        first = target.forward_to(prompts, keep_logits=1)
        seconds = time.perf_counter() - start
        for st, n in zip(stats, reused):
            st.cached_prompt_tokens = min(n, st.prompt_tokens - 1)
            st.prefill_seconds = st.seconds = seconds
        return first

    def _decode(self, prompts, max_new_tokens, sampling, stops, domain, constraint=None):
        target = self._target_runner
        target.begin(len(prompts))  # a single prompt reuses the previous request's common prefix
        for d in self.drafts.values():
            d.begin(prompts)
            if hasattr(d, "bind_constraint"):  # drafts that read the grammar state (constrained/)
                d.bind_constraint(constraint)
        rows = [RowOutput(self.tokenizer, self.eos_ids, stops, max_new_tokens) for _ in prompts]
        seqs = [list(p) for p in prompts]
        stats = [GenerationStats(domain, prompt_tokens=len(p)) for p in prompts]
        gen = request_generator(sampling, self._device)
        # On CUDA graphs the router learns from a step while the GPU runs the next one (its
        # host work, ~0.1-0.3 ms, is then off the critical path); it selects one step behind,
        # which exactness does not care about. Elsewhere it learns at once.
        overlap = getattr(target, "use_graphs", False) and self._in_graph(sampling, constraint)
        unlearned: list[StepRecord] = []
        learn = functools.partial(self._learn, unlearned)
        # Draft lengths a step verifies uncut (() = any): a sampled step on graphs replays a graph
        # of its exact width, so its proposal is cut to a warmed one (proposals.cut_to_lengths).
        lengths = tuple(w - 1 for w in getattr(target, "widths", ())) if overlap and not sampling.greedy else ()
        try:
            first = self._prefill(target, prompts, stats)
            # What the penalty and the ban read, on the device: committed to below, never reread per step.
            seen = SeenTokens(prompts, first.shape[-1], first.device) if sampling.repetition_penalty != 1.0 else None
            outputs = OutputTokens([[] for _ in prompts], first.device) if sampling.no_repeat_ngram_size else None
            while True:
                active = [not r.finished for r in rows]
                if not any(active):
                    break
                arm = self.router.select(domain)
                remaining = min(r.max_new_tokens - len(r.token_ids) for r, a in zip(rows, active) if a)
                warmed = getattr(target, "warmup_seconds", 0.0)
                t0 = time.perf_counter()
                drafts, draft_probs, catchup = step_proposal(
                    self.drafts.get(arm.draft), seqs, active, min(arm.gamma, remaining - 1), sampling, gen,
                    self._vocab, self._device)
                drafts, draft_probs = cut_to_lengths(drafts, draft_probs, lengths)
                g = len(drafts[0])
                t1 = time.perf_counter()
                prefilled = first is not None
                n_acc, out = self._forward_and_verify(
                    target, seqs, seen, outputs, drafts, draft_probs, active, sampling, constraint, gen, first,
                    while_waiting=learn)
                first = None
                t2 = time.perf_counter()
                learn()  # when no graph ran it
                context_row = active.index(True)
                context_len = len(seqs[context_row])
                new = [[] for _ in rows]
                for b in (b for b, a in enumerate(active) if a):
                    new[b] = rows[b].append(out[b][: n_acc[b] + 1])
                    seqs[b].extend(new[b])
                    for state in (constraint, seen, outputs):
                        if state is not None:
                            state.commit(b, new[b])
                record = StepRecord(
                    domain=domain,
                    arm=arm,
                    drafted=g * sum(active),
                    accepted=sum(n for n, a in zip(n_acc, active) if a),
                    emitted=sum(len(n) for n in new),
                    draft_seconds=t1 - t0,
                    verify_seconds=t2 - t1,
                    context_len=context_len,
                    sequence=seqs[context_row],
                    rows=sum(active),
                    catchup_seconds=catchup,
                    warmup_seconds=getattr(target, "warmup_seconds", 0.0) - warmed,
                    draft_lengths=lengths,
                    prefilled=prefilled,
                )
                unlearned.append(record)
                if not overlap:
                    learn()
                for b in (b for b, a in enumerate(active) if a):
                    stats[b].drafted += g
                    stats[b].accepted += n_acc[b]
                    stats[b].seconds += record.seconds
                    stats[b].records.append(record)
                    stats[b].host_seconds += time.perf_counter() - t2
                yield rows, new, stats
        except GeneratorExit:  # a stream closed early, between steps: the cache is consistent
            raise
        except BaseException:  # mid-forward: the cache may hold half a step; never reuse it
            target.reset(1)
            raise
        finally:
            learn()
            for d in self.drafts.values():
                d.end(prompts, [r.token_ids for r in rows])
            flush = getattr(self.router, "flush", None)
            if callable(flush):
                flush()
