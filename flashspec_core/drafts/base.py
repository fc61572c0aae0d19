"""The one Protocol every draft source implements.

A draft proposes up to γ tokens per row and says which distribution q it drew them from; the
verifier then accepts a prefix with the rule that keeps the output exactly the target's. q must be
honest: a model draft returns the probabilities it sampled from (through the shared sampling
function), a deterministic draft returns `probs=None`, meaning one-hot q at each proposed token.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.types import Proposal


@runtime_checkable
class DraftSource(Protocol):
    name: str
    # True when q is one-hot, proposing has no side effects and a γ proposal is the head of the
    # proposal for any larger γ: the router may then score this draft after the fact on every
    # step, whichever arm ran, from one call at its largest γ (full-information updates).
    deterministic: bool

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Up to `gamma` tokens continuing each row of `contexts` (prompt + verified output)."""
        ...

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """A new request starts: drop per-request state (a KV cache, say)."""
        ...

    def end(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """The request finished with these outputs (a cross-request cache indexes them)."""
        ...
