"""The engine: exact speculative decoding for many requests at once, each step with its own draft.

Each step the router picks every row's arm (a draft source and γ) from past steps only; the drafts
propose, the target scores every row's proposal in one forward pass, `verify` accepts a prefix and
appends the recovered or bonus token, and the target's cache rolls back to what was verified
(step.py). Requests join and leave the running batch between steps (scheduler.py); callers wait on
their own request's handle (handle.py). The output is exactly the target's distribution whatever
the arms and whatever else is in the batch; they only change how fast it arrives.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import AsyncIterator, Generator, Sequence
from pathlib import Path
from typing import Any, Unpack, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.backends import make_runner, resolve_backend
from flashspec_core.backends.base import TargetRunner
from flashspec_core.backends.calibration import Calibration, calibrate_runner
from flashspec_core.drafts import DraftSource, ModelDraft
from flashspec_core.drafts.base import check_draft
from flashspec_core.handle import RequestHandle
from flashspec_core.memory_plan import MEMORY_FRACTION, MemoryPlan, context_limit, plan_engine
from flashspec_core.models import LoadedModel, eos_ids, vocab_size
from flashspec_core.options import RequestArgs, RequestOptions, request_options
from flashspec_core.pieces import PREFILL_CHUNK
from flashspec_core.processors.ngram_ban import json_punctuation_tokens
from flashspec_core.processors.sampling import request_generator
from flashspec_core.prompts import PromptLike, encode_prompts, is_batch, prompt_text
from flashspec_core.request import Request, Row
from flashspec_core.results import GenerationResult, GenerationStats, StreamChunk
from flashspec_core.routing.base import Router
from flashspec_core.routing.domains import resolve_domain
from flashspec_core.routing.priors import seed_router
from flashspec_core.scheduler import GPU_MAX_ROWS, MAX_QUEUE, MAX_ROWS, Scheduler, buckets
from flashspec_core.step import Stepper
from flashspec_core.stopping import RowOutput, decodes_by_concatenation
from flashspec_core.verify import VERIFY_BACKENDS, Backend


class SpecEngine:
    """Exact speculative decoding over a pool of draft sources chosen per step by a router."""

    _default: SpecEngine | None = None
    # `submit` decodes under `json_schema=` (a JSON schema or a structural tag): a reply so
    # constrained always parses. Front ends read this instead of probing `submit`'s signature.
    constrains: bool = True
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
        max_batch: int | None = None,
        max_queue: int = MAX_QUEUE,
        prefill_chunk: int | None = PREFILL_CHUNK,
        memory_fraction: float = MEMORY_FRACTION,
        max_context: int | None = None,
    ) -> None:
        """backend: where the target's forward runs ("hf", "cuda-graph", "llama.cpp"; "auto" picks
        CUDA graphs for a Llama-family model on a GPU and transformers otherwise; llama.cpp is
        opt-in, see backends/__init__.py).
        calibrate: time the target's forward per width on this machine at first use (cached per
        CPU in the cache folder) to pick the fastest kernel and seed the router's cost model.
        gammas: the γ of each draft's arms; None: `loading.default_gammas` (16 too on a GPU).
        router: a `Router` (routing/base.py) or a name from `routing.ROUTER_NAMES`.
        max_batch: rows decoded together (each a cache slot; None: 64 on a GPU, 8 on a CPU), cut to
        what `memory_fraction` of the memory free at construction holds with every row at the full
        context (memory_plan.py; `memory` is the plan); more wait in a queue of at most
        `max_queue` requests, past which `submit` raises EngineBusy. prefill_chunk: prompt tokens fed
        per scheduler turn while other rows decode (on CUDA graphs to each new prompt, on a CPU in
        all, earliest request first; None: whole prompts at once).
        memory_fraction: the share (0, 1] of that free memory the rows' caches and logits may use;
        where not even one row holds the full context, one row runs and `context_window` shrinks
        to what it holds (a request past it is refused at `submit`).
        max_context: the most tokens (prompt + new) one request may hold, below the model's context
        window (None: the window): the plan reserves that much a row, so a long-context model
        decodes more rows together under a lower bound.
        """
        self.verify_backend = _checked_verify_backend(verify_backend)
        gammas = _checked_gammas(target, gammas)
        _check_draft_names(drafts)
        self._target = target
        self.drafts: dict[str, DraftSource] = {d.name: d for d in drafts}
        self.arms = [Arm(NO_DRAFT, 0)] + [Arm(d.name, g) for d in drafts for g in gammas]
        self._router = self._make_router(router)
        self.eos_ids = eos_ids(target)
        self._concatenates = decodes_by_concatenation(self.tokenizer)  # how rows' text is kept (stopping.py)
        self.backend = resolve_backend(backend, target)
        self._device = target.model.get_output_embeddings().weight.device
        self._vocab = vocab_size(target.model)
        widths = [1] + [g + 1 for g in gammas]
        runner, self.memory = self._plan_memory(max_batch, memory_fraction, max_context, widths)
        # The most tokens (prompt + new) one request's row may hold: the model's context window,
        # or less where memory is short; requests are checked against it when submitted.
        self.context_window = self.memory.row_tokens
        runner.limit_cache(self.context_window)
        self.calibration = self._calibrate(runner, widths) if calibrate else None
        _capture_graphs(runner, self.memory.rows, widths)
        self._json_tokens: torch.Tensor | None = None  # [V] bool, built on the first ban under a schema
        self._stepper = Stepper(runner, self.drafts, self._router, self._vocab, self._device, self.verify_backend,
                                self._json_punctuation)
        self._scheduler = Scheduler(self._stepper, runner, self.drafts, self._router, self.memory.rows, max_queue,
                                    prefill_chunk)

    def _make_router(self, router: Router | str) -> Router:
        """`router` itself, or the router of that name over this engine's arms."""
        if isinstance(router, str):
            from flashspec_core.routing import make_router

            router = make_router(router, self.arms, self.drafts)
        if not isinstance(router, Router):
            raise ValueError(f"router must be a Router (flashspec_core.routing.Router: subclass it for the defaults "
                             f"of what select/update do not cover) or a router name; got {type(router).__name__}")
        return router

    def _plan_memory(self, max_batch: int | None, memory_fraction: float, max_context: int | None,
                     widths: list[int]) -> tuple[TargetRunner, MemoryPlan]:
        """The target's runner (kept across requests: prefix reuse) and how many rows of how many
        tokens the memory free now holds beside the models (memory_plan.py)."""
        target = self._target
        window, source = context_limit(target.model.config, max_context)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        runner = make_runner(target, self.backend, pad, window)
        if max_batch is None:
            max_batch = GPU_MAX_ROWS if self._device.type == "cuda" else MAX_ROWS
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1 (rows decoded together); got {max_batch!r}")
        draft_models = [d.model for d in self.drafts.values() if isinstance(d, ModelDraft)]  # their caches grow too
        memory = plan_engine([target.model, *draft_models], self.backend == "llama.cpp", runner, max_batch,
                             memory_fraction, window, widths, source)
        return runner, memory

    @property
    def router(self) -> Router:
        """Chooses every row's arm per step (routing/base.py); settable, to route another way."""
        return self._router

    @router.setter
    def router(self, router: Router) -> None:
        self._router = self._stepper.router = self._scheduler.router = router

    @property
    def runner(self) -> TargetRunner:
        """What runs the target's forward (backends/base.py); settable, to run another runner."""
        return self._stepper.runner

    @runner.setter
    def runner(self, runner: TargetRunner) -> None:
        self._stepper.runner = self._scheduler.runner = runner

    def _calibrate(self, runner: TargetRunner, widths: list[int]) -> Calibration | None:
        """Measured forward cost per width on this machine (cached): the kernel per width, and the
        router's starting cost model and priors. Only the CPU runners take part; a GPU's costs are learned."""
        cal = calibrate_runner(runner, self.target_model, self.backend, widths, self.context_window)
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
                from flashspec_core.loading import default_drafts, default_gammas, load_target
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
        max_batch: int | None = None,
        max_queue: int = MAX_QUEUE,
        memory_fraction: float = MEMORY_FRACTION,
        max_context: int | None = None,
        prefill_chunk: int | None = PREFILL_CHUNK,
    ) -> SpecEngine:
        """target: None (embedded default), a .gguf file, a local folder or a cached HF id.

        drafts: names from `flashspec_core.loading.DRAFT_NAMES`, paths or HF ids of model drafts, or
        DraftSource objects; None gives the default pool.
        """
        from flashspec_core.loading import build_drafts, load_target

        loaded = load_target(target, device=device, dtype=dtype, load_in_4bit=load_in_4bit)
        pool = build_drafts(drafts, loaded, target, device=device, dtype=dtype)
        return cls(loaded, pool, router=router, gammas=gammas, verify_backend=verify_backend, backend=backend,
                   max_batch=max_batch, max_queue=max_queue, memory_fraction=memory_fraction,
                   max_context=max_context, prefill_chunk=prefill_chunk)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._target.tokenizer

    @property
    def target_model(self) -> PreTrainedModel:
        return self._target.model

    @property
    def model_name(self) -> str:
        return self._target.name

    @property
    def gguf(self) -> Path | None:
        """The GGUF file the target was loaded from (llama.cpp can run it as is), or None."""
        return self._target.gguf

    @property
    def running(self) -> int:
        """Rows in the running batch now."""
        return self._scheduler.running

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now (at most `max_queue`)."""
        return self._scheduler.queued

    def router_summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Per-domain arm choices and goodput, as the router reports them."""
        return self.router.summary()

    # ----------------------------------------------------------------------------------- API

    def generate(self, prompt: PromptLike | Sequence[PromptLike], options: RequestOptions | None = None,
                 **args: Unpack[RequestArgs]) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (str, chat messages or token ids) or a list of them.

        The settings (`max_new_tokens`, `sampling`, `stop`, `domain`, `hint`, `json_schema`,
        `timeout`) are keyword arguments or one `RequestOptions` (options.py says what each does).
        The rows join the engine's running batch beside other callers' and leave it when done;
        each has exactly the law it would have alone. Each row draws from its own generator: a
        list's row 0 from `sampling.seed`, row i from a seed mixed from it and i
        (`processors.sampling.request_generator`), whatever runs beside it.
        """
        batch = is_batch(prompt)
        prompts = cast("list[PromptLike]", list(prompt)) if batch else [cast(PromptLike, prompt)]  # is_batch told
        results = self.submit(prompts, options, **args).wait()
        return results if batch else results[0]

    async def agenerate(self, prompt: PromptLike | Sequence[PromptLike], options: RequestOptions | None = None,
                        **args: Unpack[RequestArgs]) -> GenerationResult | list[GenerationResult]:
        """`generate` for a coroutine: waits without holding a thread; cancelling it cancels the request."""
        batch = is_batch(prompt)
        prompts = cast("list[PromptLike]", list(prompt)) if batch else [cast(PromptLike, prompt)]  # is_batch told
        handle = self.submit(prompts, options, **args)
        try:
            results = await handle.wait_async()
        finally:
            if not handle.done:
                handle.cancel()
        return results if batch else results[0]

    def stream(self, prompt: PromptLike, options: RequestOptions | None = None,
               **args: Unpack[RequestArgs]) -> Generator[StreamChunk, None, None]:
        """Yield text as it is verified; the last chunk carries finish_reason and stats. Closing
        the stream early ends the request at the next step boundary."""
        if is_batch(prompt):
            raise ValueError("prompt: stream takes one prompt; use generate for a batch")
        handle = self.submit([prompt], options, stream=True, **args)
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()

    async def astream(self, prompt: PromptLike, options: RequestOptions | None = None,
                      **args: Unpack[RequestArgs]) -> AsyncIterator[StreamChunk]:
        """`stream` for a coroutine (no thread held between chunks)."""
        if is_batch(prompt):
            raise ValueError("prompt: stream takes one prompt; use generate for a batch")
        handle = self.submit([prompt], options, stream=True, **args)
        try:
            async for chunk in handle:
                yield chunk
        finally:
            if not handle.done:
                handle.cancel()

    def submit(self, prompts: Sequence[PromptLike], options: RequestOptions | None = None, *, stream: bool = False,
               **args: Unpack[RequestArgs]) -> RequestHandle:
        """Queue a request of one row per prompt and return its handle at once (`wait`, iterate,
        `cancel`); what `generate` and `stream` do underneath. Bad input raises ValueError here,
        before anything is queued; a full queue raises EngineBusy."""
        if not prompts:
            raise ValueError("prompt: the batch is empty; pass at least one prompt")
        opts = request_options(options, args)
        encoded = self.encode(prompts, opts.max_new_tokens)
        constraints, hint = None, opts.hint
        if opts.json_schema is not None:
            from flashspec_core.constrained import as_grammar, constraint_for

            eos = sorted(self.eos_ids)
            grammar = as_grammar(opts.json_schema, self.tokenizer, self._vocab, eos)  # compiled once
            constraints = [constraint_for(grammar, self.tokenizer, self._vocab, eos, [p]) for p in encoded]
            hint = hint or "json"
        # The prompt is decoded for the classifier only when neither `domain` nor a hint decides.
        label = resolve_domain(opts.domain, hint, functools.partial(prompt_text, self.tokenizer, prompts[0]))
        request = Request(encoded, opts.sampling_params, opts.stops, opts.max_new_tokens, label, constraints,
                          RequestHandle(len(encoded), stream),
                          deadline=None if opts.timeout is None else time.monotonic() + opts.timeout)
        self._scheduler.submit([self._row(request, i) for i in range(len(encoded))])
        return request.handle

    def close(self) -> None:
        """Stop the engine's scheduler: running and waiting requests fail with EngineClosed."""
        self._scheduler.close()

    def encode(self, prompts: Sequence[PromptLike], max_new_tokens: int) -> list[list[int]]:
        """The token ids `generate` would decode from for each prompt (chat template applied);
        ContextLengthError (a ValueError) when one does not fit `context_window` with `max_new_tokens`."""
        return encode_prompts(self.tokenizer, prompts, self._vocab, max_new_tokens, self.context_window,
                              self.memory.limit())

    def _row(self, request: Request, index: int) -> Row:
        prompt = request.prompts[index]
        return Row(request, index, slot=-1,
                   output=RowOutput(self.tokenizer, self.eos_ids, request.stops, request.max_new_tokens,
                                    concatenates=self._concatenates),
                   stats=GenerationStats(request.domain, prompt_tokens=len(prompt)),
                   generator=request_generator(request.sampling, self._device, index), seq=list(prompt))

    def _json_punctuation(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[V] bool on `device`: tokens the n-gram ban leaves alone under a JSON schema; built once."""
        if self._json_tokens is None:
            self._json_tokens = json_punctuation_tokens(self.tokenizer, vocab).to(device)
        return self._json_tokens


def _checked_gammas(target: LoadedModel, gammas: Sequence[int] | None) -> Sequence[int]:
    """`gammas`, or the target's default (`loading.default_gammas`); ValueError unless ints in [1, 16]."""
    if gammas is None:
        from flashspec_core.loading import default_gammas

        gammas = default_gammas(target)
    if not gammas or any(not isinstance(g, int) or not 1 <= g <= 16 for g in gammas):
        raise ValueError(f"gammas must be a non-empty list of ints in [1, 16]; got {list(gammas)!r}")
    return gammas


def _check_draft_names(drafts: Sequence[DraftSource]) -> None:
    names = [check_draft(d).name for d in drafts]
    if len(set(names)) != len(names) or NO_DRAFT in names:
        raise ValueError(f"drafts must have distinct names other than {NO_DRAFT!r}; got {names}")


def _checked_verify_backend(name: str) -> Backend:
    if name not in VERIFY_BACKENDS:
        raise ValueError(f"verify_backend must be one of {VERIFY_BACKENDS}; got {name!r}")
    return cast(Backend, name)


def _capture_graphs(runner: TargetRunner, max_rows: int, widths: list[int]) -> None:
    """CUDA graphs of every width the arms feed and every batch size the scheduler grows through,
    captured now, not mid-request (the largest first: it allocates the rows)."""
    for rows in reversed(buckets(max_rows)) if runner.use_graphs else [1]:
        runner.resize(rows)
        runner.warm(widths)
    runner.resize(1)
