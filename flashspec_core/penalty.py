"""Repetition penalty along draft paths: HF's `repetition_penalty`, exact under speculation.

Small models decoding greedily fall into loops ("a cat cat cat ..."), inside JSON strings too,
where a grammar guarantees syntax but not an end. HF `generate`, llama.cpp and Ollama all offer
the same remedy, the CTRL repetition penalty: the logit of every token already in the sequence
(prompt included) is divided by the penalty when positive and multiplied by it when negative.

The penalty of a position depends on its prefix, and in one verify pass the positions of a row
follow different prefixes: position j scores the token after context + draft[:j]. Each position
therefore gets the penalty of its own prefix (as the grammar mask does, constrained/constraint.py),
so the verifier tests the draft against exactly the distribution that autoregressive decoding
with the penalty samples from, and the output law is unchanged by speculation.

The penalty is computed in float32 whatever the model's dtype, as HF `generate` computes it (it
casts the logits to float32 before any processor). In bfloat16, bf16 logits [24.0, 24.125] with
both tokens seen and penalty 1.3 both round to 18.5 and greedy picks token 0; HF picks token 1.
"""
from __future__ import annotations

from typing import Sequence

import torch


def penalize_paths(
    logits: torch.Tensor, contexts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], penalty: float
) -> torch.Tensor:
    """Apply the repetition penalty to each position of each row along its draft path.

    logits: [B, P, V] raw logits; position j of row b scores the token after
    contexts[b] + drafts[b][:j]. contexts: B token lists; drafts: B lists of at least P - 1 ids.
    Returns a new [B, P, V] float32 tensor (the input is not modified); penalty 1 returns `logits`
    itself, in its own dtype (casting to float32 is exact, so nothing downstream can tell).
    """
    if penalty == 1.0:
        return logits
    logits = logits.float()
    bsz, positions, vocab = logits.shape
    seen = torch.zeros((bsz, positions, vocab), dtype=torch.bool)  # [B, P, V]
    for b in range(bsz):
        ids = [t for t in set(contexts[b]) if 0 <= t < vocab]
        if ids:
            seen[b, :, ids] = True
        for j in range(1, positions):
            seen[b, j:, int(drafts[b][j - 1])] = True
    seen = seen.to(logits.device, non_blocking=True)
    scaled = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, scaled, logits)
