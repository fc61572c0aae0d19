"""No repeated n-grams in the output, along draft paths: exact under speculation, safe under a grammar.

A small model decoding greedily loops ("a cat is a cat, a cat is a cat, ..."), and inside a JSON
string a grammar guarantees syntax but not an end, so a forced call runs out of tokens. The
repetition penalty (penalty.py) also pushes down the JSON punctuation the grammar needs; banning a
token that would complete an n-gram the output already holds (HF's `no_repeat_ngram_size`) breaks
the loop and leaves single tokens alone. Two choices differ from HF `generate`:

- Only the output counts, not the prompt: an agent's tool arguments are copied from the request
  (names, ids, quoted text), and a ban that included the prompt would forbid exactly those copies.
- The ban yields to the grammar. Under a JSON schema, tokens carrying JSON punctuation (quotes,
  brackets, colons, commas) are exempt: the syntax repeats them by design (`": "` before every
  value), and banning one makes the model spell the same structure with an odd token or keeps it
  from closing a string; loops live in the words between them. And at a position where the ban
  would forbid every token the grammar still allows, the position keeps its logits.

Like the penalty, the ban of a position depends on its prefix, so each verify position gets the ban
of its own path (output + draft[:j]); the verifier then tests the draft against exactly the
distribution autoregressive decoding samples from. HF's processor computes each ban, in float32
whatever the model's dtype, as HF `generate` does.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor


_JSON_PUNCTUATION = frozenset('"{}[]:,')


def json_punctuation_tokens(tokenizer, vocab_size: int) -> torch.Tensor:
    """[V] bool: the token ids whose text contains JSON punctuation (exempt under a schema)."""
    exempt = torch.zeros(vocab_size, dtype=torch.bool)
    for i, text in enumerate(tokenizer.batch_decode([[i] for i in range(min(vocab_size, len(tokenizer)))])):
        exempt[i] = not _JSON_PUNCTUATION.isdisjoint(text)
    return exempt


def ban_repeated_ngrams(
    logits: torch.Tensor, outputs: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], size: int,
    exempt: torch.Tensor | None = None,
) -> torch.Tensor:
    """Set to -inf every token that would repeat an n-gram of `size` tokens along each draft path.

    logits: [B, P, V] processed logits (penalty and grammar mask applied); position j of row b
    scores the token after outputs[b] + drafts[b][:j]. outputs: B lists of the tokens generated so
    far (prompt excluded); drafts: B lists of at least P - 1 ids. size 0 returns `logits` itself.
    exempt: [V] bool, tokens never banned (None: none). Returns a new [B, P, V] float32 tensor; a
    position the ban would empty keeps its logits. size 0 returns `logits` itself.
    """
    if size <= 0:
        return logits
    processor = NoRepeatNGramLogitsProcessor(size)
    exempt = None if exempt is None else exempt.to(logits.device)
    logits = logits.float()
    out = logits.clone()
    positions = logits.shape[1]
    for b in range(logits.shape[0]):
        path = [int(t) for t in outputs[b]] + [int(t) for t in drafts[b][: positions - 1]]
        start = len(outputs[b])
        for j in range(positions):
            if start + j < size:
                continue  # no complete n-gram yet
            ids = torch.tensor([path[: start + j]], dtype=torch.long, device=logits.device)  # [1, L]
            banned = processor(ids, logits[b, j : j + 1])[0]  # [V]
            if exempt is not None:
                banned = torch.where(exempt, logits[b, j], banned)
            if torch.isfinite(banned).any():
                out[b, j] = banned
    return out
