"""Real long text for retrieval steps, and questions whose answers copy from it.

Every user turn of 1,500+ characters of English prose (no code) in ShareGPT's dev split is one
passage; passages are split again into 'tune' and 'heldout' halves (`holdout_of`), so what a router
or classifier was tuned on never scores it. A question picks one sentence of one passage and asks
for it in a way that keeps the answer a copy: by a distinctive key in it (a name or a number that
occurs once in the whole context) or by its opening words. Standard library only. Why this text:
docs/workloads.md.
"""
from __future__ import annotations

import functools
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from flashspec_workloads.sharegpt import _ROLES, _is_englishish, classify, iter_json_array, sharegpt_path, split_of

Holdout = Literal["tune", "heldout"]
MIN_PASSAGE_CHARS = 1500
# A context of at least this many characters is 1k+ tokens for SmolLM2's tokenizer on English
# prose (about 4.3 characters a token); benchmarks/agent_workload_lengths.py reports the counts.
MIN_CONTEXT_CHARS = 5000
MAX_CONTEXT_CHARS = 7500

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“(])")
_NAME = re.compile(r"(?<=[a-z,;:] )([A-Z][a-zA-Z]{3,}(?: (?:of |the |and |de )?[A-Z][a-z]+)*)")
_NUMBER = re.compile(r"(?<![\w.])(\d[\d,.]*\d%?|\d{2,}%?)(?![\w])")
# Sentences that speak to the assistant rather than inform ("please summarise ...") are not
# something a document answers.
_INSTRUCTION = re.compile(r"\b(you|your|please|i want|i need|act as|write|summari[sz]e|rewrite)\b",
                          re.IGNORECASE)


@dataclass(frozen=True)
class Passage:
    """One user-pasted text from a ShareGPT dev conversation."""

    id: str  # "<conversation id>#<turn index>"
    text: str


@dataclass(frozen=True)
class Question:
    """A question over a context; `answer_quote` is the sentence (verbatim) that answers it."""

    question: str
    answer_quote: str
    passage_id: str


def holdout_of(key: str) -> Holdout:
    """'tune' or 'heldout', half each, from a hash of the key's conversation stem.

    Every workload in this package splits by this one function, so a prompt used to tune a
    router, the calibration or the domain classifier is never in the held-out stream.
    """
    stem = key.split("#", 1)[0]
    stem = stem.rsplit("_", 1)[0] if "_" in stem else stem
    digest = hashlib.sha256(f"holdout:{stem}".encode()).digest()
    return "tune" if digest[0] % 2 == 0 else "heldout"


@functools.lru_cache(maxsize=1)
def _all_passages() -> tuple[Passage, ...]:
    passages: list[Passage] = []
    seen: set[str] = set()
    for item in iter_json_array(sharegpt_path()):
        if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
            continue
        conv_id = str(item.get("id", ""))
        if split_of(conv_id) != "dev":
            continue
        for turn_index, turn in enumerate(item["conversations"]):
            text = turn.get("value") if _ROLES.get(str(turn.get("from"))) == "user" else None
            if not isinstance(text, str) or len(text) < MIN_PASSAGE_CHARS:
                continue
            text = text.strip()
            if text.startswith("Web search results") or classify(text) != "chat":
                continue
            if not _is_englishish(text) or text[:300] in seen:  # parts repeat pasted text
                continue
            seen.add(text[:300])
            passages.append(Passage(f"{conv_id}#{turn_index}", text))
    return tuple(passages)


def passages(split: Holdout) -> tuple[Passage, ...]:
    """The passages of one half of the dev split, in file order (deterministic)."""
    if split not in ("tune", "heldout"):
        raise ValueError(f"split must be 'tune' or 'heldout', got {split!r}")
    return tuple(p for p in _all_passages() if holdout_of(p.id) == split)


def clip(text: str, max_chars: int) -> str:
    """`text` cut at the last sentence end before `max_chars` (whole if it fits)."""
    if len(text) <= max_chars:
        return text
    cut = max(text.rfind(". ", 0, max_chars), text.rfind(".\n", 0, max_chars))
    return text[: cut + 1] if cut > max_chars // 2 else text[:max_chars]


def sentences(text: str) -> list[str]:
    """Informative single-line sentences of 60–240 characters, in order."""
    out = []
    for line in text.split("\n"):
        for sentence in _SENTENCE_END.split(line.strip()):
            if (60 <= len(sentence) <= 240 and sentence[-1] in ".!?\"”"
                    and not _INSTRUCTION.search(sentence)
                    and sum(c.isalpha() for c in sentence) > 0.7 * len(sentence)):
                out.append(sentence)
    return out


def ask(passage: Passage, context: str, rng: random.Random) -> Question | None:
    """One extractive question about a sentence of `passage`, unambiguous within `context`.

    None when the passage has no sentence that occurs once in the context.
    """
    candidates = [s for s in sentences(passage.text) if context.count(s) == 1]
    rng.shuffle(candidates)
    for sentence in candidates:
        keys = [k for k in _NAME.findall(sentence) + _NUMBER.findall(sentence)
                if context.count(k) == 1]
        if keys and rng.random() < 0.7:
            key = rng.choice(keys)
            return Question(rng.choice([
                f"What does the text say about {key}? Quote the sentence that mentions it.",
                f"Which sentence mentions {key}? Copy it word for word, then explain it briefly.",
                f"According to the context, what is said about {key}?",
            ]), sentence, passage.id)
        opening = " ".join(sentence.split()[:6])
        if context.count(opening) == 1:
            return Question(rng.choice([
                f'Find the sentence that begins "{opening}" and copy it out in full.',
                f'Complete this sentence from the context, word for word: "{opening} ..."',
            ]), sentence, passage.id)
    return None


def context_for(first: Passage, pool: tuple[Passage, ...], rng: random.Random) -> list[Passage]:
    """`first` plus other passages of `pool` (as a retriever's top-k) to reach MIN_CONTEXT_CHARS.

    Long passages stand alone (clipped to MAX_CONTEXT_CHARS); short ones are joined with others,
    each clipped so that the whole stays under MAX_CONTEXT_CHARS.
    """
    chosen = [Passage(first.id, clip(first.text, MAX_CONTEXT_CHARS))]
    others = [p for p in pool if p.id.split("#")[0] != first.id.split("#")[0]]
    rng.shuffle(others)
    for other in others:
        total = sum(len(p.text) for p in chosen)
        if total >= MIN_CONTEXT_CHARS:
            break
        budget = min(MAX_CONTEXT_CHARS - total, max(MIN_PASSAGE_CHARS, MIN_CONTEXT_CHARS - total + 500))
        chosen.append(Passage(other.id, clip(other.text, budget)))
    rng.shuffle(chosen)
    return chosen
