"""What one request may ask of a replica, checked before any heavy work.

Every limit has a default an exposed server can live with, a `flashspec-agents serve` flag (made
from the fields below) and a Serve config field (`limits:` under `args`). Past one, a request is a
400 naming the field and the limit (413 for the body), before the chat template, the tokenizer or
the grammar compiler run. Bounded: the body's size and arrival time (`guards.BodyLimits`); counts
of messages, tools and stop strings; each JSON schema's compact size and nesting depth (measured
without recursion); the prompt's raw characters before tokenizing (its tokens exactly, after);
`max_tokens`; the router domains a client may name. The flags and why: docs/serve.md.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flashspec_integrations import domain_rules
from flashspec_integrations.serve.protocol import APIError, ChatCompletionRequest

# No Ray, Starlette nor torch here: the CLI builds its flags from `Limits` on every start.


def builtin_domains() -> frozenset[str]:
    """The labels the engine's classifier and the adapters' rules give (operators add `domains`)."""
    from flashspec_core.routing import domains as core  # imports torch: only when a request is checked

    return frozenset({core.CHAT, core.CODE, core.TOOL, core.JSON, core.RAG, core.MATH,
                      domain_rules.REACT, domain_rules.TOOL_RESULT})


class Limits(BaseModel):
    """The limits of one replica (the `limits` setting; each field is also a CLI flag)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(4 << 20, gt=0, description="request body size in bytes (413 past it)")
    body_timeout_s: float = Field(20.0, gt=0, description="seconds a request's body may take to arrive "
                                  "once its headers are in (408 past it)")
    max_messages: int = Field(1024, gt=0, description="messages in one request")
    max_tools: int = Field(128, gt=0, description="tools in one request")
    max_stop: int = Field(16, gt=0, description="stop strings in one request")
    max_stop_chars: int = Field(256, gt=0, description="characters in one stop string")
    max_schema_bytes: int = Field(16 << 10, gt=0, description="a JSON schema's size as compact JSON "
                                                             "(response_format, each tool's parameters)")
    max_schema_depth: int = Field(32, gt=0, description="nesting levels of a JSON schema document")
    max_prompt_tokens: int | None = Field(None, gt=0, description="prompt tokens (default: the model's "
                                                                  "context window)")
    prompt_chars_per_token: int = Field(16, gt=0, description="a prompt of more characters than "
                                        "max_prompt_tokens times this is refused before tokenizing")
    max_tokens: int = Field(4096, gt=0, description="new tokens one request may ask for (max_tokens)")
    domains: list[str] = Field(default_factory=list, description="router domains clients may name besides "
                               "the built-in chat, code, tool, tool/result, json, rag, react, math")
    compile_timeout_s: float = Field(5.0, gt=0, description="seconds a request's JSON schema (response_format "
                                     "or tools) may take to compile; past it the compile is killed")
    planning_timeout_s: float = Field(10.0, gt=0, description="seconds a request may take to prepare "
                                      "(template, tokenizer, schema) before decoding")
    max_compiles_per_client: int = Field(1, gt=0, description="requests of one client (its address) whose "
                                         "schema is prepared at once on a replica; more wait their turn, a 429 "
                                         "past planning_timeout_s")
    grammar_cache_mb: int = Field(256, gt=0, description="MiB of compiled grammars each replica keeps")

    def known_domains(self) -> frozenset[str]:
        return builtin_domains() | {d.strip().lower() for d in self.domains}

    def prompt_tokens(self, context_window: int) -> int:
        """The prompt-token limit: `max_prompt_tokens`, at most the context window less one."""
        window = max(1, context_window - 1)
        return window if self.max_prompt_tokens is None else min(self.max_prompt_tokens, window)


def schema_depth(schema: Any) -> int:
    """Nesting levels of containers in a JSON document (a scalar is 0), without recursion."""
    deepest, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return deepest


def _check_schema(schema: Any, field: str, limits: Limits) -> int:
    """The schema's size as compact JSON, once its depth and size are within the limits."""
    depth = schema_depth(schema)
    if depth > limits.max_schema_depth:
        raise APIError(400, f"{field}: the schema nests {depth} levels deep; this server takes at most "
                            f"{limits.max_schema_depth} (--max-schema-depth)", field)
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.max_schema_bytes:
        raise APIError(400, f"{field}: the schema is {size} bytes as compact JSON; this server takes at "
                            f"most {limits.max_schema_bytes} (--max-schema-bytes)", field)
    return size


def _count(items: Any, limit: int, field: str, flag: str) -> None:
    if items is not None and len(items) > limit:
        raise APIError(400, f"{field}: {len(items)} given; this server takes at most {limit} ({flag})", field)


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
    return 0


def _check_domain(value: Any, field: str, known: frozenset[str]) -> None:
    if not isinstance(value, str):
        return  # not a label at all: the domain rules name it (`domain_rules._label`)
    label = value.strip().lower()
    if label and label not in known:
        raise APIError(400, f"{field}: {value[:80]!r} is not a router domain of this server; use one of "
                            f"{', '.join(sorted(known))} (the operator adds more with --domains)", field)


def check_request(req: ChatCompletionRequest, limits: Limits, context_window: int) -> None:
    """APIError(400) naming the field for the first limit `req` passes; cheap (no tokenizing)."""
    _count(req.messages, limits.max_messages, "messages", "--max-messages")
    _count(req.tools, limits.max_tools, "tools", "--max-tools")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    _count(stops, limits.max_stop, "stop", "--max-stop")
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise APIError(400, f"stop: a stop string has more than {limits.max_stop_chars} characters "
                            "(--max-stop-chars)", "stop")
    asked = req.max_new_tokens
    if asked is not None and asked > limits.max_tokens:
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise APIError(400, f"{field}: {asked} asked; this server decodes at most {limits.max_tokens} new "
                            "tokens a request (--max-tokens)", field)
    fmt = req.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        _check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema", limits)
    sizes = [_check_schema(tool.function.parameters, f"tools[{i}].function.parameters", limits)
             for i, tool in enumerate(req.tools or ()) if tool.function.parameters is not None]
    if req.tool_choice == "required" and sum(sizes) > limits.max_schema_bytes:
        raise APIError(400, f"tools: a forced call (tool_choice 'required') is decoded under one schema of every "
                            f"tool's parameters, {sum(sizes)} bytes; this server compiles at most "
                            f"{limits.max_schema_bytes} (--max-schema-bytes): name one tool instead", "tools")
    known = limits.known_domains()
    _check_domain(req.domain, "domain", known)
    _check_domain((req.metadata or {}).get(domain_rules.METADATA_DOMAIN_KEY),
                  f"metadata.{domain_rules.METADATA_DOMAIN_KEY}", known)
    tokens = limits.prompt_tokens(context_window)
    chars = sum(_text_chars(m.content) for m in req.messages)
    chars += sum(len(json.dumps(t.model_dump(exclude_none=True))) for t in req.tools or ())
    if chars > tokens * limits.prompt_chars_per_token:
        raise APIError(400, f"messages: the prompt has {chars} characters, more than {tokens} tokens can hold "
                            f"(--max-prompt-tokens {tokens} x --prompt-chars-per-token "
                            f"{limits.prompt_chars_per_token}); shorten it", "messages")
