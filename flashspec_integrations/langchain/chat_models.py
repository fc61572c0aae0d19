"""ChatFlashSpec: a LangChain chat model over the FlashSpec engine, with tools and structured output."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from functools import partial
from operator import itemgetter
from typing import Any, Literal, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.tool import InvalidToolCall, ToolCall, invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import get_config_list
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict

from flashspec_integrations.calls import Outcome, stream_call
from flashspec_integrations.langchain._base import LangChainParams, usage
from flashspec_integrations.langchain._messages import content_text, to_openai_dicts
from flashspec_integrations.plan import CallPlan, ChatRequest, plan_chat
from flashspec_integrations.prompts import render_prompt
from flashspec_integrations.tool_calls import ParsedCall, first_json_object
from flashspec_integrations.tool_choice import normalize_tool_choice

_CALL_KWARGS = ("tools", "tool_choice", "response_format", "structured_output", "parallel_tool_calls", "strict")


def _parse_json_reply(model: type | None, message: AIMessage) -> Any:
    """The first JSON object of a reply (prose or code fences around it allowed), validated into
    `model` (a pydantic v2 or v1 class) when given; OutputParserException otherwise, so
    `include_raw` can report it."""
    text = content_text(message.content, "reply")
    try:
        value = first_json_object(text)
        if model is None:
            return value
        if issubclass(model, BaseModel):
            return model.model_validate(value)
        return cast(Any, model).parse_obj(value)  # a pydantic.v1 model
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise OutputParserException(f"the reply is not the requested JSON: {exc}", llm_output=text) from exc


def _lc_call(call: ParsedCall) -> ToolCall | InvalidToolCall:
    if call.valid and call.name is not None and call.arguments is not None:
        return tool_call(name=call.name, args=call.arguments, id=call.id)
    return invalid_tool_call(name=call.name, args=call.raw, id=call.id, error=call.error)


class ChatFlashSpec(LangChainParams, BaseChatModel):
    """A chat model: messages through the target's chat template, tool calling, structured output.

    Tool calls use the template's own tool format when it has one, else the Hermes `<tool_call>`
    format (`flashspec_integrations.prompts`). A forced tool choice or structured output is
    decoded under its JSON schema (`_output_constraint`), so it always parses; unforced calls are
    the model's choice and are parsed leniently, failures reported in `AIMessage.invalid_tool_calls`.
    `batch`, `abatch` and concurrent callers run side by side in the engine's running batch, each
    call with its own settings.
    """

    # LangChain's base class ignores unknown arguments; a misspelt setting should fail instead.
    model_config = ConfigDict(extra="forbid")

    @property
    def _llm_type(self) -> str:
        return "flashspec-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return cast(LangSmithParams, {**self._ls_common(stop, kwargs), "ls_model_type": "chat"})

    # ------------------------------------------------------------------------ token counting

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Tokens of the prompt these messages (and tools) render to, generation prompt included."""
        formatted = [convert_to_openai_tool(t) for t in tools or ()]
        return len(self.get_token_ids(render_prompt(self.get_engine().tokenizer, to_openai_dicts(messages), formatted)))

    # ------------------------------------------------------------------------------- tools

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | Any],
        *,
        tool_choice: str | bool | dict | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic models or OpenAI dicts).

        tool_choice: "auto" (default), "none", "any"/"required"/True (some tool must be called) or
        a tool's name. A forced call is decoded under the tool's JSON schema, so its arguments
        always match it. strict: as OpenAI's, the schemas are made strict (every property
        required, no others: `convert_to_openai_tool(strict=True)`), which a forced call's grammar
        then enforces; an unforced call cannot be constrained before the model chooses to call, and
        its arguments are checked by the tool's own schema when it runs. parallel_tool_calls=False:
        one call per reply at most (decoding stops where the first call closes).
        """
        if isinstance(tools, (str, dict)) or not isinstance(tools, Sequence):
            raise ValueError("tools: pass a list of tools (BaseTool, functions, pydantic models or OpenAI dicts)")
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        normalize_tool_choice(tool_choice, formatted)  # a bad choice fails here, not at invoke
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type,
        *,
        method: Literal["function_calling", "json_mode", "json_schema"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Replies parsed into `schema` (a pydantic class, TypedDict or JSON schema dict).

        method: "function_calling" forces a call of a tool shaped like the schema; "json_schema"
        asks for a JSON reply matching the schema; "json_mode" for a JSON object, decoded under the
        schema when one is given (an API's JSON mode only promises some object; here the reply
        always parses into what was asked). Every method decodes under the schema, so `strict`
        changes nothing but the schema's form (see `bind_tools`).
        """
        if kwargs:
            raise ValueError(f"with_structured_output: unsupported arguments {sorted(kwargs)}")
        # pydantic v2 or v1 (pydantic.v1.BaseModel); None for a TypedDict or a JSON schema dict
        model = schema if isinstance(schema, type) and is_basemodel_subclass(schema) else None
        if method == "function_calling":
            if schema is None:
                raise ValueError("schema: function_calling needs a schema; pass one or use method='json_mode'")
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, strict=strict, structured_output=True,
                                  ls_structured_output_format={"kwargs": {"method": method, "strict": strict},
                                                               "schema": convert_to_openai_tool(schema)})
            parser: Runnable = (
                PydanticToolsParser(tools=[model], first_tool_only=True) if model is not None
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_mode", "json_schema"):
            if method == "json_schema" and schema is None:
                raise ValueError("schema: json_schema needs a schema; pass one or use method='json_mode'")
            fmt = {"type": "json_object"} if schema is None else {
                "type": "json_schema", "json_schema": {"schema": convert_to_json_schema(schema)}}
            llm = self.bind(response_format=fmt, ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict}, "schema": schema})
            parser = RunnableLambda(partial(_parse_json_reply, model))
        else:
            raise ValueError(f"method must be 'function_calling', 'json_mode' or 'json_schema'; got {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # ------------------------------------------------------------------------------ calls

    def _plan(self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, kwargs: dict) -> CallPlan:
        self._check_kwargs(kwargs, _CALL_KWARGS)
        tools = list(kwargs.get("tools") or [])
        if kwargs.get("strict"):
            tools = [convert_to_openai_tool(t, strict=True) for t in tools]
        max_new, sampling = self.decoding(kwargs)
        request = ChatRequest(
            to_openai_dicts(messages), max_new, sampling, tools, kwargs.get("tool_choice"),
            parallel_tool_calls=kwargs.get("parallel_tool_calls"),
            response_format=kwargs.get("response_format"), structured_output=bool(kwargs.get("structured_output")),
            stop=self.stops(stop),
        )
        return plan_chat(self.get_engine(), request, partial(self._decide, run_manager, kwargs))

    def _metadata(self, outcome: Outcome, finish_reason: str) -> dict[str, Any]:
        return {"model_name": self.model_name, "model_provider": "flashspec", "finish_reason": finish_reason,
                "flashspec": outcome.info()}

    def _result(self, plan: CallPlan, outcome: Outcome) -> ChatResult:
        content, calls = plan.read(outcome.text, outcome.finish_reason != "length")
        lc_calls = [_lc_call(c) for c in calls]
        valid = [c for c in lc_calls if c["type"] == "tool_call"]
        finish = "tool_calls" if valid else outcome.finish_reason
        message = AIMessage(
            content=content, tool_calls=valid, invalid_tool_calls=[c for c in lc_calls if c["type"] != "tool_call"],
            usage_metadata=usage(outcome), response_metadata=self._metadata(outcome, finish),
        )
        return ChatResult(generations=[ChatGeneration(message=message, generation_info={"finish_reason": finish})],
                          llm_output={"model_name": self.model_name})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        plan = self._plan(messages, stop, run_manager, kwargs)
        return self._result(plan, self._run([plan])[0])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # Planned in a worker (the first call loads the weights); then waits on the engine.
        plan = await asyncio.to_thread(self._plan, messages, stop, run_manager, kwargs)
        return self._result(plan, (await self._arun([plan]))[0])

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        """LangChain runs a chat model's `batch` as one `invoke` per input in a thread pool of
        `max_concurrency` threads (by default min(32, cores + 4)). Unless the caller set
        `max_concurrency`, the pool here is as wide as the batch, so every input's call joins the
        engine's running batch at once."""
        configs = get_config_list(config, len(inputs))
        if all(c.get("max_concurrency") is None for c in configs):
            configs = [{**c, "max_concurrency": len(inputs)} for c in configs]
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    def _chunks(self, plan: CallPlan) -> Iterator[ChatGenerationChunk]:
        """Message chunks of one call; usage and stats come once, on the last chunk."""
        streamer = plan.streamer()
        text, ids, pending, index = plan.prefix, [], plan.prefix, 0
        start = time.perf_counter()
        for chunk in stream_call(self.get_engine(), plan, self.timeout):
            text += chunk.text
            ids.extend(chunk.token_ids)
            delta, pending = pending + chunk.text, ""
            pieces = list(streamer.feed(delta)) if streamer else [(delta, None)]
            if chunk.finish_reason is not None and streamer:
                pieces += list(streamer.finish(chunk.finish_reason != "length"))
            for content, parsed in pieces:
                if parsed is not None and plan.single_call and index:
                    parsed = None  # one call at most
                if not (content or parsed):
                    continue
                calls = []
                if parsed is not None:
                    # LangChain parses chunk args with a partial-JSON parser when it aggregates, which
                    # would turn a cut-off call into a valid one; an invalid call's raw text is
                    # therefore sent as a JSON string, which that parser never reads as arguments.
                    args = json.dumps(parsed.arguments if parsed.valid else parsed.raw, ensure_ascii=False)
                    calls = [tool_call_chunk(name=parsed.name, args=args, id=parsed.id, index=index)]
                    index += 1
                yield ChatGenerationChunk(message=AIMessageChunk(content=content, tool_call_chunks=calls))
            if chunk.finish_reason is None:
                continue
            outcome = Outcome(text, ids, chunk.finish_reason, chunk.stats, len(plan.prompt_ids),
                              time.perf_counter() - start, plan.decision)  # wall time, as for invoke
            called = any(c.valid for c in plan.read(text, chunk.finish_reason != "length")[1])
            finish = "tool_calls" if called else chunk.finish_reason
            last = AIMessageChunk(content="", usage_metadata=usage(outcome),
                                  response_metadata=self._metadata(outcome, finish), chunk_position="last")
            yield ChatGenerationChunk(message=last, generation_info={"finish_reason": finish})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        yield from self._relay(self._chunks(self._plan(messages, stop, run_manager, kwargs)), run_manager)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        make = lambda: self._chunks(self._plan(messages, stop, run_manager, kwargs))
        async for chunk in self._arelay(make, run_manager):
            yield chunk
