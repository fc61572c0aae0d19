"""A chat-completions request -> one engine call; the engine's output -> the reply.

The call is planned by `flashspec_integrations.plan.plan_chat`, as the LangChain and LlamaIndex
adapters plan theirs, so a chain gets the same prompt, stops, domain, tool handling and grammar
whether its model runs in-process or behind this endpoint. The request's fields become a
`ChatRequest` (OpenAI defaults for sampling), the domain rule reads `domain` and
`metadata["flashspec_domain"]`, and the grammar is compiled first, in a worker process killed past
the compile limit, so a schema that does not compile, or not in time, is a 400 before any decoding
(the engine compiles nothing itself). Tool calls are read back from the output (`tool_calls`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from flashspec_core.constrained import Grammar, as_grammar
from flashspec_core.constrained.compile_process import CompileBusy
from flashspec_core.engine_protocol import ServedEngine
from flashspec_core.models import vocab_size
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.results import GenerationStats
from flashspec_integrations.domain_rules import DomainDecision, StepContext, decide_domain
from flashspec_integrations.plan import CallPlan, ChatRequest, PlanError, plan_chat
from flashspec_integrations.serve.protocol import CONTEXT_LENGTH_EXCEEDED, APIError, ChatCompletionRequest
from flashspec_integrations.tool_calls import ParsedCall

# OpenAI's defaults where a request leaves a sampling field out.
OPENAI_TEMPERATURE, OPENAI_TOP_P = 1.0, 1.0


def _text(content: Any, at: str) -> str:
    """A message's content as text: a string, or the text of OpenAI content parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" for p in content):
            raise APIError(400, f"{at}: only text content parts are supported", "messages")
        return "".join(str(p.get("text", "")) for p in content)
    raise APIError(400, f"{at}: content must be a string or a list of text parts", "messages")


def _messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as OpenAI-form dicts with text content."""
    dicts = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=True)
        d["content"] = _text(d.get("content"), f"messages[{i}].content")
        dicts.append(d)
    return dicts


def _compile(engine: ServedEngine, schema: dict, field: str, timeout_s: float | None, retry_after: int) -> Grammar:
    """The schema (or structural tag) compiled within `timeout_s`, in a worker process killed past
    it; a bad or too costly schema is the caller's 400, every worker busy for the whole limit a 503
    with `Retry-After: retry_after`."""
    try:
        return as_grammar(schema, engine.tokenizer, vocab_size(engine.target_model), sorted(engine.eos_ids),
                          timeout_s=timeout_s)
    except ValueError as exc:  # named after the engine's argument, json_schema: the request's field instead
        raise APIError(400, f"{field}: {str(exc).removeprefix('json_schema: ')}", field) from None
    except CompileBusy:
        raise APIError(503, f"{field}: the server's grammar compilers stayed busy with other requests for "
                            f"{timeout_s:g} s; retry after {retry_after} s", kind="server_error", code="server_busy",
                       headers={"Retry-After": str(retry_after)}) from None


def _sampling(req: ChatCompletionRequest) -> SamplingParams:
    """The request's sampling settings; APIError(400) naming the field the engine refuses."""
    try:
        return SamplingParams(temperature=OPENAI_TEMPERATURE if req.temperature is None else req.temperature,
                              top_p=OPENAI_TOP_P if req.top_p is None else req.top_p, seed=req.seed)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = str(first["loc"][0]) if first.get("loc") else None
        raise APIError(400, f"{field}: {first['msg']}", field) from None


def _response_format(req: ChatCompletionRequest) -> dict | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema",
            "json_schema": {"schema": None if fmt.json_schema is None else fmt.json_schema.schema_}}


def _decide(req: ChatCompletionRequest, facts: StepContext) -> DomainDecision:
    try:
        return decide_domain(dataclasses.replace(facts, explicit_domain=req.domain, metadata=req.metadata or {}))
    except ValueError as exc:
        raise APIError(400, str(exc), "domain" if req.domain else "metadata") from None


