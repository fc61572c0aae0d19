"""The framework run context of one model call -> the domain the router should file it under.

Shared by both adapters, so it knows neither framework: each reads its own objects (bound tools,
messages, run metadata, tags) into a plain `StepContext`, and `decide_domain` turns it into the
`domain` or `hint` of the engine's `RequestOptions`. First match wins: an explicit domain
(`explicit_domain`, run metadata key `flashspec_domain`, a `flashspec_domain:<label>` tag); `json`
for a forced call or structured output; `tool/result` right after a tool result, `tool` with tools
bound or a tool result in the history; `react`; `rag`; else no hint (the engine's classifier). The
agent node (`DomainDecision.node`) is a sub-key only with `domain_per_node=True`. docs/adapters.md.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

JSON, TOOL, TOOL_RESULT, REACT, RAG = "json", "tool", "tool/result", "react", "rag"

METADATA_DOMAIN_KEY = "flashspec_domain"
TAG_DOMAIN_PREFIX = "flashspec_domain:"
# Run-metadata keys naming the agent step, most specific first.
NODE_KEYS = ("lc_agent_name", "langgraph_node", "agent_name")

# Roles as `normalize_role` returns them.
SYSTEM, USER, ASSISTANT, TOOL_ROLE = "system", "user", "assistant", "tool"
_ROLE_ALIASES = {
    "system": SYSTEM, "developer": SYSTEM,
    "user": USER, "human": USER,
    "assistant": ASSISTANT, "ai": ASSISTANT, "model": ASSISTANT, "chatbot": ASSISTANT,
    "tool": TOOL_ROLE, "function": TOOL_ROLE, "ipython": TOOL_ROLE,
}

# Stock retrieval-synthesis wordings (LangChain hub rag-prompt, LlamaIndex text_qa / refine /
# tree_summarize, common RAG tutorials). Lower-case substrings: cheap and precise.
_RAG_PHRASES = (
    "pieces of retrieved context",
    "retrieved context",
    "context information is below",
    "given the context information",
    "refine the existing answer",
    "we have provided an existing answer",
    "context information from multiple sources",
    "answer the question based only on the following context",
    "based only on the following context",
    "using the context below",
    "using only the context",
    "answer using the documents",
)
# A "Context:" (or "Documents:", "Sources:") heading and a "Question:" heading in the same prompt,
# and the ReAct labels, each at the start of a line (after spaces). Searched in the lower-cased
# text from the label on (`_line_start_matches`), in linear time: a leading `(?:^|\n)\s*` would let
# `\s*` run across newlines, n newlines costing n tries of up to n characters each (BENCHMARKS.md).
_CONTEXT_HEADING = re.compile(r"(?:context|documents?|sources?|retrieved documents)[^\S\n]*:")
_QUESTION_HEADING = re.compile(r"(?:question|query)[^\S\n]*:")
_REACT_LINES = re.compile(r"(thought|action input|action|observation)[^\S\n]*:")


def _line_start_matches(pattern: re.Pattern[str], low: str) -> Iterator[re.Match[str]]:
    """The matches of `pattern` in `low` with nothing but spaces before them on their line.

    Each pattern starts with a literal word, so `re` skips to candidates at C speed; whether a
    candidate starts its line is read from the text between it and the previous candidate only
    (a candidate after another on the same line never does), so the whole scan is linear.
    """
    previous_end = 0
    for match in pattern.finditer(low):
        start = match.start()
        newline = low.rfind("\n", previous_end, start)
        if newline >= 0 or previous_end == 0:
            before = low[newline + 1:start]
            if not before or before.isspace():
                yield match
        previous_end = match.end()


def normalize_role(role: Any) -> str:
    """A framework's role name as one of system / user / assistant / tool (others pass lower-cased)."""
    name = str(getattr(role, "value", role)).strip().lower()
    return _ROLE_ALIASES.get(name, name)


