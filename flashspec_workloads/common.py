"""What every stream of this package shares: the Step, the domains, their budgets, the mixing."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

DOMAINS: tuple[str, ...] = ("chat", "code", "tool", "rag")
# Budgets per domain: a tool call is a short JSON object, a chat or code answer runs long.
DEFAULT_MAX_NEW_TOKENS: dict[str, int] = {"chat": 128, "code": 128, "tool": 64, "rag": 96}


@dataclass(frozen=True)
class Step:
    """One generation request of the stream: what an agent framework would send the model."""

    domain: str
    messages: list[dict[str, str]]
    max_new_tokens: int
    source: str


def check_stream_args(n_steps: int, max_new_tokens: int | None) -> None:
    """ValueError naming the argument for a stream length or token budget that cannot work."""
    if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps <= 0:
        raise ValueError(f"n_steps must be a positive int, got {n_steps!r}")
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens <= 0):
        raise ValueError(f"max_new_tokens must be a positive int or None, got {max_new_tokens!r}")


def unused(keys: list[str], used: set[str], k: int, rng: random.Random) -> list[str]:
    """`k` keys drawn without replacement, preferring ones this stream has not used yet.

    Repeating a prompt inside one stream would flatter caches across requests, so repeats
    happen only once every key is used.
    """
    fresh = [key for key in keys if key not in used]
    picks = rng.sample(fresh, min(k, len(fresh)))
    picks += rng.sample([key for key in keys if key not in picks], k - len(picks))
    used.update(picks)
    return picks


def domain_order(n_runs: int, rng: random.Random) -> list[str]:
    """Domains for each run: shuffled rounds of all four, never the same domain twice in a row."""
    order: list[str] = []
    while len(order) < n_runs:
        round_ = list(DOMAINS)
        rng.shuffle(round_)
        if order and round_[0] == order[-1]:
            round_.append(round_.pop(0))
        order.extend(round_)
    return order[:n_runs]


def openai_messages(messages: list[dict[str, str]]) -> list[dict]:
    """The workload's chat messages as an OpenAI client sends them: an assistant turn that is a
    JSON call becomes `tool_calls`, and the tool result after it names that call's id."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        call = None
        if m["role"] == "assistant":
            try:
                call = json.loads(m["content"])
            except json.JSONDecodeError:
                pass
        if isinstance(call, dict) and "name" in call:
            out.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{i}", "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}}]})
        elif m["role"] == "tool":
            out.append({"role": "tool", "tool_call_id": out[-1]["tool_calls"][0]["id"], "content": m["content"]})
        else:
            out.append(m)
    return out
