"""LangChain models over the FlashSpec engine: `FlashSpecLLM` (text in, text out) and `ChatFlashSpec`.

    from flashspec_integrations.langchain import ChatFlashSpec, FlashSpecLLM
    llm = FlashSpecLLM(max_tokens=64)            # instant: the default model loads on first use
    llm.invoke("Once upon a time")

Every call picks its router domain from the LangChain run (see `flashspec_integrations.context`)
and returns the engine's per-call statistics: `generation_info["flashspec"]` here,
`response_metadata["flashspec"]` on chat messages.
"""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Iterator

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from flashspec_core.routing.domains import classify_prompt
from flashspec_integrations.langchain._base import (
    FlashSpecParams,
    Outcome,
    Request,
    aiter_in_thread,
    run_request,
    stream_request,
)

__all__ = ["FlashSpecLLM"]


class FlashSpecLLM(FlashSpecParams, BaseLLM):
    """A completion model: the prompt text goes to the target as is (no chat template).

    A batch is decoded as one engine batch per domain (the engine verifies a batch's rows
    together, and a batch shares one router domain); with `timeout` set, prompts run one by one
    so each can be timed.
    """

    @property
    def _llm_type(self) -> str:
        return "flashspec"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        return {**self._ls_common(stop, kwargs), "ls_model_type": "llm"}

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` under the target tokenizer (offline)."""
        return self.get_engine().tokenizer(text, add_special_tokens=False).input_ids

    def _request(self, prompt: str, stop: list[str] | None, run_manager: Any, kwargs: dict) -> Request:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt: FlashSpecLLM takes a non-empty string; use ChatFlashSpec for messages")
        max_new, sampling, stops = self._call_settings(stop, kwargs)
        decision = self._decide(run_manager, kwargs, prompt_text=prompt)
        ids = self.get_engine().tokenizer(prompt).input_ids
        return Request(ids, max_new, sampling, stops, decision)

    @staticmethod
    def _generation(outcome: Outcome) -> Generation:
        info = {"finish_reason": outcome.finish_reason, "usage": dict(outcome.usage()), "flashspec": outcome.info()}
        return Generation(text=outcome.text, generation_info=info)

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        requests = [self._request(p, stop, run_manager, kwargs) for p in prompts]
        engine = self.get_engine()
        if self.timeout is not None or len(requests) == 1:
            outcomes = [run_request(engine, r, self.timeout, self.max_retries) for r in requests]
        else:
            outcomes = self._generate_batched(prompts, requests)
        usage = [o.usage() for o in outcomes]
        token_usage = {k: sum(u[k] for u in usage) for k in ("input_tokens", "output_tokens", "total_tokens")}
        return LLMResult(
            generations=[[self._generation(o)] for o in outcomes],
            llm_output={"model_name": self.model_name, "token_usage": token_usage},
        )

    def _generate_batched(self, prompts: list[str], requests: list[Request]) -> list[Outcome]:
        """One engine batch per (domain, hint); classifier-decided prompts are grouped by label."""
        engine = self.get_engine()
        groups: dict[tuple, list[int]] = {}
        for i, (prompt, req) in enumerate(zip(prompts, requests)):
            d = req.decision
            key = (d.domain, d.hint if d.label else classify_prompt(prompt))
            groups.setdefault(key, []).append(i)
        outcomes: list[Outcome | None] = [None] * len(requests)
        for (domain, hint), rows in groups.items():
            first = requests[rows[0]]
            results = engine.generate(
                [requests[i].prompt_ids for i in rows], max_new_tokens=first.max_new_tokens,
                sampling=first.sampling, stop=first.stop or None, domain=domain, hint=hint,
            )
            for i, res in zip(rows, results):
                outcomes[i] = Outcome(
                    res.text, list(res.token_ids), res.finish_reason, res.stats, res.prompt_tokens,
                    res.stats.seconds, requests[i].decision, {"batch_size": len(rows)},
                )
        return [o for o in outcomes if o is not None]

    def _chunks(self, req: Request) -> Iterator[GenerationChunk]:
        """GenerationChunks of one request; the last carries finish_reason, usage and stats."""
        engine = self.get_engine()
        text, ids = "", []
        start = time.perf_counter()
        for chunk in stream_request(engine, req, self.timeout):
            text += chunk.text
            ids.extend(chunk.token_ids)
            if chunk.finish_reason is None:
                if chunk.text:
                    yield GenerationChunk(text=chunk.text)
                continue
            seconds = time.perf_counter() - start  # wall time, as for invoke
            outcome = Outcome(text, ids, chunk.finish_reason, chunk.stats, len(req.prompt_ids), seconds, req.decision)
            yield GenerationChunk(text=chunk.text, generation_info=self._generation(outcome).generation_info)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for chunk in self._chunks(self._request(prompt, stop, run_manager, kwargs)):
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        # The request is built in the worker too: the first call loads the weights.
        async for chunk in aiter_in_thread(lambda: self._chunks(self._request(prompt, stop, run_manager, kwargs))):
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