def is_rag_prompt(text: str) -> bool:
    """True for a retrieval-synthesis prompt: a stock QA/refine template, or context + question."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    low = text.lower()
    if any(p in low for p in _RAG_PHRASES):
        return True
    return (next(_line_start_matches(_CONTEXT_HEADING, low), None) is not None
            and next(_line_start_matches(_QUESTION_HEADING, low), None) is not None)


def is_react_prompt(text: str) -> bool:
    """True for a ReAct prompt: at least three of the Thought/Action/Action Input/Observation labels."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    labels: set[str] = set()
    for match in _line_start_matches(_REACT_LINES, text.lower()):
        labels.add(match.group(1))
        if len(labels) >= 3:
            return True
    return False


def _label(value: Any, source: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{source} must be a non-empty domain label such as 'tool' or 'rag'; got {value!r}")
    return value.strip().lower()


@dataclass(frozen=True)
class StepContext:
    """What an adapter knows about one model call, in plain data.

    roles: the role of every message in order (any spelling; see `normalize_role`); empty for a
    plain text prompt. prompt_text: the prompt's text (messages joined), for the prompt checks.
    metadata: the run's metadata (LangChain config metadata, LlamaIndex instrument tags as a dict).
    """

    explicit_domain: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    tags: Sequence[str] = ()
    tools_bound: bool = False
    tool_choice_forced: bool = False
    structured_output: bool = False
    roles: Sequence[str] = ()
    prompt_text: str = ""


@dataclass(frozen=True)
class DomainDecision:
    """The engine arguments for one call, and why.

    domain: pass as `generate(domain=...)` (an explicit choice, overriding everything).
    hint: pass as `generate(hint=...)` (the engine's classifier runs only when both are None).
    source: which rule decided ("explicit", "metadata", "tag", "forced_tool", "structured_output",
    "tool_result", "tools", "react", "rag" or "classifier").
    node: the agent node or agent name of the run, if any.
    """

    domain: str | None
    hint: str | None
    source: str
    node: str | None = None

    @property
    def label(self) -> str | None:
        """The label the router will see, when the adapter decided it (None: the classifier's)."""
        return self.domain or self.hint

    def as_dict(self) -> dict[str, Any]:
        return {"domain": self.domain, "hint": self.hint, "source": self.source, "node": self.node}


def agent_node(metadata: Mapping[str, Any]) -> str | None:
    """The agent step's name from run metadata: `lc_agent_name`, else `langgraph_node`, else `agent_name`."""
    for key in NODE_KEYS:
        value = metadata.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _kind(ctx: StepContext) -> tuple[str | None, str]:
    roles = [normalize_role(r) for r in ctx.roles]
    if ctx.tool_choice_forced:
        return JSON, "forced_tool"
    if ctx.structured_output:
        return JSON, "structured_output"
    if roles and roles[-1] == TOOL_ROLE:
        return TOOL_RESULT, "tool_result"
    if ctx.tools_bound or TOOL_ROLE in roles:
        return TOOL, "tools"
    if ctx.prompt_text and is_react_prompt(ctx.prompt_text):
        return REACT, "react"
    if ctx.prompt_text and is_rag_prompt(ctx.prompt_text):
        return RAG, "rag"
    return None, "classifier"


def decide_domain(ctx: StepContext, domain_per_node: bool = False) -> DomainDecision:
    """The domain or hint for one call from its context (see the module docstring for the rules)."""
    if not isinstance(ctx, StepContext):
        raise ValueError(f"ctx must be a StepContext, got {type(ctx).__name__}")
    metadata = ctx.metadata or {}
    node = agent_node(metadata)
    explicit = _label(ctx.explicit_domain, "domain")
    if explicit is not None:
        return DomainDecision(explicit, None, "explicit", node)
    from_metadata = _label(metadata.get(METADATA_DOMAIN_KEY), f"metadata[{METADATA_DOMAIN_KEY!r}]")
    if from_metadata is not None:
        return DomainDecision(from_metadata, None, "metadata", node)
    for tag in ctx.tags or ():
        if isinstance(tag, str) and tag.startswith(TAG_DOMAIN_PREFIX):
            return DomainDecision(_label(tag[len(TAG_DOMAIN_PREFIX):], f"tag {tag!r}"), None, "tag", node)
    kind, source = _kind(ctx)
    if kind is not None and domain_per_node and node:
        kind = f"{kind}/{node.lower()}"
    return DomainDecision(None, kind, source, node)
