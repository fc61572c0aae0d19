"""FlashSpecLLM for LlamaIndex: query engines, ReAct agents and function-calling agents.

    from flashspec_integrations.llama_index import FlashSpecLLM
    Settings.llm = FlashSpecLLM()    # llama_index.core.Settings; the default model, loaded on first use

A `CustomLLM` (`complete`, `stream_complete`, async forms) and a `FunctionCallingLLM` (`chat_with_tools`,
`get_tool_calls_from_response`, `tool_required`) with `ChatFlashSpec`'s fields and call keywords
(`settings.py`; any other is a ValueError). Each call names its kind of step (`_hints`), returns usage
and step statistics (`_responses`), and is its own request in the engine's running batch (the scheduler).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
from llama_index.core.types import TokenAsyncGen, TokenGen

from flashspec_core.results import StreamChunk
from flashspec_integrations.async_bridge import aiter_in_thread
from flashspec_integrations.calls import Outcome, arun_calls, run_calls, stream_call
from flashspec_integrations.domain_rules import REACT
from flashspec_integrations.llama_index._hints import chat_decision, completion_decision, template_scope
from flashspec_integrations.llama_index._messages import to_openai_dicts
from flashspec_integrations.llama_index._responses import (
    PARTIAL,
    chat_response,
    chat_stream,
    completion_response,
    completion_stream,
)
from flashspec_integrations.plan import REACT_STOPS, CallPlan, ChatRequest, plan_chat, plan_text
from flashspec_integrations.prompts import render_prompt, tools_instructions
from flashspec_integrations.settings import FlashSpecFields

# Chat keywords beyond the decoding ones: what `_prepare_chat_with_tools` hands `chat`.
_CHAT_KWARGS = ("tools", "tool_required", "tool_choice", "allow_parallel_tool_calls")

# Every ReAct turn must open with a thought; small models drift out of the format unless the turn
# is started for them (the output is still exactly the target's, conditioned on this prefix).
REACT_PREFIX = "Thought:"

# Set while llama-index-core's structured streaming runs: its FunctionCallingProgram.stream_call
# (0.14.x) drops `tool_required` (run-llama/llama_index#19620), so the call it makes would be
# neither forced nor decoded under the output schema; the tool calls made under this flag are
# forced. A program streamed directly, not through this LLM, takes tool_choice="required".
_structured_call: contextvars.ContextVar[bool] = contextvars.ContextVar("flashspec_structured_call", default=False)


@contextlib.contextmanager
def _forcing_calls() -> Iterator[None]:
    token = _structured_call.set(True)
    try:
        yield
    finally:
        _structured_call.reset(token)


def tool_spec(tool: Any) -> dict:
    """An OpenAI-style function spec from a LlamaIndex tool, or a spec dict passed through."""
    if isinstance(tool, Mapping):
        spec = dict(tool)
        if "function" not in spec and "name" in spec:
            spec = {"type": "function", "function": spec}
        if not isinstance(spec.get("function"), Mapping) or "name" not in spec["function"]:
            raise ValueError(f"tools: a tool dict needs a function name; got {str(tool)[:80]!r}")
        return spec
    metadata = getattr(tool, "metadata", None)
    if metadata is None or not hasattr(metadata, "to_openai_tool"):
        raise ValueError(f"tools: expected LlamaIndex tools or OpenAI-style dicts; got {type(tool).__name__}")
    return metadata.to_openai_tool(skip_length_check=True)


class FlashSpecLLM(FlashSpecFields, FunctionCallingLLM, CustomLLM):
    """A LlamaIndex LLM backed by a FlashSpec `SpecEngine` (exact speculative decoding).

    engine: a ready `SpecEngine` (or anything with its `generate`/`stream`/`tokenizer` surface);
    None resolves the process-wide engine for `target`/`drafts`/`router`/`device` on first use
    (shared with every other adapter instance of the same settings). Construction is instant.
    """

    context_window: int | None = Field(default=None, gt=0, description="None: the model's own.")
    react_prefill: bool = Field(
        default=True, description="Start ReAct turns with 'Thought:', as the ReAct header demands.")

    @classmethod
    def class_name(cls) -> str:
        return "FlashSpecLLM"

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.get_engine()
        return LLMMetadata(
            context_window=self.context_window or engine.context_window,
            num_output=self.max_tokens,
            is_chat_model=self._uses_chat_template() or self._custom_messages_to_prompt(),
            is_function_calling_model=True,
            model_name=self.model_name,
        )

    # --------------------------------------------------------------------- request building

    def _custom_messages_to_prompt(self) -> bool:
        return self.messages_to_prompt is not generic_messages_to_prompt

    def _uses_chat_template(self) -> bool:
        if self._custom_messages_to_prompt():
            return False
        return getattr(self.get_engine().tokenizer, "chat_template", None) is not None

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict) -> CallPlan:
        """Everything about a chat call that is known before generation, computed in the caller's context."""
        self.check_call_kwargs(kwargs, _CHAT_KWARGS)
        max_new, sampling = self.decoding(kwargs)
        def own_format(dicts: Sequence[Mapping[str, Any]], shown: Sequence[Mapping[str, Any]]) -> str:
            head = [ChatMessage(role=MessageRole.SYSTEM, content=tools_instructions(shown))] if shown else []
            to_prompt = self.messages_to_prompt
            assert to_prompt is not None  # LlamaIndex's validator sets one
            return to_prompt([*head, *messages])

        render = None if self._uses_chat_template() else own_format
        request = ChatRequest(
            to_openai_dicts(messages), max_new, sampling, [tool_spec(t) for t in kwargs.get("tools") or ()],
            kwargs.get("tool_choice"), tool_required=bool(kwargs.get("tool_required")) or _structured_call.get(),
            parallel_tool_calls=None if kwargs.get("allow_parallel_tool_calls") else False,
            stop=self.stops(kwargs.get("stop")), render=render,
            react_prefix=REACT_PREFIX if self.react_prefill else "",
        )
        domain = kwargs.get("domain")
        return plan_chat(self.get_engine(), request,
                         lambda facts: chat_decision(facts, domain, self.domain, self.domain_per_node))

    def _completion_request(self, prompt: str, formatted: bool, kwargs: dict) -> CallPlan:
        """A completion: raw text when `formatted`, else `completion_to_prompt` or a user turn."""
        self.check_call_kwargs(kwargs)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt: expected a non-empty string")
        decision = completion_decision(prompt, kwargs.get("domain"), self.domain, self.domain_per_node)
        max_new, sampling = self.decoding(kwargs)
        stops = self.stops(kwargs.get("stop"), *(REACT_STOPS if decision.label == REACT else ()))
        text, templated = prompt, False
        to_prompt = self.completion_to_prompt
        if not formatted and to_prompt is not None and to_prompt is not default_completion_to_prompt:
            text = to_prompt(prompt)
        elif not formatted and self._uses_chat_template():
            turns = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            text, templated = render_prompt(self.get_engine().tokenizer,
                                            [*turns, {"role": "user", "content": prompt}]), True
        return plan_text(self.get_engine(), text, max_new, sampling, stops, decision, templated)

    def _run(self, req: CallPlan) -> Outcome:
        return run_calls(self.get_engine(), [req], self.timeout)[0]

    async def _arun(self, req: CallPlan) -> Outcome:
        engine = await asyncio.to_thread(self.get_engine)  # the first call loads the weights
        return (await arun_calls(engine, [req], self.timeout))[0]

    def _stream(self, req: CallPlan) -> Iterator[StreamChunk]:
        return stream_call(self.get_engine(), req, self.timeout)

    # ----------------------------------------------------------------------- the LLM surface

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        req = self._completion_request(prompt, formatted, kwargs)
        return completion_response(req, self._run(req))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        req = self._completion_request(prompt, formatted, kwargs)
        return completion_stream(req, self._stream(req))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._chat_request(messages, kwargs)
        return chat_response(req, self._run(req))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        req = self._chat_request(messages, kwargs)
        return chat_stream(req, self._stream(req))

    # CallPlans are built in a worker (the first call loads the weights), in the caller's context.

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        req = await asyncio.to_thread(self._completion_request, prompt, formatted, kwargs)
        return completion_response(req, await self._arun(req))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        req = await asyncio.to_thread(self._completion_request, prompt, formatted, kwargs)
        return aiter_in_thread(lambda: completion_stream(req, self._stream(req)))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = await asyncio.to_thread(self._chat_request, messages, kwargs)
        return chat_response(req, await self._arun(req))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        req = await asyncio.to_thread(self._chat_request, messages, kwargs)
        return aiter_in_thread(lambda: chat_stream(req, self._stream(req)))

    # Prompt-template entry points: remember the template, so synthesis calls are filed as rag.

    def predict(self, prompt: Any, **prompt_args: Any) -> str:
        with template_scope(prompt):
            return super().predict(prompt, **prompt_args)

    def stream(self, prompt: Any, **prompt_args: Any) -> TokenGen:
        with template_scope(prompt):
            return super().stream(prompt, **prompt_args)

    async def apredict(self, prompt: Any, **prompt_args: Any) -> str:
        with template_scope(prompt):
            return await super().apredict(prompt, **prompt_args)

    async def astream(self, prompt: Any, **prompt_args: Any) -> TokenAsyncGen:
        with template_scope(prompt):
            return await super().astream(prompt, **prompt_args)

    # Structured streaming: the call is forced (see `_structured_call`).

    def _structured_stream_call(  # type: ignore[override]  # passes the parent's generic arguments through
        self, *args: Any, **kwargs: Any
    ) -> Iterator[Any]:
        objects = super()._structured_stream_call(*args, **kwargs)
        while True:
            with _forcing_calls():  # only around the program's own steps, never the consumer's
                try:
                    item = next(objects)
                except StopIteration:
                    return
            yield item

    async def _structured_astream_call(  # type: ignore[override]  # passes the parent's generic arguments through
        self, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        with _forcing_calls():  # the program makes its call before it returns the stream
            return await super()._structured_astream_call(*args, **kwargs)

    # --------------------------------------------------------------------- function calling

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Chat arguments for a tool-calling turn; tools become OpenAI-style specs in the prompt."""
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        return {
            "messages": messages,
            "tools": [tool_spec(t) for t in tools],
            "tool_required": tool_required,
            "tool_choice": tool_choice,
            "allow_parallel_tool_calls": allow_parallel_tool_calls,
            **kwargs,
        }

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The calls of a finished response; `[]` for a partial streamed chunk (not parsed yet)."""
        if response.additional_kwargs.get(PARTIAL):
            return []
        blocks = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if not blocks and error_on_no_tool_call:
            raise ValueError(f"Expected at least one tool call, but got 0 tool calls: {response.message.content!r}")
        selections: list[ToolSelection] = []
        for block in blocks:
            # A call written badly (or cut by the token limit) keeps its raw text in the message's
            # block; its selection has no arguments, so the tool refuses it as a call without them.
            arguments = block.tool_kwargs
            selections.append(ToolSelection(
                tool_id=block.tool_call_id or f"call_{len(selections)}",
                tool_name=block.tool_name,
                tool_kwargs=arguments if isinstance(arguments, dict) else {},
            ))
        return selections
