"""One request's logits processors, applied along every draft path.

In one verify pass position j of a row scores the token after context + draft[:j], so each
position is processed with its own prefix: the repetition penalty (penalty.py), the grammar's mask
(constrained/constraint.py) and the n-gram ban (ngram_ban.py), in that order. The verifier then
tests the draft against exactly the distribution autoregressive decoding with these processors
samples from. What they read lives on the logits' device and grows by the committed tokens only.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from flashspec_core.constrained.constraint import Constraint
from flashspec_core.processors.ngram_ban import OutputTokens, ban_repeated_ngrams
from flashspec_core.processors.penalty import SeenTokens, penalize_paths
from flashspec_core.processors.sampling import SamplingParams


class PathProcessors:
    """The processors one request's settings switch on, and the state each reads.

    prompts: each row's prompt ids (the penalty counts them as seen). exempt: [V] bool, tokens the
    n-gram ban leaves alone (JSON punctuation under a schema), or None.
    """

    def __init__(self, sampling: SamplingParams, constraint: Constraint | None, prompts: Sequence[Sequence[int]],
                 vocab: int, device: torch.device, exempt: torch.Tensor | None = None) -> None:
        self.sampling = sampling
        self.constraint = constraint
        self.seen = SeenTokens(prompts, vocab, device) if sampling.repetition_penalty != 1.0 else None
        self.outputs = OutputTokens([[] for _ in prompts], device) if sampling.no_repeat_ngram_size else None
        self.exempt = exempt if constraint is not None else None

    def penalty_alone(self) -> SeenTokens | None:
        """The tokens seen, when the repetition penalty is the only processor on (`penalize_rows`
        can then take this request's rows together with other requests'); else None."""
        return self.seen if self.constraint is None and self.outputs is None else None

    def __call__(self, logits: torch.Tensor, drafts: Sequence[Sequence[int]], draft_tokens: torch.Tensor,
                 active: Sequence[bool]) -> torch.Tensor:
        """logits: [B, g+1, V] the target's at each position of each row's path; drafts: B host
        lists of g ids, the same as draft_tokens [B, g] on the logits' device. Returns the
        processed logits, [B, g+1, V]."""
        if self.seen is not None:
            logits = penalize_paths(logits, self.seen, draft_tokens, self.sampling.repetition_penalty)
        if self.constraint is not None:  # -inf where the grammar forbids, along each draft path
            logits = self.constraint.mask_logits(logits, drafts, active)
        if self.outputs is not None:
            logits = ban_repeated_ngrams(logits, self.outputs, draft_tokens, self.sampling.no_repeat_ngram_size,
                                         self.exempt)
        return logits

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        """Row `row` emitted `tokens` (verified and kept): what every processor reads grows by them."""
        for state in (self.constraint, self.seen, self.outputs):
            if state is not None:
                state.commit(row, tokens)
