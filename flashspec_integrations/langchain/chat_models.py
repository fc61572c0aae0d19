"""ChatFlashSpec: a LangChain chat model over the FlashSpec engine, with tools and structured output."""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputKeyToolsParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from flashspec_core.constrained.tool_schema import tool_call_schema
from flashspec_integrations.langchain._messages import (
    TOOL_CALL_CLOSE,
    content_text,
    json_instruction,
    message_roles,
    render_chat,
    template_supports_tools,
)
from flashspec_integrations.langchain._base import (
    FlashSpecParams,
    Outcome,
    Request,
    aiter_in_thread,
    engine_takes_json_schema,
    run_request,
    stream_request,
)
from flashspec_integrations.langchain._tools import (
    ToolCallStreamer,
    ToolChoice,
    first_json_value,
    forced_prefix,
    normalize_tool_choice,
    parse_tool_calls,
    to_openai_tools,
    tool_names,
)

_CALL_KWARGS = ("tools", "tool_choice", "response_format", "structured_output")


def _parse_json_reply(model: type | None, message: AIMessage) -> Any:
    """The first JSON object of a reply (prose or code fences around it allowed), validated into
    `model` (a pydantic v2 or v1 class) when given; OutputParserException otherwise, so
    `include_raw` can report it."""
    text = content_text(message.content, "reply")
    try:
        value = first_json_value(text)
        if model is None:
            return value
        return model.model_validate(value) if issubclass(model, BaseModel) else model.parse_obj(value)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise OutputParserException(f"the reply is not the requested JSON: {exc}", llm_output=text) from exc


@dataclass
class _Plan:
    """A prepared call: the engine request and how to read its output."""

    request: Request
    names: list[str]
    parse_tools: bool


