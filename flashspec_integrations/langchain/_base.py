"""What ChatFlashSpec and FlashSpecLLM share on the LangChain side: LangChain's own fields (retries,
streaming), the run context a call reads its domain from, call keywords, tracing
parameters, and running engine calls (each its own engine request; the engine ends one at its timeout).

The shared fields (`target`, `drafts`, `max_tokens`, sampling, `domain`, ...) and the engine
cache are `flashspec_integrations.settings`; the domain rules are `flashspec_integrations.domain_rules`.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from langchain_core.messages.ai import UsageMetadata
from langchain_core.runnables.config import var_child_runnable_config
from pydantic import Field

from flashspec_integrations.async_bridge import aiter_in_thread
from flashspec_integrations.calls import Outcome, arun_calls, run_calls
from flashspec_integrations.domain_rules import DomainDecision, StepContext, decide_domain
from flashspec_integrations.plan import CallPlan, plan_text
from flashspec_integrations.settings import FlashSpecFields

PROVIDER = "flashspec"


class _Chunk(Protocol):
    """A streamed chunk as callbacks get it: LangChain's GenerationChunk and ChatGenerationChunk."""

    @property
    def text(self) -> str: ...


T = TypeVar("T", bound=_Chunk)
# Call keywords LangChain passes that need no action here.
_PASSED_THROUGH = frozenset({"model", "stream", "ls_structured_output_format"})


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


def usage(outcome: Outcome) -> UsageMetadata:
    out = outcome.completion_tokens
    return UsageMetadata(input_tokens=outcome.prompt_tokens, output_tokens=out,
                         total_tokens=outcome.prompt_tokens + out)


class LangChainParams(FlashSpecFields):
    """The shared fields plus LangChain's own, and the steps of a call both LangChain models take."""

    max_retries: int = Field(0, ge=0, description="retries of a timed-out call")
    streaming: bool = Field(False, description="invoke streams under the hood (callbacks see every token)")
    api_key: Any = Field(None, exclude=True, repr=False,
                         description="unused: accepted so code written for API models runs; the engine is local")

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` under the target tokenizer (offline)."""
        return self.get_engine().tokenizer(text, add_special_tokens=False).input_ids

    def _check_kwargs(self, kwargs: Mapping[str, Any], allowed: Sequence[str] = ()) -> None:
        """Reject call keywords that would otherwise be silently ignored, and another model's name."""
        self.check_call_kwargs(kwargs, allowed, _PASSED_THROUGH)
        model = kwargs.get("model")
        if model is not None and model != self.model_name:
            raise ValueError(
                f"model={model!r}: this model decodes with {self.model_name!r}; the target is fixed when the model "
                "is built, so build another one for another target (target= or model=)"
            )

    def _decide(self, run_manager: Any, kwargs: Mapping[str, Any], facts: StepContext) -> DomainDecision:
        """The call's domain: a `domain=` call keyword, run metadata or tag, the model's own `domain`
        field, then the context rules of `flashspec_integrations.domain_rules` over `facts`."""
        metadata, tags = run_context(run_manager)
        decision = decide_domain(
            dataclasses.replace(facts, explicit_domain=kwargs.get("domain"), metadata=metadata, tags=tags),
            domain_per_node=self.domain_per_node,
        )
        if self.domain is not None and decision.source not in ("explicit", "metadata", "tag"):
            fixed = decide_domain(StepContext(explicit_domain=self.domain))
            return DomainDecision(fixed.domain, None, "model_domain", decision.node)
        return decision

    def _text_call(self, prompt: str, stop: Sequence[str] | None, kwargs: Mapping[str, Any],
                   decision: DomainDecision) -> CallPlan:
        """The engine call for text prompt `prompt`, as it is (no chat template)."""
        max_new, sampling = self.decoding(kwargs)
        return plan_text(self.get_engine(), prompt, max_new, sampling, self.stops(stop), decision)

    def _run(self, calls: Sequence[CallPlan]) -> list[Outcome]:
        return run_calls(self.get_engine(), calls, self.timeout, self.max_retries)

    async def _arun(self, calls: Sequence[CallPlan]) -> list[Outcome]:
        engine = await asyncio.to_thread(self.get_engine)  # the first call loads the weights
        return await arun_calls(engine, calls, self.timeout, self.max_retries)

    @staticmethod
    def _relay(chunks: Iterator[T], run_manager: Any) -> Iterator[T]:
        """A stream's chunks, each handed to the run's callbacks as it is yielded."""
        for chunk in chunks:
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    @staticmethod
    async def _arelay(make_chunks: Callable[[], Iterator[T]], run_manager: Any) -> AsyncIterator[T]:
        """`_relay` for a coroutine: the stream runs in a worker thread (where `make_chunks`, which
        may load the weights, is called too)."""
        async for chunk in aiter_in_thread(make_chunks):
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _ls_common(self, stop: Sequence[str] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        model = kwargs.get("model")
        params: dict[str, Any] = {
            "ls_provider": PROVIDER,
            "ls_model_name": model if isinstance(model, str) else self.model_name,
            "ls_temperature": kwargs.get("temperature", self.temperature),
            "ls_max_tokens": kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_tokens)),
        }
        stops = self.stops(stop)
        if stops:
            params["ls_stop"] = stops
        return params

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name, "target": self.target, "drafts": self.drafts, "router": self.router,
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty, "no_repeat_ngram_size": self.no_repeat_ngram_size,
            "max_tokens": self.max_tokens,
        }
