"""FlashSpecLLM for LlamaIndex: query engines, ReAct agents and function-calling agents.

    from llama_index.core import Settings
    from flashspec_integrations.llama_index import FlashSpecLLM
    Settings.llm = FlashSpecLLM()                  # the embedded default model, loaded on first use

One class serves both LlamaIndex contracts: it is a `CustomLLM` (completion model: `complete`,
`stream_complete` and their async forms) and a `FunctionCallingLLM` (`chat_with_tools`,
`get_tool_calls_from_response`, `tool_required`), so query engines, `ReActAgent` and
`FunctionAgent` all take it. Every call tells the engine what kind of step it is (see
`llama_index_hints`), so the router picks drafts per step kind, and every response carries
token usage and the engine's per-step statistics (see `llama_index_responses`).

The async methods run the engine in worker threads: decoding never blocks the event loop.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

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
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt

from flashspec_core import SamplingParams
from flashspec_integrations.context import JSON, REACT, TOOL, TOOL_RESULT
from flashspec_integrations.llama_index._async import iterate_in_thread, run_in_thread
from flashspec_integrations.llama_index._hints import chat_decision, completion_decision, template_scope
from flashspec_integrations.llama_index._messages import add_system_text, render_chat, to_template_messages
from flashspec_integrations.llama_index._responses import (
    PARTIAL,
    Request,
    chat_response,
    chat_stream,
    completion_response,
    completion_stream,
)
from flashspec_integrations.llama_index._tools import (
    CALL_CLOSE,
    TOOL_STOPS,
    constraint_kwargs,
    forced_call_schema,
    forced_prefix,
    forced_tool,
    loads_lenient,
    tool_name,
    tool_spec,
    tools_instructions,
)

# Lines a ReAct step must never write itself: the observation is the tool's to supply.
REACT_STOPS = ("\nObservation:",)
# Every ReAct turn must open with a thought; small models drift out of the format unless the turn
# is started for them (the output is still exactly the target's, conditioned on this prefix).
REACT_PREFIX = "Thought:"
_ENGINE_LOCK = threading.Lock()


class FlashSpecLLM(FunctionCallingLLM, CustomLLM):
    """A LlamaIndex LLM backed by a FlashSpec `SpecEngine` (exact speculative decoding).

    engine: a ready `SpecEngine` (or anything with its `generate`/`stream`/`tokenizer` surface);
    None builds one on first use: `SpecEngine.from_pretrained(**engine_kwargs)` when
    `engine_kwargs` is given, else the shared `SpecEngine.from_default()`. Construction is instant.
    """

    max_new_tokens: int = Field(default=256, gt=0, description="Tokens generated per call at most (num_output).")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding.")
    top_k: int = Field(default=0, ge=0, description="0 disables top-k.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="1 disables nucleus sampling.")
    seed: int | None = Field(default=None, description="Seeds every random draw of a call.")
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="HF's penalty on repeated tokens; 1 disables.")
    no_repeat_ngram_size: int = Field(default=0, ge=0, description="Ban repeating an n-gram of the output; 0 disables.")
    stop: list[str] = Field(default_factory=list, description="Stop strings for every call.")
    domain: str | None = Field(default=None, description="Router domain for every call (call kwargs and tags win).")
    context_window: int | None = Field(default=None, gt=0, description="None: the model's own.")
    react_prefill: bool = Field(
        default=True, description="Start ReAct turns with 'Thought:', as the ReAct header demands."
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, exclude=True, description="Arguments of SpecEngine.from_pretrained."
    )
    _engine: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "FlashSpecLLM"

    @property
    def engine(self) -> Any:
        """The engine, built on first use (the default model loads once per process)."""
        if self._engine is None:
            with _ENGINE_LOCK:
                if self._engine is None:
                    from flashspec_core import SpecEngine

                    self._engine = (
                        SpecEngine.from_pretrained(**self.engine_kwargs)
                        if self.engine_kwargs
                        else SpecEngine.from_default()
                    )
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.engine
        return LLMMetadata(
            context_window=self.context_window or engine.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self._uses_chat_template() or self._custom_messages_to_prompt(),
            is_function_calling_model=True,
            model_name=str(engine.model_name),
        )

    # --------------------------------------------------------------------- request building

    def _custom_messages_to_prompt(self) -> bool:
        return self.messages_to_prompt is not generic_messages_to_prompt

    def _uses_chat_template(self) -> bool:
        return not self._custom_messages_to_prompt() and getattr(self.engine.tokenizer, "chat_template", None) is not None

    def _engine_kwargs(self, kwargs: dict, decision: Any, extra_stops: Sequence[str]) -> dict:
        max_new_tokens = kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens))
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int; got {max_new_tokens!r}")
        sampling = SamplingParams(
            temperature=kwargs.get("temperature", self.temperature),
            top_k=kwargs.get("top_k", self.top_k),
            top_p=kwargs.get("top_p", self.top_p),
            seed=kwargs.get("seed", self.seed),
            repetition_penalty=kwargs.get("repetition_penalty", self.repetition_penalty),
            no_repeat_ngram_size=kwargs.get("no_repeat_ngram_size", self.no_repeat_ngram_size),
        )
        call_stop = kwargs.get("stop") or []
        call_stop = [call_stop] if isinstance(call_stop, str) else list(call_stop)
        stops = list(dict.fromkeys([*self.stop, *call_stop, *extra_stops]))
        return {
            "max_new_tokens": max_new_tokens,
            "sampling": sampling,
            "stop": stops or None,
            "domain": decision.domain,
            "hint": decision.hint,
        }

    def _encode(self, text: str, templated: bool) -> list[int]:
        """Token ids; a rendered chat template already holds its special tokens."""
        return list(self.engine.tokenizer(text, add_special_tokens=not templated).input_ids)

    def _render(self, messages: Sequence[ChatMessage], specs: list[dict], prefix: str) -> list[int]:
        """Prompt ids: the tool instructions in the system turn, the template, the prefill."""
        if self._uses_chat_template():
            dicts = to_template_messages(messages)
            if specs:
                dicts = add_system_text(dicts, tools_instructions(specs))
            return self._encode(render_chat(self.engine.tokenizer, dicts, prefix), templated=True)
        if specs:
            messages = [ChatMessage(role=MessageRole.SYSTEM, content=tools_instructions(specs)), *messages]
        return self._encode(self.messages_to_prompt(messages) + prefix, templated=False)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict) -> Request:
        """Everything about a chat call that is known before generation, computed in the caller's context."""
        if not messages:
            raise ValueError("messages: empty; pass at least one ChatMessage")
        tool_choice = kwargs.get("tool_choice")
        specs = [] if tool_choice == "none" else [tool_spec(t) for t in kwargs.get("tools") or ()]
        forced, forced_name = forced_tool(specs, tool_choice, bool(kwargs.get("tool_required"))) if specs else (False, None)
        decision = chat_decision(messages, kwargs.get("domain"), self.domain, bool(specs), forced)
        label = decision.label
        stops: list[str] = []
        if specs or label in (TOOL, TOOL_RESULT, JSON):
            stops += TOOL_STOPS
        if forced or (specs and not kwargs.get("allow_parallel_tool_calls", False)):
            stops.append(CALL_CLOSE)
        if label == REACT:
            stops += REACT_STOPS
        engine_kwargs = self._engine_kwargs(kwargs, decision, stops)
        prefix = REACT_PREFIX if label == REACT and self.react_prefill else ""
        if forced:
            constraint = constraint_kwargs(self.engine, forced_call_schema(specs, forced_name))
            engine_kwargs.update(constraint)
            params = next((s["function"].get("parameters") for s in specs if tool_name(s) == forced_name), None)
            prefix = forced_prefix(forced_name, constrained=bool(constraint), parameters=params)
        ids = self._render(messages, specs, prefix)
        names = tuple(tool_name(s) for s in specs) if specs else None
        single = forced or not kwargs.get("allow_parallel_tool_calls", False)
        return Request(ids, engine_kwargs, prefix=prefix, tool_names=names, single_call=single, forced_name=forced_name)

    def _completion_request(self, prompt: str, formatted: bool, kwargs: dict) -> Request:
        """A completion: raw text when `formatted`, else `completion_to_prompt` or a user turn."""
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt: expected a non-empty string")
        decision = completion_decision(prompt, kwargs.get("domain"), self.domain)
        engine_kwargs = self._engine_kwargs(kwargs, decision, REACT_STOPS if decision.label == REACT else ())
        if not formatted and self.completion_to_prompt is not default_completion_to_prompt:
            ids = self._encode(self.completion_to_prompt(prompt), templated=False)
        elif not formatted and self._uses_chat_template():
            turns = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            turns.append({"role": "user", "content": prompt})
            ids = self._encode(render_chat(self.engine.tokenizer, turns), templated=True)
        else:
            ids = self._encode(prompt, templated=False)
        return Request(ids, engine_kwargs)

    def _run(self, req: Request):
        return self.engine.generate(req.prompt_ids, **req.engine_kwargs)

    def _run_stream(self, req: Request):
        return self.engine.stream(req.prompt_ids, **req.engine_kwargs)

    def _complete(self, prompt: str, formatted: bool, kwargs: dict) -> CompletionResponse:
        req = self._completion_request(prompt, formatted, kwargs)
        return completion_response(req, self._run(req))

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict) -> ChatResponse:
        req = self._chat_request(messages, kwargs)
        return chat_response(req, self._run(req))

    # ----------------------------------------------------------------------- the LLM surface

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        req = self._completion_request(prompt, formatted, kwargs)
        return completion_stream(req, self._run_stream(req))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        req = self._chat_request(messages, kwargs)
        return chat_stream(req, self._run_stream(req))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await run_in_thread(self._complete, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        req = await run_in_thread(self._completion_request, prompt, formatted, kwargs)
        return iterate_in_thread(lambda: completion_stream(req, self._run_stream(req)))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await run_in_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        req = await run_in_thread(self._chat_request, messages, kwargs)
        return iterate_in_thread(lambda: chat_stream(req, self._run_stream(req)))

    # Prompt-template entry points: remember the template, so synthesis calls are filed as rag.

    def predict(self, prompt: Any, **prompt_args: Any) -> str:
        with template_scope(prompt):
            return super().predict(prompt, **prompt_args)

    def stream(self, prompt: Any, **prompt_args: Any):
        with template_scope(prompt):
            return super().stream(prompt, **prompt_args)

    async def apredict(self, prompt: Any, **prompt_args: Any) -> str:
        with template_scope(prompt):
            return await super().apredict(prompt, **prompt_args)

    async def astream(self, prompt: Any, **prompt_args: Any):
        with template_scope(prompt):
            return await super().astream(prompt, **prompt_args)

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
        selections = []
        for block in blocks:
            arguments = block.tool_kwargs
            if isinstance(arguments, str):
                try:
                    arguments = loads_lenient(arguments)
                except ValueError:
                    arguments = {}
            selections.append(
                ToolSelection(
                    tool_id=block.tool_call_id or f"call_{len(selections)}",
                    tool_name=block.tool_name,
                    tool_kwargs=arguments if isinstance(arguments, dict) else {},
                )
            )
        return selections