class ChatFlashSpec(FlashSpecParams, BaseChatModel):
    """A chat model: messages through the target's chat template, tool calling, structured output.

    Tool calls use the template's own tool format when it has one, else the Hermes `<tool_call>`
    format (`langchain_messages`). A forced tool choice or structured output asks the engine for
    schema-constrained decoding when the engine offers it (`_output_constraint`); otherwise the
    reply starts with the call's forced prefix and is parsed leniently, with failures reported in
    `AIMessage.invalid_tool_calls`.
    """

    @property
    def _llm_type(self) -> str:
        return "flashspec-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        return {**self._ls_common(stop, kwargs), "ls_model_type": "chat"}

    # ------------------------------------------------------------------------ token counting

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` under the target tokenizer (offline)."""
        return self.get_engine().tokenizer(text, add_special_tokens=False).input_ids

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Tokens of the prompt these messages (and tools) render to, generation prompt included."""
        formatted = to_openai_tools(tools) if tools else []
        return len(self.get_token_ids(render_chat(self.get_engine().tokenizer, messages, formatted)))

    # ------------------------------------------------------------------------------- tools

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | Any],
        *,
        tool_choice: str | bool | dict | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic models or OpenAI dicts).

        tool_choice: "auto" (default), "none", "any"/"required"/True (some tool must be called) or
        a tool's name.
        """
        formatted = to_openai_tools(tools)
        normalize_tool_choice(tool_choice, formatted)
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
        always parses into what was asked). `strict` is
        accepted for compatibility: the parser validates either way.
        """
        if kwargs:
            raise ValueError(f"with_structured_output: unsupported arguments {sorted(kwargs)}")
        is_model = is_basemodel_subclass(schema)  # pydantic v2 or v1 (pydantic.v1.BaseModel)
        if method == "function_calling":
            if schema is None:
                raise ValueError("schema: function_calling needs a schema; pass one or use method='json_mode'")
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, structured_output=True, ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict}, "schema": convert_to_openai_tool(schema)})
            parser: Runnable = (
                PydanticToolsParser(tools=[schema], first_tool_only=True) if is_model
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_mode", "json_schema"):
            if method == "json_schema" and schema is None:
                raise ValueError("schema: json_schema needs a schema; pass one or use method='json_mode'")
            # JSON mode given a schema to parse into decodes under it too: a reply the parser would
            # reject is never produced (an API's JSON mode only promises some object).
            fmt = {"type": "json_object"} if schema is None else {
                "type": "json_schema", "json_schema": {"schema": convert_to_json_schema(schema)}}
            llm = self.bind(response_format=fmt, ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict}, "schema": schema})
            parser = RunnableLambda(partial(_parse_json_reply, schema if is_model else None))
        else:
            raise ValueError(f"method must be 'function_calling', 'json_mode' or 'json_schema'; got {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    @staticmethod
    def _output_constraint(tools: Sequence[dict], choice: ToolChoice, response_format: Any) -> dict | None:
        """The JSON schema the whole reply must match, or None for free text.

        This is the seam to schema-constrained decoding: an engine whose `stream` takes
        `json_schema` receives it and decodes under it, exactly; the reply is then the bare JSON
        call or object, which the parser reads as well as the tagged form.
        """
        if choice.forced:
            return tool_call_schema(tools, choice.name or "any")
        if isinstance(response_format, dict):
            if response_format.get("type") == "json_schema":
                return (response_format.get("json_schema") or {}).get("schema") or {"type": "object"}
            if response_format.get("type") == "json_object":
                return {"type": "object"}
        if response_format is not None:
            raise ValueError(
                "response_format must be {'type': 'json_object'} or "
                f"{{'type': 'json_schema', 'json_schema': {{'schema': ...}}}}; got {response_format!r}"
            )
        return None

    # ------------------------------------------------------------------------------ calls

    def _plan(self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, kwargs: dict) -> _Plan:
        engine = self.get_engine()
        max_new, sampling, stops = self._call_settings(stop, kwargs, allowed=_CALL_KWARGS)
        tools = list(kwargs.get("tools") or [])
        choice = normalize_tool_choice(kwargs.get("tool_choice"), tools) if tools else ToolChoice()
        shown = [] if choice.none else tools
        response_format = kwargs.get("response_format")
        schema = self._output_constraint(shown, choice, response_format)
        decision = self._decide(
            run_manager, kwargs,
            tools_bound=bool(shown), tool_choice_forced=choice.forced,
            structured_output=bool(kwargs.get("structured_output")) or response_format is not None,
            roles=message_roles(messages),
            prompt_text="\n".join(content_text(m.content, "messages") for m in messages),
        )
        extra = json_instruction(schema) if response_format is not None else ""
        text = render_chat(engine.tokenizer, messages, shown, extra)
        constrained = schema is not None and engine_takes_json_schema(engine)
        prefix = "" if constrained or template_supports_tools(engine.tokenizer) else forced_prefix(choice)
        ids = engine.tokenizer(text + prefix, add_special_tokens=False).input_ids
        if prefix:  # a forced call is one call: stop where its block closes
            stops = [*stops, TOOL_CALL_CLOSE]
        req = Request(ids, max_new, sampling, stops, decision, prefix, schema)
        return _Plan(request=req, names=tool_names(shown), parse_tools=bool(shown))

    def _metadata(self, outcome: Outcome, finish_reason: str) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "model_provider": "flashspec",
            "finish_reason": finish_reason,
            "flashspec": outcome.info(),
        }

    def _message(self, plan: _Plan, outcome: Outcome) -> AIMessage:
        content, calls, invalid = outcome.text, [], []
        if plan.parse_tools:
            content, calls, invalid = parse_tool_calls(outcome.text, plan.names, outcome.finish_reason != "length")
        finish = "tool_calls" if calls else outcome.finish_reason
        return AIMessage(
            content=content, tool_calls=calls, invalid_tool_calls=invalid,
            usage_metadata=outcome.usage(), response_metadata=self._metadata(outcome, finish),
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        plan = self._plan(messages, stop, run_manager, kwargs)
        outcome = run_request(self.get_engine(), plan.request, self.timeout, self.max_retries)
        message = self._message(plan, outcome)
        info = {"finish_reason": message.response_metadata["finish_reason"]}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)],
                          llm_output={"model_name": self.model_name})

    def _chunks(self, plan: _Plan) -> Iterator[ChatGenerationChunk]:
        """Message chunks of one call; usage and stats come once, on the last chunk."""
        req = plan.request
        streamer = ToolCallStreamer(plan.names) if plan.parse_tools else None
        text, ids, pending = req.prefix, [], req.prefix
        start = time.perf_counter()
        for chunk in stream_request(self.get_engine(), req, self.timeout):
            text += chunk.text
            ids.extend(chunk.token_ids)
            delta, pending = pending + chunk.text, ""
            pieces = list(streamer.feed(delta)) if streamer else [(delta, None)]
            if chunk.finish_reason is not None and streamer:
                pieces += list(streamer.finish(chunk.finish_reason != "length"))
            for content, call in pieces:
                if content or call:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=content, tool_call_chunks=[call] if call else []))
            if chunk.finish_reason is None:
                continue
            seconds = time.perf_counter() - start  # wall time, as for invoke
            outcome = Outcome(text, ids, chunk.finish_reason, chunk.stats, len(req.prompt_ids), seconds, req.decision)
            called = plan.parse_tools and bool(parse_tool_calls(text, plan.names, chunk.finish_reason != "length")[1])
            finish = "tool_calls" if called else chunk.finish_reason
            last = AIMessageChunk(content="", usage_metadata=outcome.usage(),
                                  response_metadata=self._metadata(outcome, finish), chunk_position="last")
            yield ChatGenerationChunk(message=last, generation_info={"finish_reason": finish})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(self._plan(messages, stop, run_manager, kwargs)):
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # Planned in the worker too: the first call loads the weights.
        make = lambda: self._chunks(self._plan(messages, stop, run_manager, kwargs))  # noqa: E731
        async for chunk in aiter_in_thread(make):
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
