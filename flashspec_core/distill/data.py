"""Training data for a distilled draft: ShareGPT prompts as token ids, and the files that carry them.

A draft imitates the target where it will be used: on the target's own answers to real prompts. The
prompts come from ShareGPT (the workload's train split; its dev split is held back for evaluation),
one per user turn of a conversation with the earlier turns as context, encoded exactly as the engine
encodes chat messages. Token sets are saved as compressed ragged arrays, so a machine without the
dataset (a GPU host with no network) can train from a prompts file made elsewhere.
"""
from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from transformers import PreTrainedTokenizerBase

from flashspec_core.prompts import encode_prompt

SPLITS = ("train", "dev")
DOMAINS = ("chat", "code")


class Conversation(Protocol):
    """One multi-turn conversation to draw prompts from (flashspec_workloads.sharegpt's rows)."""

    @property
    def split(self) -> str: ...  # one of SPLITS

    @property
    def domain(self) -> str: ...  # one of DOMAINS

    @property
    def messages(self) -> list[dict[str, str]]: ...  # chat messages, {"role", "content"}


@dataclass
class TokenSet:
    """Ragged token sequences with a domain, a split and a prompt length per row.

    For a prompt set `prompt_lens[i] == len(seqs[i])`; for a training set the tokens after the
    prompt are the target's continuation, the positions the draft learns to predict.
    """

    seqs: list[list[int]] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    def append(self, seq: Sequence[int], domain: str, split: str, prompt_len: int | None = None) -> None:
        self.seqs.append(list(seq))
        self.domains.append(domain)
        self.splits.append(split)
        self.prompt_lens.append(len(seq) if prompt_len is None else prompt_len)

    def select(self, domain: str | None = None, split: str | None = None) -> TokenSet:
        """Rows of one domain ('all' or None: every domain) and/or one split."""
        out = TokenSet()
        for s, d, sp, p in zip(self.seqs, self.domains, self.splits, self.prompt_lens):
            if domain not in (None, "all") and d != domain:
                continue
            if split is not None and sp != split:
                continue
            out.append(s, d, sp, p)
        return out

    def take(self, n: int) -> TokenSet:
        out = TokenSet()
        for i in range(min(n, len(self))):
            out.append(self.seqs[i], self.domains[i], self.splits[i], self.prompt_lens[i])
        return out

    def continuation_tokens(self) -> Iterable[int]:
        for s, p in zip(self.seqs, self.prompt_lens):
            yield from s[p:]

    def save(self, path: str | os.PathLike) -> Path:
        """Write a compressed .npz (atomically: a crash never leaves half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lengths = np.array([len(s) for s in self.seqs], dtype=np.int64)
        flat = np.fromiter((t for s in self.seqs for t in s), dtype=np.int32, count=int(lengths.sum()))
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez_compressed(
                f, tokens=flat, lengths=lengths, prompt_lens=np.array(self.prompt_lens, dtype=np.int64),
                domains=np.array(self.domains, dtype="<U8"), splits=np.array(self.splits, dtype="<U8"))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenSet:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"path: token file {str(path)!r} does not exist; "
                             "make one with `flashspec-agents distill --export-prompts`")
        with np.load(path, allow_pickle=False) as z:
            tokens, lengths = z["tokens"], z["lengths"]
            ends = np.cumsum(lengths)
            seqs = [tokens[e - n:e].tolist() for e, n in zip(ends, lengths)]
            return cls(seqs, z["domains"].tolist(), z["splits"].tolist(), z["prompt_lens"].tolist())


def _turn_prompts(messages: list[dict[str, str]], max_turns: int) -> list[list[dict[str, str]]]:
    """The message lists that end at each of the first `max_turns` user turns."""
    ends = [i for i, m in enumerate(messages) if m["role"] == "user"][:max_turns]
    return [messages[: i + 1] for i in ends]


def encode_within(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], vocab: int,
                  max_tokens: int) -> list[int] | None:
    """Chat-template ids of `messages`, dropping earlier turns until they fit; None if even the last
    turn alone does not."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    body = messages[len(system):]
    for start in range(0, len(body), 2):  # keep user/assistant alternation: drop whole exchanges
        ids = encode_prompt(tokenizer, system + body[start:], vocab)
        if len(ids) <= max_tokens:
            return ids
    return None


def conversation_prompts(
    conversations: Iterable[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    vocab: int,
    max_prompt_tokens: int = 384,
    turns_per_conversation: int = 3,
    max_per_cell: int | None = None,
    seed: int = 0,
) -> TokenSet:
    """Prompts from every conversation given (ShareGPT's, all parts, both splits, both domains, in the
    CLI), shuffled.

    `max_per_cell` caps each (split, domain) cell. Rows are shuffled with `seed` so that a
    time-limited generation pass still covers many conversations of both domains.
    """
    if max_prompt_tokens < 8:
        raise ValueError(f"max_prompt_tokens must be at least 8; got {max_prompt_tokens}")
    cells: dict[tuple[str, str], list[list[int]]] = {(s, d): [] for s in SPLITS for d in DOMAINS}
    for conv in conversations:
        cell = cells[(conv.split, conv.domain)]
        if max_per_cell is not None and len(cell) >= max_per_cell:
            if all(len(c) >= max_per_cell for c in cells.values()):
                break
            continue
        for messages in _turn_prompts(conv.messages, turns_per_conversation):
            ids = encode_within(tokenizer, messages, vocab, max_prompt_tokens)
            if ids is not None:
                cell.append(ids)
    rows = [(ids, d, s) for (s, d), cell in cells.items() for ids in cell]
    random.Random(seed).shuffle(rows)
    out = TokenSet()
    for ids, d, s in rows:
        out.append(ids, d, s)
    return out


def frequent_tokens(tokens: Iterable[int], size: int, always: Iterable[int] = ()) -> list[int]:
    """The `size` most frequent ids of `tokens` plus `always` (EOS, say), sorted: the draft's head subset."""
    if size < 1:
        raise ValueError(f"vocab size for the draft head must be positive; got {size}")
    counts = Counter(tokens)
    ids = {t for t, _ in counts.most_common(size)} | set(always)
    return sorted(ids)
