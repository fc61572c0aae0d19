"""One chat call planned once, for LangChain, LlamaIndex and the server alike.

`plan_chat` turns a framework-neutral `ChatRequest` (OpenAI-form messages and tools, the tool
choice, a response format, sampling, stop strings, the token budget) into a `CallPlan`: the
prompt's token ids and the engine's `RequestOptions` for it (`CallPlan.options`), plus what reading the reply
needs (`CallPlan.read`). Each front end only translates its framework's types to a `ChatRequest`
and the plan's output back; a setting added here reaches all three. Bad input raises `PlanError`,
a ValueError naming the argument it came from.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from flashspec_core.constrained import Grammar
from flashspec_core.engine_protocol import Engine
from flashspec_core.options import RequestOptions
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.domains import classify_prompt, resolve_domain
from flashspec_integrations.domain_rules import REACT, TOOL, TOOL_RESULT, DomainDecision, StepContext
from flashspec_integrations.prompts import json_instruction, render_prompt, template_supports_tools
from flashspec_integrations.tool_calls import ParsedCall, ToolCallStreamer, parse_tool_calls
from flashspec_integrations.tool_choice import (
    ToolChoice,
    forced_prefix,
    normalize_tool_choice,
    reads_untagged_calls,
    reply_constraint,
    reply_stops,
    tool_name,
)

# A ReAct step must never write the observation itself: the tool supplies it.
REACT_STOPS = ("\nObservation:",)

# The front end's domain rule: the plan's facts about the call (tools, roles, prompt text) in, the
# decision out; the front end adds what only it knows (explicit domain, run metadata and tags).
Decide = Callable[[StepContext], DomainDecision]


class PlanError(ValueError):
    """Input the plan cannot serve; `field` names the request argument it came from."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ChatRequest:
    """A chat call in plain data. messages: OpenAI-form dicts with text content; tools: OpenAI
    tool dicts. response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"schema": ...}} (None or {"type": "text"}: free text). stop: the caller's stop strings (the
    plan adds the reply's own). parallel_tool_calls: None allows several calls unless a call is
    forced (LangChain's "any" is one call), True several even then, False one. render: a custom
    prompt format (messages and shown tools -> text to tokenize with the tokenizer's special
    tokens); None is the target's chat template.
    react_prefix: written before a ReAct step's reply (None: ReAct steps are not special)."""

    messages: Sequence[Mapping[str, Any]]
    max_new_tokens: int
    sampling: SamplingParams
    tools: Sequence[Mapping[str, Any]] = ()
    tool_choice: Any = None
    tool_required: bool = False
    parallel_tool_calls: bool | None = None
    response_format: Mapping[str, Any] | None = None
    structured_output: bool = False
    stop: Sequence[str] = ()
    render: Callable[[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]], str] | None = None
    react_prefix: str | None = None


