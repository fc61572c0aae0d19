"""What FlashSpecLLM and ChatFlashSpec share: parameters, the lazy engine, the run context, one call.

The engine is resolved on first use, not at construction (LangChain builds models eagerly, in
config files and tests, long before anything is generated), and cached per process: all models
built with the same engine settings share one engine, so the weights load once and the router
keeps learning across them. The engine serialises requests with its own lock, which makes
`batch` and concurrent callers thread-safe; async callers run it in a worker thread.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Sequence, TypeVar

from langchain_core.messages.ai import UsageMetadata
from langchain_core.runnables.config import var_child_runnable_config
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from flashspec_core import SamplingParams, SpecEngine
from flashspec_core.results import GenerationStats
from flashspec_integrations.context import DomainDecision, StepContext, decide_domain

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PROVIDER = "flashspec"
T = TypeVar("T")

_engines: dict[tuple, SpecEngine] = {}
_engines_lock = threading.Lock()

# Call keywords that LangChain or agent frameworks pass and that need no action here.
_IGNORED_KWARGS = frozenset({"model", "stream", "parallel_tool_calls", "ls_structured_output_format"})
_SAMPLING_KWARGS = ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "no_repeat_ngram_size")


def engine_for(target: str | None, drafts: Sequence[str] | None, router: str, device: str | None) -> SpecEngine:
    """The process-wide engine for these settings (the embedded default when all are defaults)."""
    if target is None and drafts is None and router == "thompson" and device is None:
        return SpecEngine.from_default()
    key = (target, tuple(drafts) if drafts is not None else None, router, device)
    with _engines_lock:
        if key not in _engines:
            _engines[key] = SpecEngine.from_pretrained(target, drafts=drafts, router=router, device=device)
        return _engines[key]


def run_context(run_manager: Any) -> tuple[dict[str, Any], list[str]]:
    """Metadata and tags of the current run: the runnable-config context variable (set on every
    LangChain and LangGraph path, streaming included), overridden by the run manager's own."""
    metadata: dict[str, Any] = {}
    tags: list[str] = []
    config = var_child_runnable_config.get() or {}
    metadata.update(config.get("metadata") or {})
    tags.extend(config.get("tags") or [])
    if run_manager is not None:
        metadata.update(getattr(run_manager, "inheritable_metadata", None) or {})
        metadata.update(getattr(run_manager, "metadata", None) or {})
        tags.extend(getattr(run_manager, "tags", None) or [])
    return metadata, tags


def engine_takes_json_schema(engine: Any) -> bool:
    """Whether the engine decodes under a JSON schema (its `stream` takes `json_schema=`).

    Schema-constrained decoding lands in the engine separately; such an engine gets the schema of
    the required output, and the adapter then sends no forced prefix (the grammar does that job,
    exactly). Other engines get the prefix and lenient parsing.
    """
    try:
        return "json_schema" in inspect.signature(engine.stream).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class Request:
    """One engine call. prompt_ids: the rendered prompt, forced prefix included."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    decision: DomainDecision
    prefix: str = ""
    json_schema: dict | None = None

    def engine_kwargs(self, engine: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "sampling": self.sampling,
            "stop": self.stop or None,
            "domain": self.decision.domain,
            "hint": self.decision.hint,
        }
        if self.json_schema is not None and engine_takes_json_schema(engine):
            kwargs["json_schema"] = self.json_schema
        return kwargs


@dataclass
class Outcome:
    """A finished call: output text (forced prefix included), tokens, reason and engine stats."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats | None
    prompt_tokens: int
    seconds: float
    decision: DomainDecision
    extra: dict[str, Any] = field(default_factory=dict)

    def usage(self) -> UsageMetadata:
        out = len(self.token_ids)
        return UsageMetadata(input_tokens=self.prompt_tokens, output_tokens=out, total_tokens=self.prompt_tokens + out)

    def info(self) -> dict[str, Any]:
        """The FlashSpec stats of the call: domain, the rule that chose it, arms, acceptance, speed."""
        stats = self.stats.as_dict() if self.stats is not None else {"domain": self.decision.label}
        arms = stats.get("arms", [])
        return {
            **stats,
            "draft": Counter(arms).most_common(1)[0][0] if arms else None,
            "domain_source": self.decision.source,
            "agent_node": self.decision.node,
            "tokens_per_second": round(len(self.token_ids) / self.seconds, 3) if self.seconds else 0.0,
            **self.extra,
        }


