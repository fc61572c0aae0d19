"""Function-calling steps: OpenAI tool schemas in the system prompt, calls, and tool results.

An agent's tool step sends the same system prompt (instructions plus every tool's JSON schema)
each time, then the request and the calls and results so far; the model answers with the next
call, or in prose once it has what it needs. The schemas, requests, calls and results are
hand-written in `data/agent_tools.json` after the GitHub, Stripe, Slack, Google Calendar and SQL
APIs (nested objects, enums, arrays, formats); knowledge-base results carry real ShareGPT
passages. Two renderings of the tool list: the Hermes-2-Pro prompt (`<tools>` and
`<tool_call>` tags) and one JSON schema per line.
"""
from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from flashspec_workloads.passages import Holdout, Passage, Question

DATA_FILE = Path(__file__).with_name("data") / "agent_tools.json"
FORMATS = ("hermes", "json_lines")
DISTRACTOR_TOOLS = 4
SNIPPET_CHARS = 400


@functools.lru_cache(maxsize=1)
def tool_data() -> dict[str, Any]:
    """The tool schemas, system prompts and episodes of `data/agent_tools.json`."""
    with open(DATA_FILE, encoding="utf-8") as f:
        return json.load(f)


def episodes(split: Holdout) -> list[dict[str, Any]]:
    """The episodes of one side of the split, in file order."""
    if split not in ("tune", "heldout"):
        raise ValueError(f"split must be 'tune' or 'heldout', got {split!r}")
    return [e for e in tool_data()["episodes"] if e["split"] == split]


def needs_passage(episode: dict[str, Any]) -> bool:
    """Whether the episode's calls or results are filled with a passage and a question."""
    return "{passage}" in json.dumps(episode["calls"]) or "{question}" in json.dumps(episode["calls"])


def system_prompt(names: list[str], fmt: str) -> str:
    """The system prompt listing the named tools in the given rendering."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    by_name = {t["function"]["name"]: t for t in tool_data()["tools"]}
    if fmt == "hermes":
        listed = " ".join(json.dumps(by_name[n], ensure_ascii=False) for n in names)
    else:
        listed = "\n".join(json.dumps(by_name[n], ensure_ascii=False) for n in names)
    return tool_data()["system_prompts"][fmt].format(tools=listed)


def _call_text(call: dict[str, Any], fmt: str) -> str:
    body = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>" if fmt == "hermes" else body


def _fill(value: Any, fills: dict[str, str]) -> Any:
    """`value` with every '{key}' placeholder in its strings replaced (JSON structure kept)."""
    if isinstance(value, str):
        for key, text in fills.items():
            value = value.replace("{" + key + "}", text)
        return value
    if isinstance(value, list):
        return [_fill(v, fills) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, fills) for k, v in value.items()}
    return value


def episode_messages(episode: dict[str, Any], fmt: str, rng: random.Random,
                     document: tuple[list[Passage], Question] | None = None) -> list[list[dict[str, str]]]:
    """The prompt of every step of one episode: step k holds the first k calls and results.

    The tool list is the episode's tools plus DISTRACTOR_TOOLS others, shuffled; `document`
    (the chunks and a question about them) fills a knowledge-base episode. The last prompt ends
    with the last tool result, where the model answers in prose.
    """
    if needs_passage(episode) and document is None:
        raise ValueError(f"document: episode {episode['id']!r} needs passages and a question")
    fills: dict[str, str] = {}
    request = episode["request"]
    if document is not None:
        chunks, question = document
        text = "\n\n".join(c.text for c in chunks)
        fills = {"passage": text, "question": question.question,
                 "doc": hashlib.sha256(chunks[0].id.encode()).hexdigest()[:8]}
        request = f"{request}\n\n{question.question}"
    calls = _fill(episode["calls"], fills)
    for call in calls:  # a search result shows a snippet, not the whole document
        for hit in call["result"].get("results", []) if isinstance(call["result"], dict) else []:
            hit["snippet"] = hit["snippet"][:SNIPPET_CHARS]
    needed = list(dict.fromkeys(c["name"] for c in calls))
    others = [t["function"]["name"] for t in tool_data()["tools"] if t["function"]["name"] not in needed]
    names = needed + rng.sample(others, DISTRACTOR_TOOLS)
    rng.shuffle(names)
    messages = [{"role": "system", "content": system_prompt(names, fmt)},
                {"role": "user", "content": request}]
    prompts = [list(messages)]
    for call in calls:
        messages += [{"role": "assistant", "content": _call_text(call, fmt)},
                     {"role": "tool", "content": json.dumps(call["result"], ensure_ascii=False)}]
        prompts.append(list(messages))
    return prompts
