"""A chat-completions request -> one engine call; the engine's output -> the reply.

The server decides each call the way the in-process LangChain adapter does, with the same code,
so a chain gets the same prompt, domain and tool handling whether its model runs in-process or
behind this endpoint:

- messages go through the target's chat template, tools through the Hermes tool prompt when the
  template has no tool support (`prompts.render_prompt`, which takes OpenAI-form messages);
- the router domain comes from `flashspec_integrations.context.decide_domain`: the `domain` field,
  then `metadata["flashspec_domain"]`, then tools / a tool result / a schema / the prompt;
- tools are decoded under a grammar by the engine (`json_schema=`, grammar-masked decoding of the
  target), as the adapters decode them (`tool_choice.reply_constraint`): a call forced to one tool
  under its JSON schema; with `tool_choice` absent or "auto" (or "required" among several tools)
  under the structural tag of calls in the template's format, so the reply is free text until the
  model opens a call, and every call it opens is valid (`parallel_tool_calls: false` allows one);
  a `response_format` schema likewise. The grammar is compiled here first, in a worker process
  killed past the server's compile limit (the same limit whatever the tool choice), so one that
  does not compile, or not in time, is a 400 before any decoding; the engine decodes under the
  grammar compiled here and compiles nothing itself;
- tool calls are parsed back from the output, in full or as stream deltas (`tool_calls`).

The adapters' shared helpers are imported here and nowhere else in this package.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from pydantic import ValidationError

from flashspec_core.constrained import Grammar, as_grammar
from flashspec_core.constrained.compile_process import CompileBusy
from flashspec_core.models import vocab_size
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.results import GenerationStats
from flashspec_core.routing.domains import resolve_domain
from flashspec_integrations.context import DomainDecision, StepContext, decide_domain
from flashspec_integrations.prompts import json_instruction, render_prompt, template_supports_tools
from flashspec_integrations.serve.protocol import CONTEXT_LENGTH_EXCEEDED, APIError, ChatCompletionRequest
from flashspec_integrations.tool_calls import (
    ParsedCall,
    ToolCallStreamer,
    parse_tool_calls,
)
from flashspec_integrations.tool_choice import (
    ToolChoice,
    normalize_tool_choice,
    reply_constraint,
)

# OpenAI's defaults where a request leaves a sampling field out.
OPENAI_TEMPERATURE, OPENAI_TOP_P = 1.0, 1.0


@dataclass(frozen=True)
class Plan:
    """One request as the engine takes it. prompt_ids: the rendered prompt's token ids."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    domain: str
    decision: DomainDecision
    json_schema: dict | None
    tool_names: tuple[str, ...]
    parse_tools: bool
    tool_parameters: dict = field(default_factory=dict)  # each tool's parameters schema, by name
    grammar: Grammar | None = None  # json_schema compiled: what the engine decodes under


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


def _output_schema(engine: Any, req: ChatCompletionRequest, tools: list[dict],
                   choice: ToolChoice) -> tuple[dict | None, str | None]:
    """What the reply is decoded under (a tool call's schema, the calls' structural tag or the
    response format's schema) and the field it came from, or (None, None)."""
    fmt = req.response_format
    if tools and (choice.forced or fmt is None or fmt.type == "text"):
        native = engine.tokenizer.chat_template if template_supports_tools(engine.tokenizer) else None
        try:
            return reply_constraint(tools, choice, native, req.parallel_tool_calls is not False), "tools"
        except ValueError as exc:
            raise APIError(400, str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools") from None
    if fmt is None or fmt.type == "text":
        return None, None
    if fmt.type == "json_object":
        return {"type": "object"}, "response_format"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema: required for type 'json_schema'",
                       "response_format.json_schema.schema")
    return fmt.json_schema.schema_, "response_format"


def _compile(engine: Any, schema: dict, field: str, timeout_s: float | None, retry_after: int) -> Grammar:
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


