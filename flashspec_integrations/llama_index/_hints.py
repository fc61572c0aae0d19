"""LlamaIndex's run context of one call -> `flashspec_integrations.domain_rules.StepContext` -> domain.

The rules live in the shared `domain_rules.decide_domain`; this module only reads LlamaIndex's
objects: the messages, the tools and tool choice of the call, the active instrumentation tags
(`flashspec_domain` or `domain`), and the prompt template the call was formatted from. Response
synthesis (text_qa, refine, summary) is recognised from the template object itself, by its
`prompt_type` metadata or by the variables a synthesis template must have, so custom templates
count too; `FlashSpecLLM.predict` and friends hold that verdict in a context variable for the call,
and the shared text rules still catch default templates that reach `chat`/`complete` formatted.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from llama_index.core.instrumentation.dispatcher import active_instrument_tags

from flashspec_integrations.domain_rules import (
    METADATA_DOMAIN_KEY,
    RAG,
    DomainDecision,
    StepContext,
    decide_domain,
)

# Instrumentation tag keys that name the domain of every LLM call made under them, first wins.
DOMAIN_TAGS = (METADATA_DOMAIN_KEY, "domain")

_SYNTHESIS_TYPES = {"text_qa", "refine", "summary", "tree_summarize"}
_SYNTHESIS_VARS = ({"context_str", "query_str"}, {"context_msg", "existing_answer"})

_template_domain: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "flashspec_llama_index_template_domain", default=None
)


def template_domain(prompt: Any) -> str | None:
    """`rag` for a response-synthesis template (by metadata or by its variables), else None."""
    metadata = getattr(prompt, "metadata", None) or {}
    prompt_type = metadata.get("prompt_type")
    if getattr(prompt_type, "value", prompt_type) in _SYNTHESIS_TYPES:
        return RAG
    variables = set(getattr(prompt, "template_vars", None) or ())
    if any(required <= variables for required in _SYNTHESIS_VARS):
        return RAG
    return None


@contextlib.contextmanager
def template_scope(prompt: Any) -> Iterator[None]:
    """Mark the LLM calls made inside as formatted from `prompt` (a LlamaIndex prompt template)."""
    token = _template_domain.set(template_domain(prompt))
    try:
        yield
    finally:
        _template_domain.reset(token)


def tag_metadata() -> dict[str, Any]:
    """The active instrumentation tags, with a `domain` tag read as `flashspec_domain`."""
    tags = dict(active_instrument_tags.get() or {})
    if METADATA_DOMAIN_KEY not in tags:
        for key in DOMAIN_TAGS[1:]:
            if isinstance(tags.get(key), str):
                tags[METADATA_DOMAIN_KEY] = tags[key]
                break
    return tags


def _decide(ctx: StepContext, default_domain: str | None, per_node: bool) -> DomainDecision:
    if ctx.explicit_domain is None and METADATA_DOMAIN_KEY not in ctx.metadata and default_domain:
        ctx = StepContext(**{**ctx.__dict__, "explicit_domain": default_domain})
    decision = decide_domain(ctx, domain_per_node=per_node)
    if decision.source == "classifier" and _template_domain.get() is not None:
        return DomainDecision(None, _template_domain.get(), "template", decision.node)
    return decision


def chat_decision(facts: StepContext, explicit: str | None, default_domain: str | None,
                  per_node: bool = False) -> DomainDecision:
    """Domain and hint of a chat call (`facts`: what the call plan knows of it)."""
    ctx = dataclasses.replace(facts, explicit_domain=explicit, metadata=tag_metadata())
    return _decide(ctx, default_domain, per_node)


def completion_decision(
    prompt: str, explicit: str | None, default_domain: str | None, per_node: bool = False
) -> DomainDecision:
    """Domain and hint of a completion call."""
    ctx = StepContext(explicit_domain=explicit, metadata=tag_metadata(), prompt_text=prompt)
    return _decide(ctx, default_domain, per_node)
