"""A step's proposal as the verifier takes it: one length for every row, ids inside the target's
vocabulary, and, for a sampled step on CUDA graphs, a length some graph was warmed for."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from flashspec_core.drafts import DraftSource
from flashspec_core.processors.sampling import SamplingParams


def step_proposal(draft: DraftSource | None, seqs: Sequence[Sequence[int]], active: Sequence[bool], gamma: int,
                  sampling: SamplingParams, gen: torch.Generator | None, vocab: int,
                  device: torch.device) -> tuple[list[list[int]], torch.Tensor | None, float]:
    """Draft tokens as B host lists of g ids (g = the shortest active proposal; inactive rows
    padded with 0), q [B, g, V] on `device` or None (one-hot), and the draft's catch-up seconds.
    draft None (plain decoding) or gamma <= 0 proposes nothing."""
    if draft is None or gamma <= 0:
        return [[] for _ in seqs], None, 0.0
    proposal = draft.propose(seqs, gamma, sampling, gen)
    g = min(len(t) for t, a in zip(proposal.tokens, active) if a)
    bad = sorted({t for row, a in zip(proposal.tokens, active) if a for t in row[:g] if not 0 <= t < vocab})
    if bad:  # caught here: the target's embedding would meet the id before verify does
        raise ValueError(f"drafts: {draft.name!r} proposed token ids {bad[:5]} outside the target's vocabulary "
                         f"[0, {vocab}); a draft must share the target's tokenizer")
    tokens = [(list(t[:g]) + [0] * g)[:g] for t in proposal.tokens]
    probs = None if proposal.probs is None else proposal.probs[:, :g].to(device)
    return tokens, probs, proposal.catchup_seconds


def cut_to_lengths(drafts: list[list[int]], draft_probs: torch.Tensor | None,
                   lengths: Sequence[int]) -> tuple[list[list[int]], torch.Tensor | None]:
    """Cut a step's proposal to the longest of `lengths` it fills (uncut when `lengths` is empty).

    drafts: B lists of g ids; draft_probs: [B, g, V] or None; lengths: γ of the runner's warmed
    widths. A sampled step on CUDA graphs replays a graph of its exact width (a padded slot would
    be a token to test), captured per temperature at first use (about a second with the kernel's
    compile): copy drafts propose anything from 1 to γ tokens, so uncut they would capture up to γ
    graphs per temperature mid-request. Exact: the cut depends on the proposal's length only.
    """
    g = len(drafts[0])
    fit = cut_length(g, lengths)
    if fit == g:
        return drafts, draft_probs
    return [d[:fit] for d in drafts], None if draft_probs is None else draft_probs[:, :fit]


def cut_length(proposed: int, lengths: Sequence[int]) -> int:
    """The longest of `lengths` within `proposed` (`proposed` itself when `lengths` is empty):
    what a proposal of that length is cut to (the router scores copy drafts with the same cut)."""
    return max((n for n in lengths if n <= proposed), default=proposed)
