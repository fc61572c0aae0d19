"""The decode loop: draft, verify, roll back, stream, stop.

Each step the router picks an arm (a draft source and γ) from past steps only; the draft proposes,
the target scores the proposal in one forward pass, `verify` accepts a prefix and appends the
recovered or bonus token, and the target's cache rolls back to what was verified. The output is
exactly the target's distribution whatever the arm; the arm only changes how fast it arrives.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flashspec_core.backends import make_runner, resolve_backend
from flashspec_core.backends.calibration import Calibration, calibrate_runner
from flashspec_core.constrained.constraint import Constraint
from flashspec_core.drafts import DraftSource
from flashspec_core.models import LoadedModel, eos_ids, vocab_size
from flashspec_core.processors.ngram_ban import json_punctuation_tokens
from flashspec_core.processors.paths import PathProcessors
from flashspec_core.processors.sampling import SamplingParams, request_generator, request_params
from flashspec_core.prompts import PromptLike, encode_prompts, is_batch, prompt_text
from flashspec_core.proposals import cut_to_lengths, step_proposal
from flashspec_core.request import RequestState
from flashspec_core.results import GenerationResult, GenerationStats, StreamChunk
from flashspec_core.routing.base import Router
from flashspec_core.routing.domains import resolve_domain
from flashspec_core.routing.priors import seed_router
from flashspec_core.stopping import RowOutput
from flashspec_core.types import NO_DRAFT, Arm, StepRecord
from flashspec_core.verify import BACKENDS, Backend, verify


class SpecEngine:
    """Exact speculative decoding over a pool of draft sources chosen per step by a router."""

    _default: SpecEngine | None = None
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
    ) -> None:
        """backend: where the target's forward runs ("hf", "cuda-graph", "llama.cpp"; "auto" picks
        CUDA graphs for a Llama-family model on a GPU and transformers otherwise; llama.cpp is
        opt-in, see backends/__init__.py).
        calibrate: time the target's forward per width on this machine at first use (cached per
        CPU in the cache folder) to pick the fastest kernel and seed the router's cost model.
        gammas: the γ of each draft's arms; None: `pool.default_gammas` (16 too on a GPU).
        router: a `Router` (routing/base.py) or a name from `routing.ROUTER_NAMES`.
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
        if not isinstance(router, Router):
            raise ValueError(f"router must be a Router (flashspec_core.routing.Router: subclass it for the defaults "
                             f"of what select/update do not cover) or a router name; got {type(router).__name__}")
        self.router: Router = router
        self.verify_backend: Backend = verify_backend  # type: ignore[assignment]  # checked against BACKENDS above
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
        # CUDA graphs of every width the arms feed, captured now, not mid-request
        self._target_runner.warm([1] + [g + 1 for g in gammas])
        self._json_tokens: torch.Tensor | None = None  # [V] bool, built on the first ban under a schema

    def _calibrate(self, gammas: Sequence[int]) -> Calibration | None:
        """Measured forward cost per width on this machine (cached): the kernel per width, and the
        router's starting cost model and priors. Only the CPU runners take part; a GPU's costs are learned."""
        runner = self._target_runner
        cal = calibrate_runner(runner, self.target_model, self.backend, [1] + [g + 1 for g in gammas],
                               self.context_window)
        if cal is not None:
            runner.plan = cal
            self.router.set_forward_costs(cal.forward_seconds(), cal.slopes, cal.context)
            seed_router(self.router, self.drafts, cal.forward_seconds(), self._vocab)
        return cal

    @classmethod
    def from_default(cls) -> SpecEngine:
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
    ) -> SpecEngine:
        """target: None (embedded default), a .gguf file, a local folder or a cached HF id.

        drafts: names from `flashspec_core.pool.DRAFT_NAMES`, paths or HF ids of model drafts, or
        DraftSource objects; None gives the default pool.
        """
        from flashspec_core.pool import build_drafts, load_target

        loaded = load_target(target, device=device, dtype=dtype, load_in_4bit=load_in_4bit)
        pool = build_drafts(drafts, loaded, target, device=device, dtype=dtype)
        return cls(loaded, pool, router=router, gammas=gammas, verify_backend=verify_backend, backend=backend)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._target.tokenizer

    @property
    def target_model(self) -> PreTrainedModel:
        return self._target.model

    @property
    def model_name(self) -> str:
        return self._target.name

    def router_summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Per-domain arm choices and goodput, as the router reports them."""
        return self.router.summary()

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
        prompts = cast("list[PromptLike]", list(prompt)) if batch else [cast(PromptLike, prompt)]  # is_batch told
        if not prompts:
            raise ValueError("prompt: the batch is empty; pass at least one prompt")
        state: RequestState | None = None
        for step_state, _ in self._run(prompts, max_new_tokens, sampling, stop, domain, hint, json_schema):
            state = step_state
        assert state is not None  # a request decodes at least one step
        results = [
            GenerationResult(r.text, list(r.token_ids), r.finish_reason or "length", s, prompt_tokens=s.prompt_tokens)
            for r, s in zip(state.rows, state.stats)
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
        for state, new in self._run([prompt], max_new_tokens, sampling, stop, domain, hint, json_schema):
            row = state.rows[0]
            delta = row.take_delta()
            if row.finished:
                yield StreamChunk(delta, new[0], row.finish_reason, state.stats[0])
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

    def _run(self, prompts: Sequence[PromptLike], max_new_tokens: int, sampling: SamplingParams | None,
             stop: str | Sequence[str] | None, domain: str | None, hint: str | None,
             json_schema: dict | str | None = None) -> Iterator[tuple[RequestState, list[list[int]]]]:
        """Decode one request; yields its state and each row's new tokens after every step."""
        sampling, stops = request_params(max_new_tokens, sampling, stop)
        encoded = self.encode(prompts, max_new_tokens)
        constraint = None
        if json_schema is not None:
            from flashspec_core.constrained import constraint_for

            constraint = constraint_for(json_schema, self.tokenizer, self._vocab, sorted(self.eos_ids), encoded)
            hint = hint or "json"
        step_domain = resolve_domain(domain, hint, prompt_text(self.tokenizer, prompts[0]))
        target = self._target_runner
        # On CUDA graphs the router learns from a step while the GPU runs the next (its host work
        # is then off the critical path); it selects one step behind, which exactness does not
        # care about. Elsewhere it learns at once.
        overlap = target.use_graphs and self._in_graph(sampling, constraint)
        state = RequestState(
            prompts=encoded,
            rows=[RowOutput(self.tokenizer, self.eos_ids, stops, max_new_tokens) for _ in encoded],
            stats=[GenerationStats(step_domain, prompt_tokens=len(p)) for p in encoded],
            sampling=sampling,
            domain=step_domain,
            constraint=constraint,
            generator=request_generator(sampling, self._device),
            # A sampled step on graphs replays a graph of its exact width, so its proposal is cut
            # to a warmed one (proposals.cut_to_lengths).
            draft_lengths=tuple(w - 1 for w in target.widths) if overlap and not sampling.greedy else (),
            overlap=overlap,
        )
        self._acquire()
        try:
            yield from self._decode(state)
        finally:
            self._release()

    def _in_graph(self, sampling: SamplingParams, constraint: Constraint | None) -> bool:
        """Whether steps may run forward and verification as one call of the runner (a CUDA-graph
        replay): no logits processor between them, and the verify backend the graph runs (torch
        ops for greedy steps, the Triton kernel for sampled ones) not pinned to another."""
        pinned_ok = self.verify_backend == "auto" or (self.verify_backend == "triton" and not sampling.greedy)
        return (sampling.repetition_penalty == 1.0 and not sampling.no_repeat_ngram_size
                and constraint is None and pinned_ok)

    def _decode(self, state: RequestState) -> Iterator[tuple[RequestState, list[list[int]]]]:
        """Prefill, then steps until every row has finished; yields after each step."""
        target = self._target_runner
        target.begin(len(state.prompts))  # a single prompt reuses the previous request's common prefix
        for d in self.drafts.values():
            d.begin(state.prompts)
            d.bind_constraint(state.constraint)
        try:
            self._prefill(state)
            while any(state.active):
                yield state, self._step(state)
        except GeneratorExit:  # a stream closed early, between steps: the cache is consistent
            raise
        except BaseException:  # mid-forward: the cache may hold half a step; never reuse it
            target.reset(1)
            raise
        finally:
            self._learn(state.unlearned)
            for d in self.drafts.values():
                d.end(state.prompts, [r.token_ids for r in state.rows])
            self.router.flush()

    def _prefill(self, state: RequestState) -> None:
        """Feed each whole prompt (past what the cache reuses) before the first step, timed apart
        from the steps, and keep the logits after it for the first step: [B, 1, V].

        The first token is scored from the prompt's own forward, as plain decoding scores it
        (HF `generate` and llama.cpp alike): some kernels round a long batch differently from a
        short one, so re-feeding the last prompt token with the first draft could break a
        near-tie the other way. The router scores arms on decode steps only: a long prompt's
        prefill would otherwise land on whichever arm the first step happened to pick.
        """
        target = self._target_runner
        reused = [target.prefix_len(b, p) for b, p in enumerate(state.prompts)]
        start = time.perf_counter()
        state.first = target.forward_to(state.prompts, keep_logits=1)
        seconds = time.perf_counter() - start
        for st, n in zip(state.stats, reused):
            st.cached_prompt_tokens = min(n, st.prompt_tokens - 1)
            st.prefill_seconds = st.seconds = seconds
        vocab, device = state.first.shape[-1], state.first.device
        ban_under_schema = state.sampling.no_repeat_ngram_size and state.constraint is not None
        exempt = self._json_punctuation(vocab, device) if ban_under_schema else None
        state.processors = PathProcessors(state.sampling, state.constraint, state.prompts, vocab, device, exempt)

    def _step(self, state: RequestState) -> list[list[int]]:
        """One decode step of every unfinished row: draft, forward, processors along the path,
        verify, commit, record. Returns each row's new tokens (empty for finished rows)."""
        target = self._target_runner
        active = state.active
        arm = self.router.select(state.domain)
        warmed = target.warmup_seconds
        t0 = time.perf_counter()
        drafts, draft_probs, catchup = step_proposal(
            self.drafts.get(arm.draft), state.seqs, active, min(arm.gamma, state.remaining(active) - 1),
            state.sampling, state.generator, self._vocab, self._device)
        drafts, draft_probs = cut_to_lengths(drafts, draft_probs, state.draft_lengths)
        t1 = time.perf_counter()
        prefilled = state.first is not None
        n_acc, out = self._forward_and_verify(state, drafts, draft_probs, active)
        t2 = time.perf_counter()
        self._learn(state.unlearned)  # when no graph ran it
        context_row = active.index(True)
        context_len = len(state.seqs[context_row])
        new = self._commit(state, active, [o[: n + 1] for n, o in zip(n_acc, out)])
        g = len(drafts[0])
        record = StepRecord(
            domain=state.domain,
            arm=arm,
            drafted=g * sum(active),
            accepted=sum(n for n, a in zip(n_acc, active) if a),
            emitted=sum(len(n) for n in new),
            draft_seconds=t1 - t0,
            verify_seconds=t2 - t1,
            context_len=context_len,
            sequence=state.seqs[context_row],
            rows=sum(active),
            catchup_seconds=catchup,
            warmup_seconds=target.warmup_seconds - warmed,
            draft_lengths=state.draft_lengths,
            prefilled=prefilled,
        )
        state.unlearned.append(record)
        if not state.overlap:
            self._learn(state.unlearned)
        for b in (b for b, a in enumerate(active) if a):
            st = state.stats[b]
            st.drafted += g
            st.accepted += n_acc[b]
            st.seconds += record.seconds
            st.records.append(record)
            st.host_seconds += time.perf_counter() - t2
        return new

    def _forward_and_verify(self, state: RequestState, drafts: list[list[int]], draft_probs: torch.Tensor | None,
                            active: list[bool]) -> tuple[list[int], list[list[int]]]:
        """Score every row's context + draft in one target forward and verify; host lists out:
        accepted per row, and per row the accepted draft tokens then the recovered or bonus token.

        drafts: B lists of g ids; draft_probs: [B, g, V] the draft's q, or None (one-hot). On the
        first step the prefill's logits (`state.first`) score the first position, and the forward
        feeds only the draft (see `_prefill`).
        """
        target, first, sampling = self._target_runner, state.first, state.sampling
        state.first = None
        if first is None and self._in_graph(sampling, state.constraint):
            fused = target.verify_step(state.seqs, drafts, active, sampling, draft_probs, state.generator,
                                       lambda: self._learn(state.unlearned))
            if fused is not None:
                return fused
        g = len(drafts[0])
        paths = [s + d for s, d in zip(state.seqs, drafts)]
        if first is None:
            logits = target.forward_to(paths, active, keep_logits=g + 1)
        elif g:
            logits = torch.cat([first, target.forward_to(paths, active, keep_logits=g).to(first.device)], dim=1)
        else:
            logits = first
        draft_tokens = torch.tensor(drafts, dtype=torch.long).view(len(drafts), g).to(logits.device, non_blocking=True)
        assert state.processors is not None  # set up by the prefill
        logits = state.processors(logits, drafts, draft_tokens, active)
        # A request's first step (the only eager one on CUDA graphs) verifies on torch ops unless
        # pinned: Triton compiles its kernel per shape at first use, which the router would charge
        # to the step's arm and verify width.
        backend: Backend = "torch" if first is not None and self.verify_backend == "auto" else self.verify_backend
        n_acc, out = verify(logits, draft_tokens, draft_probs, sampling, backend=backend, generator=state.generator)
        return n_acc.tolist(), out.tolist()

    def _commit(self, state: RequestState, active: list[bool], verified: list[list[int]]) -> list[list[int]]:
        """Append each active row's verified tokens to its output (cut at EOS, its budget or a stop
        string) and to what the processors read; returns the tokens kept per row."""
        assert state.processors is not None  # set up by the prefill
        new: list[list[int]] = [[] for _ in state.rows]
        for b in (b for b, a in enumerate(active) if a):
            new[b] = state.rows[b].append(verified[b])
            state.seqs[b].extend(new[b])
            state.processors.commit(b, new[b])
        return new

    def _learn(self, unlearned: list[StepRecord]) -> None:
        """Hand the router the finished steps it has not learned from yet."""
        while unlearned:
            self.router.update(unlearned.pop(0))

    def _json_punctuation(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[V] bool on `device`: tokens the n-gram ban leaves alone under a JSON schema; built once."""
        if self._json_tokens is None:
            self._json_tokens = json_punctuation_tokens(self.tokenizer, vocab).to(device)
        return self._json_tokens