@dataclass(frozen=True)
class CallPlan:
    """One engine request and how to read its reply.

    prompt_ids: the rendered prompt with `prefix` (reply text written before generation: a
    forced call's opening, ReAct's "Thought:") appended. tools: each shown tool's parameters
    schema by name. single_call: one call at most is read from the reply.
    """

    prompt_ids: list[int]
    prompt_text: str
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    decision: DomainDecision
    json_schema: dict | None = None
    prefix: str = ""
    tools: dict[str, Any] = field(default_factory=dict)
    parse_tools: bool = False
    single_call: bool = False
    forced_name: str | None = None
    untagged: bool = True  # a JSON object naming a tool outside the call tags reads as a call
    schema_source: str | None = None  # the argument json_schema comes from: "tools" or "response_format"
    grammar: Grammar | None = None  # json_schema compiled ahead (the server does, in time): passed instead

    @property
    def hint(self) -> str | None:
        """The hint the engine gets: the front end's, else the classifier's label of this prompt."""
        if self.decision.domain is not None:
            return None
        return self.decision.hint or classify_prompt(self.prompt_text)

    @property
    def domain(self) -> str:
        """The router domain the engine files this call under."""
        return resolve_domain(self.decision.domain, self.decision.hint, self.prompt_text)

    def options(self, timeout: float | None = None) -> RequestOptions:
        """The engine's request options for this call, ending it after `timeout` seconds (None: never)."""
        schema = self.json_schema if self.grammar is None or self.json_schema is None else self.grammar
        return RequestOptions(self.max_new_tokens, self.sampling, self.stop, self.decision.domain, self.hint, schema,
                              timeout)

    def read(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        """(content, tool calls) of a reply's text (prefix included); `finished`: not cut by the budget."""
        if not self.parse_tools:
            return text, []
        content, calls = parse_tool_calls(text, self.tools, finished, self.untagged)
        return content, calls[:1] if self.single_call else calls

    def streamer(self) -> ToolCallStreamer | None:
        """The reader of this call's streamed reply (None when no tools are read from it)."""
        return ToolCallStreamer(self.tools, self.untagged) if self.parse_tools else None

    def replace(self, **changes: Any) -> CallPlan:
        return dataclasses.replace(self, **changes)


def _response_schema(fmt: Mapping[str, Any] | None) -> dict | None:
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") if fmt is not None else None
        if schema is None:
            raise PlanError("response_format.json_schema.schema: required for type 'json_schema'",
                            "response_format.json_schema.schema")
        return dict(schema)
    raise PlanError("response_format must be {'type': 'json_object'} or "
                    f"{{'type': 'json_schema', 'json_schema': {{'schema': ...}}}}; got {fmt!r}", "response_format")


def plan_chat(engine: Engine, req: ChatRequest, decide: Decide) -> CallPlan:
    """The engine call for chat request `req`; PlanError naming the argument for bad input.

    The reply is decoded under a grammar where the engine takes one (`engine.constrains`): a
    forced call's schema or the calls' structural tag (`tool_choice.reply_constraint`) when tools
    are shown and no response format overrides them, else the response format's schema, which the
    prompt then asks for too. An engine without grammars gets a forced call's opening written
    for it in the Hermes format instead.
    """
    tokenizer = engine.tokenizer
    tools = [dict(t) for t in req.tools]
    try:
        choice = normalize_tool_choice(req.tool_choice, tools, req.tool_required) if tools else ToolChoice()
    except ValueError as exc:
        raise PlanError(str(exc), "tool_choice") from None
    shown = [] if choice.none else tools
    fmt_schema = _response_schema(req.response_format)
    hermes = bool(shown) and (req.render is not None or not template_supports_tools(tokenizer))
    parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else not choice.forced
    single = not parallel or choice.name is not None
    constrained = engine.constrains
    tools_win = bool(shown) and (choice.forced or fmt_schema is None)
    schema = None if tools_win else fmt_schema
    native = None if hermes else getattr(tokenizer, "chat_template", None)
    untagged = True
    if tools_win and constrained:
        try:
            schema = reply_constraint(shown, choice, native, not single)
            untagged = reads_untagged_calls(choice, native, constrained)
        except ValueError as exc:
            raise PlanError(str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools") from None
    dicts = [dict(m) for m in req.messages]
    decision = decide(StepContext(
        tools_bound=bool(shown), tool_choice_forced=choice.forced,
        structured_output=req.structured_output or fmt_schema is not None,
        roles=[d["role"] for d in dicts], prompt_text="\n".join(d["content"] for d in dicts),
    ))
    # A tool step (tools shown, or a tool's result answered) never writes a tool's result itself.
    tool_step = bool(shown) or decision.label in (TOOL, TOOL_RESULT)
    stops = [*req.stop, *reply_stops(tool_step, single and bool(shown), hermes, constrained and schema is not None)]
    prefix = ""
    if decision.label == REACT and req.react_prefix is not None:
        stops += REACT_STOPS
        prefix = req.react_prefix
    if choice.forced:
        prefix = forced_prefix(choice, constrained) if hermes else ""
    try:
        if req.render is not None:
            text = req.render(dicts, shown)
        else:
            text = render_prompt(tokenizer, dicts, shown, json_instruction(fmt_schema) if fmt_schema and not tools_win
                                 else "")
    except (ValueError, TypeError, TemplateError) as exc:  # the template's own checks (roles must alternate, ...)
        raise PlanError(f"messages: the chat template refused them: {exc}"[:1000], "messages") from None
    ids = tokenizer(text + prefix, add_special_tokens=req.render is not None).input_ids
    return CallPlan(
        list(ids), text, req.max_new_tokens, req.sampling, tuple(dict.fromkeys(stops)), decision,
        schema if constrained else None, prefix, {tool_name(t): t["function"].get("parameters") for t in shown},
        bool(shown), single, choice.name if choice.forced else None,
        untagged, None if schema is None else "tools" if tools_win else "response_format",
    )


def plan_text(engine: Engine, text: str, max_new_tokens: int, sampling: SamplingParams, stop: Sequence[str],
              decision: DomainDecision, templated: bool = False) -> CallPlan:
    """The engine call for a text prompt (a completion); `templated`: `text` is a rendered chat
    template, which holds its special tokens already."""
    ids = engine.tokenizer(text, add_special_tokens=not templated).input_ids
    return CallPlan(list(ids), text, max_new_tokens, sampling, tuple(dict.fromkeys(stop)), decision)
