"""FlashSpecLLM for LangChain: a completion model (text in, text out) over the FlashSpec engine.

    from flashspec_integrations.langchain import FlashSpecLLM
    llm = FlashSpecLLM(max_tokens=64)            # instant: the default model loads on first use
    llm.invoke("Once upon a time")

Every call picks its router domain from the LangChain run (see `flashspec_integrations.domain_rules`)
and returns the engine's per-call statistics in `generation_info["flashspec"]`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from flashspec_integrations.calls import Outcome, stream_call
from flashspec_integrations.domain_rules import StepContext
from flashspec_integrations.langchain._base import LangChainParams, usage
from flashspec_integrations.plan import CallPlan


class FlashSpecLLM(LangChainParams, BaseLLM):
    """A completion model: the prompt text goes to the target as is (no chat template).

    `batch` (and concurrent callers) run side by side in the engine's running batch, each prompt
    a request of its own (with its own domain, settings and `timeout`).
    """

    # LangChain's base class ignores unknown arguments; a misspelt setting should fail instead.
    model_config = ConfigDict(extra="forbid")

    @property
    def _llm_type(self) -> str:
        return "flashspec"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return cast(LangSmithParams, {**self._ls_common(stop, kwargs), "ls_model_type": "llm"})

    def _call(self, prompt: str, stop: list[str] | None, run_manager: Any, kwargs: dict) -> CallPlan:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt: FlashSpecLLM takes a non-empty string; use ChatFlashSpec for messages")
        self._check_kwargs(kwargs)
        decision = self._decide(run_manager, kwargs, StepContext(prompt_text=prompt))
        return self._text_call(prompt, stop, kwargs, decision)

    @staticmethod
    def _generation_info(outcome: Outcome) -> dict[str, Any]:
        return {"finish_reason": outcome.finish_reason, "usage": dict(usage(outcome)), "flashspec": outcome.info()}

    def _result(self, outcomes: list[Outcome]) -> LLMResult:
        usages = [usage(o) for o in outcomes]
        token_usage = {k: sum(u[k] for u in usages) for k in ("input_tokens", "output_tokens", "total_tokens")}
        return LLMResult(
            generations=[[Generation(text=o.text, generation_info=self._generation_info(o))] for o in outcomes],
            llm_output={"model_name": self.model_name, "token_usage": token_usage},
        )

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        return self._result(self._run([self._call(p, stop, run_manager, kwargs) for p in prompts]))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # Built in a worker (the first call loads the weights); then waits on the engine's requests.
        calls = await asyncio.to_thread(lambda: [self._call(p, stop, run_manager, kwargs) for p in prompts])
        return self._result(await self._arun(calls))

    def _chunks(self, call: CallPlan) -> Iterator[GenerationChunk]:
        """GenerationChunks of one call; the last carries finish_reason, usage and stats."""
        text, ids = "", []
        start = time.perf_counter()
        for chunk in stream_call(self.get_engine(), call, self.timeout):
            text += chunk.text
            ids.extend(chunk.token_ids)
            if chunk.finish_reason is None:
                if chunk.text:
                    yield GenerationChunk(text=chunk.text)
                continue
            outcome = Outcome(text, ids, chunk.finish_reason, chunk.stats, len(call.prompt_ids),
                              time.perf_counter() - start, call.decision)  # wall time, as for invoke
            yield GenerationChunk(text=chunk.text, generation_info=self._generation_info(outcome))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        yield from self._relay(self._chunks(self._call(prompt, stop, run_manager, kwargs)), run_manager)

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        make = lambda: self._chunks(self._call(prompt, stop, run_manager, kwargs))
        async for chunk in self._arelay(make, run_manager):
            yield chunk