def plan_call(engine: Any, req: ChatCompletionRequest, default_max_tokens: int,
              max_prompt_tokens: int | None = None, compile_timeout_s: float | None = None,
              retry_after: int = 1) -> Plan:
    """The engine call for `req`; APIError(400) naming the field for anything it cannot serve.

    max_prompt_tokens: the server's prompt limit (None: the context window only).
    compile_timeout_s: the longest a schema may take to compile (None: as long as it takes, on
    the calling thread). retry_after: the seconds a 503 tells the client to wait (`admission`).
    """
    sampling = _sampling(req)
    messages = _messages(req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    if req.tool_choice is not None and not tools:
        raise APIError(400, "tool_choice: only allowed when tools are given", "tool_choice")
    try:
        choice = normalize_tool_choice(
            req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump(), tools) if tools else ToolChoice()
    except ValueError as exc:
        raise APIError(400, str(exc), "tool_choice") from None
    shown = [] if choice.none else tools
    schema, schema_field = _output_schema(engine, req, shown, choice)
    text_of = "\n".join(m["content"] for m in messages)
    try:
        decision = decide_domain(StepContext(
            explicit_domain=req.domain, metadata=req.metadata or {}, tools_bound=bool(shown),
            tool_choice_forced=choice.forced, structured_output=req.response_format is not None
            and req.response_format.type != "text", roles=[m["role"] for m in messages], prompt_text=text_of,
        ))
    except ValueError as exc:
        raise APIError(400, str(exc), "domain" if req.domain else "metadata") from None
    extra = json_instruction(schema) if schema_field == "response_format" else ""
    try:
        text = render_prompt(engine.tokenizer, messages, shown, extra)
    except (ValueError, TypeError, TemplateError) as exc:  # the template's checks (roles must alternate, ...)
        raise APIError(400, f"messages: the chat template refused them: {exc}"[:1000], "messages") from None
    grammar = None if schema is None else _compile(engine, schema, str(schema_field), compile_timeout_s, retry_after)
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    room = engine.context_window - len(ids)
    if room <= 0:
        raise APIError(400, f"messages: the prompt has {len(ids)} tokens, more than the model's context "
                            f"window of {engine.context_window}; shorten it", "messages", code=CONTEXT_LENGTH_EXCEEDED)
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise APIError(400, f"messages: the prompt has {len(ids)} tokens; this server takes at most "
                            f"{max_prompt_tokens} (--max-prompt-tokens); shorten it", "messages")
    max_new = req.max_new_tokens or min(default_max_tokens, room)
    if max_new > room:
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise APIError(400, f"{field}: the prompt has {len(ids)} tokens, so at most {room} new tokens fit "
                            f"the context window of {engine.context_window}; lower {field} or shorten the "
                            "prompt", field, code=CONTEXT_LENGTH_EXCEEDED)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    domain = resolve_domain(decision.domain, decision.hint, text)
    names = tuple(t["function"]["name"] for t in shown)
    parameters = {t["function"]["name"]: t["function"].get("parameters") for t in shown}
    return Plan(ids, max_new, sampling, stop, domain, decision, schema, names, bool(shown), parameters, grammar)


# ---------------------------------------------------------------------------------- replies


def _openai_call(call: ParsedCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


def reply_message(plan: Plan, text: str, finish_reason: str) -> tuple[dict, str, list[dict]]:
    """(the assistant message, finish_reason, invalid tool calls) for a finished call.

    A tool call the model wrote badly (or that ran out of tokens) is not passed off as a call: it
    is reported with the parser's reason in the `flashspec` field.
    """
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if not plan.parse_tools:
        return message, finish_reason, []
    content, parsed = parse_tool_calls(text, plan.tool_parameters or list(plan.tool_names), finish_reason != "length")
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

    def __init__(self, plan: Plan):
        self._tools = ToolCallStreamer(plan.tool_parameters or list(plan.tool_names)) if plan.parse_tools else None
        self.called = False
        self._calls = 0

    def _delta(self, content: str, call: ParsedCall | None) -> dict:
        if call is None:
            return {"content": content}
        if not call.valid:  # written badly: its text stays content, never passed off as a call
            return {"content": call.raw}
        self.called = True
        self._calls += 1
        return {"tool_calls": [_openai_call(call, self._calls - 1)]}

    def feed(self, text: str, finish_reason: str | None) -> Iterator[dict]:
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


def call_info(plan: Plan, stats: GenerationStats | None, rows: int) -> dict[str, Any]:
    """The `flashspec` response field: the call's domain and why, the arms its steps used, the
    acceptance, and how many rows the engine's running batch held when it ended."""
    info = stats.as_dict() if stats is not None else {"domain": plan.domain}
    info["arms"] = dict(Counter(info.get("arms", ())))
    info.update(domain_source=plan.decision.source, agent_node=plan.decision.node, batch_rows=rows)
    return info