def stream_request(engine: SpecEngine, req: Request, timeout: float | None) -> Iterator[Any]:
    """The engine's chunks for one request; TimeoutError once `timeout` seconds have passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks = engine.stream(req.prompt_ids, **req.engine_kwargs(engine))
    try:
        for chunk in chunks:
            yield chunk
            if deadline is not None and chunk.finish_reason is None and time.monotonic() > deadline:
                raise TimeoutError(f"generation took longer than timeout={timeout} s; raise timeout or lower max_tokens")
    finally:
        chunks.close()


def run_request(engine: SpecEngine, req: Request, timeout: float | None, max_retries: int) -> Outcome:
    """Run a request to the end, retrying a timed-out attempt up to `max_retries` times."""
    for attempt in range(max_retries + 1):
        start = time.perf_counter()
        text, ids, last = req.prefix, [], None
        try:
            for chunk in stream_request(engine, req, timeout):
                text += chunk.text
                ids.extend(chunk.token_ids)
                last = chunk
        except TimeoutError:
            if attempt == max_retries:
                raise
            continue
        return Outcome(
            text, ids, last.finish_reason or "length", last.stats, len(req.prompt_ids),
            time.perf_counter() - start, req.decision,
        )
    raise AssertionError("unreachable")


class FlashSpecParams(BaseModel):
    """Constructor parameters shared by both LangChain models, and the engine they resolve to."""

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=(), arbitrary_types_allowed=True)

    model_name: str = Field(DEFAULT_MODEL_NAME, alias="model", description="the target; the default is embedded")
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy (the default: reproducible agent steps)")
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    repetition_penalty: float = Field(1.0, gt=0.0, description="HF's penalty on repeated tokens; 1 disables")
    no_repeat_ngram_size: int = Field(0, ge=0, description="ban repeating an n-gram of the output; 0 disables")
    max_tokens: int = Field(256, gt=0, alias="max_new_tokens", description="new tokens per call")
    stop: list[str] | None = Field(None, alias="stop_sequences")
    timeout: float | None = Field(None, gt=0, description="seconds per call; TimeoutError past it")
    max_retries: int = Field(0, ge=0, description="retries of a timed-out call")
    streaming: bool = False
    domain: str | None = Field(None, description="a fixed router domain for every call (overrides the context)")
    domain_per_node: bool = Field(False, description="add the agent node to the domain hint as a sub-key")
    engine: Any = Field(None, exclude=True, description="a ready SpecEngine; None resolves one lazily")
    target: str | None = Field(None, description="engine setting: target path or cached HF id")
    drafts: list[str] | None = Field(None, description="engine setting: draft names or paths")
    router: str = Field("thompson", description="engine setting: router name")
    device: str | None = Field(None, description="engine setting: 'cpu', 'cuda', ...")

    _resolved: Any = PrivateAttr(None)
    _resolve_lock: Any = PrivateAttr(default_factory=threading.Lock)

    def get_engine(self) -> SpecEngine:
        """The engine, loaded on first use (construction never loads weights)."""
        if self.engine is not None:
            return self.engine
        with self._resolve_lock:
            if self._resolved is None:
                target = self.target
                if target is None and self.model_name != DEFAULT_MODEL_NAME:
                    target = self.model_name
                self._resolved = engine_for(target, self.drafts, self.router, self.device)
            return self._resolved

    def _call_settings(self, stop: Sequence[str] | None, kwargs: Mapping[str, Any], allowed: Sequence[str] = ()) -> tuple[int, SamplingParams, list[str]]:
        """max_new_tokens, sampling and stop strings of one call (call keywords override fields)."""
        unknown = set(kwargs) - _IGNORED_KWARGS - set(_SAMPLING_KWARGS) - {"max_tokens", "max_new_tokens", "domain"} - set(allowed)
        if unknown:
            raise ValueError(
                f"unsupported call arguments {sorted(unknown)}; use max_tokens, temperature, top_k, top_p, "
                f"seed, repetition_penalty, no_repeat_ngram_size, domain{', ' + ', '.join(allowed) if allowed else ''}"
            )
        max_new = kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_tokens))
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new <= 0:
            raise ValueError(f"max_tokens must be a positive int; got {max_new!r}")
        fields = {k: kwargs.get(k, getattr(self, k)) for k in _SAMPLING_KWARGS}
        try:
            sampling = SamplingParams(**fields)
        except Exception as exc:
            raise ValueError(f"sampling arguments {fields}: {exc}") from exc
        stops = list(stop) if stop is not None else list(self.stop or [])
        return max_new, sampling, stops

    def _decide(self, run_manager: Any, kwargs: Mapping[str, Any], **facts: Any) -> DomainDecision:
        """The call's domain: a `domain=` call keyword, run metadata or tag, the model's own `domain`
        field, then the context rules of `flashspec_integrations.context` over `facts`."""
        metadata, tags = run_context(run_manager)
        decision = decide_domain(
            StepContext(explicit_domain=kwargs.get("domain"), metadata=metadata, tags=tags, **facts),
            domain_per_node=self.domain_per_node,
        )
        if self.domain is not None and decision.source not in ("explicit", "metadata", "tag"):
            fixed = decide_domain(StepContext(explicit_domain=self.domain))
            return DomainDecision(fixed.domain, None, "model_domain", decision.node)
        return decision

    def _ls_common(self, stop: Sequence[str] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {
            "ls_provider": PROVIDER,
            "ls_model_name": kwargs.get("model") if isinstance(kwargs.get("model"), str) else self.model_name,
            "ls_temperature": kwargs.get("temperature", self.temperature),
            "ls_max_tokens": kwargs.get("max_tokens", self.max_tokens),
        }
        stops = list(stop) if stop is not None else self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name, "temperature": self.temperature, "top_k": self.top_k,
            "top_p": self.top_p, "repetition_penalty": self.repetition_penalty,
            "no_repeat_ngram_size": self.no_repeat_ngram_size, "max_tokens": self.max_tokens,
            "router": self.router, "drafts": self.drafts,
        }


async def aiter_in_thread(make_iter: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Iterate a blocking iterator in one worker thread without blocking the event loop.

    One thread runs the whole iteration (the engine ties an unfinished stream to the thread that
    started it), under a copy of the caller's context variables so the run config stays visible.
    Leaving early stops the worker after its current item.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    halt = threading.Event()
    end = object()

    def post(item: Any, exc: BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, exc))
        except RuntimeError:  # the loop has closed; nobody is listening any more
            halt.set()

    def worker() -> None:
        iterator = make_iter()
        try:
            for item in iterator:
                post(item, None)
                if halt.is_set():
                    break
        except BaseException as exc:  # handed to the awaiting side, which re-raises it
            post(end, exc)
        else:
            post(end, None)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    future = loop.run_in_executor(None, contextvars.copy_context().run, worker)
    try:
        while True:
            item, exc = await queue.get()
            if item is end:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        halt.set()
        await future