def plan_call(engine: ServedEngine, req: ChatCompletionRequest, default_max_tokens: int,
              max_prompt_tokens: int | None = None, compile_timeout_s: float | None = None,
              retry_after: int = 1) -> CallPlan:
    """The engine call for `req` (`plan.plan_chat`), its schema compiled; APIError(400) naming the
    field for anything it cannot serve.

    max_prompt_tokens: the server's prompt limit (None: the context window only).
    compile_timeout_s: the longest a schema may take to compile (None: as long as it takes, on
    the calling thread). retry_after: the seconds a 503 tells the client to wait (`admission`).
    """
    if req.tool_choice is not None and not req.tools:
        raise APIError(400, "tool_choice: only allowed when tools are given", "tool_choice")
    request = ChatRequest(
        _messages(req), req.max_new_tokens or default_max_tokens, _sampling(req),
        [t.model_dump(exclude_none=True) for t in req.tools or ()],
        req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
        else req.tool_choice.model_dump(),
        parallel_tool_calls=req.parallel_tool_calls is not False, response_format=_response_format(req),
        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
    )
    try:
        plan = plan_chat(engine, request, functools.partial(_decide, req))
    except PlanError as exc:
        raise APIError(400, str(exc), exc.field) from None
    if plan.json_schema is not None:
        plan = plan.replace(grammar=_compile(engine, plan.json_schema, plan.schema_source or "response_format",
                                                 compile_timeout_s, retry_after))
    ids = plan.prompt_ids
    room = engine.context_window - len(ids)
    if room <= 0:
        raise APIError(400, f"messages: the prompt has {len(ids)} tokens, more than the model's context "
                            f"window of {engine.context_window}; shorten it", "messages", code=CONTEXT_LENGTH_EXCEEDED)
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise APIError(400, f"messages: the prompt has {len(ids)} tokens; this server takes at most "
                            f"{max_prompt_tokens} (--max-prompt-tokens); shorten it", "messages")
    if not req.max_new_tokens:
        return plan.replace(max_new_tokens=min(default_max_tokens, room))
    if req.max_new_tokens > room:
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise APIError(400, f"{field}: the prompt has {len(ids)} tokens, so at most {room} new tokens fit "
                            f"the context window of {engine.context_window}; lower {field} or shorten the "
                            "prompt", field, code=CONTEXT_LENGTH_EXCEEDED)
    return plan


# ---------------------------------------------------------------------------------- replies


def _openai_call(call: ParsedCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


def reply_message(plan: CallPlan, text: str, finish_reason: str) -> tuple[dict, str, list[dict]]:
    """(the assistant message, finish_reason, invalid tool calls) for a finished call.

    A tool call the model wrote badly (or that ran out of tokens) is not passed off as a call: it
    is reported with the parser's reason in the `flashspec` field.
    """
    text = plan.prefix + text  # what the plan wrote for the model comes first
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if not plan.parse_tools:
        return message, finish_reason, []
    content, parsed = plan.read(text, finish_reason != "length")
    calls = [c for c in parsed if c.valid]
    invalid = [c for c in parsed if not c.valid]
    # No valid call: the whole text stays the content, so nothing the model wrote is hidden.
    message["content"] = (content or None) if calls else text if invalid else content
    if calls:
        message["tool_calls"] = [_openai_call(c) for c in calls]
        finish_reason = "tool_calls"
    return message, finish_reason, [{"name": c.name, "error": c.error} for c in invalid]


class DeltaStream:
    """Streamed text -> OpenAI `delta` objects: content as it comes, each tool call whole once
    its block closes (arguments are valid JSON only then)."""

    def __init__(self, plan: CallPlan):
        self._tools = plan.streamer()
        self.called = False
        self._calls = 0
        self._pending = plan.prefix  # what the plan wrote for the model, sent with the first delta

    def _delta(self, content: str, call: ParsedCall | None) -> dict:
        if call is None:
            return {"content": content}
        if not call.valid:  # written badly: its text stays content, never passed off as a call
            return {"content": call.raw}
        self.called = True
        self._calls += 1
        return {"tool_calls": [_openai_call(call, self._calls - 1)]}

    def feed(self, text: str, finish_reason: str | None) -> Iterator[dict]:
        text, self._pending = self._pending + text, ""
        if self._tools is None:
            if text:
                yield {"content": text}
            return
        pieces = list(self._tools.feed(text))
        if finish_reason is not None:
            pieces += list(self._tools.finish(finish_reason != "length"))
        for content, call in pieces:
            if content or call:
                yield self._delta(content, call)

    def finish_reason(self, engine_reason: str) -> str:
        return "tool_calls" if self.called else engine_reason


def call_info(plan: CallPlan, stats: GenerationStats | None, rows: int) -> dict[str, Any]:
    """The `flashspec` response field: the call's domain and why, the arms its steps used, the
    acceptance, the mean number of rows its steps decoded together (`batch_rows`; without
    stats, `rows`: the engine's running batch when it ended)."""
    info = stats.as_dict() if stats is not None else {"domain": plan.domain}
    info["arms"] = dict(Counter(info.get("arms", ())))
    batch_rows = round(stats.mean_rows, 2) if stats is not None and stats.steps else rows
    info.update(domain_source=plan.decision.source, agent_node=plan.decision.node, batch_rows=batch_rows)
    return info
