"""An offline embedding that really ranks: hashed bag of words (plus word pairs), TF-weighted.

Retrieval examples and tests need an embedding that puts the document about the question first
without downloading a model (LlamaIndex's MockEmbedding returns the same vector for every text, so
it cannot rank). Hashing words (lower-cased, stop words dropped, a plural "s" folded) and adjacent
word pairs into a fixed number of signed buckets, with sublinear term frequency and L2
normalisation, gives cosine similarities that follow word overlap: crude next to a neural model,
but deterministic, instant and good enough to pick the right document out of a few. Both adapters
wrap this one function (`langchain.embeddings`, `llama_index.embeddings`).
"""
from __future__ import annotations

import hashlib
import math
import re
from collections import Counter

_WORD = re.compile(r"[a-z0-9]+")
_STOP_WORDS = frozenset(
    "a an and are as at be been but by can could did do does for from had has have how i if in into is "
    "it its me my no not of on or our so than that the their them then there these they this to was we "
    "were what when where which who why will with would you your about after all also any each just "
    "more most other some such only over out up down very please tell give".split()
)


def _terms(text: str) -> list[str]:
    words = []
    for word in _WORD.findall(text.lower()):
        if word in _STOP_WORDS:
            continue
        if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        words.append(word)
    return words + [f"{a}_{b}" for a, b in zip(words, words[1:])]


def _bucket(term: str, dim: int) -> tuple[int, float]:
    digest = hashlib.blake2b(term.encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    return value % dim, 1.0 if (value >> 63) & 1 == 0 else -1.0


def hashed_vector(text: str, dim: int = 1024) -> list[float]:
    """The embedding of `text`: [dim] floats, unit length.

    A text without content words (an empty query) gets the uniform vector, equally close to
    every document, rather than zeros, whose cosine similarity is undefined.
    """
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int; got {dim!r}")
    vec = [0.0] * dim
    for term, count in Counter(_terms(text)).items():
        index, sign = _bucket(term, dim)
        weight = 1.0 + math.log(count)
        vec[index] += sign * (weight if "_" not in term else 0.5 * weight)
    norm = math.sqrt(sum(v * v for v in vec))
    return [v / norm for v in vec] if norm else [1.0 / math.sqrt(dim)] * dim
