"""What a model-draft arm is expected to earn before the router has run it: its prior, from measurements.

A step of draft d at γ emits 1 + accepted(γ) tokens on average and costs γ draft tokens plus one
target forward over γ + 1 tokens. accepted(γ) is the draft's acceptance measured off-line (a
trained draft's card, `ModelDraft.accepted_lengths`); the costs are this machine's: the target's
forward per width from the calibration, the draft's token from timing it here (`draft_token_seconds`).
Neither is the workload's own (a card's prompts are not the user's), so the router takes the
result as one observation's worth of prior (`BanditRouter.set_expected_goodput`), which its own
steps overrule; an arm with no measured acceptance keeps the router's optimistic default.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import torch

from flashspec_core.arms import Arm
from flashspec_core.drafts.base import DraftSource
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.base import Router


def draft_token_seconds(draft: DraftSource, vocab: int, context: int = 64, gamma: int = 4, reps: int = 3) -> float:
    """Seconds one drafted token costs `draft` (a ModelDraft) here: the median over `reps` proposals
    of `gamma` tokens after a random `context`, catch-up (its prefill) excluded."""
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, vocab, (context,), generator=gen).tolist()
    greedy = SamplingParams()
    draft.begin([ctx])
    draft.propose([ctx], 1, greedy)  # the prefill of the context, not timed
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        proposal = draft.propose([ctx], gamma, greedy)
        samples.append((time.perf_counter() - start - proposal.catchup_seconds) / gamma)
    draft.end([ctx], [[]])
    return statistics.median(samples)


def expected_goodput(arms: Sequence[Arm], accepted: Mapping[str, Mapping[int, float]],
                     token_seconds: Mapping[str, float], forward_seconds: Mapping[int, float]) -> dict[Arm, float]:
    """Arm -> expected tokens/s, for the arms whose draft has a measured acceptance at their γ, a
    measured token cost, and a calibrated forward at width γ + 1."""
    out = {}
    for arm in arms:
        tokens = accepted.get(arm.draft, {}).get(arm.gamma)
        cost = token_seconds.get(arm.draft)
        forward = forward_seconds.get(arm.gamma + 1)
        if tokens is not None and cost is not None and forward:
            out[arm] = (1.0 + tokens) / (arm.gamma * cost + forward)
    return out


def seed_router(router: Router, drafts: Mapping[str, DraftSource], forward_seconds: Mapping[int, float],
                vocab: int) -> None:
    """The router's prior for each model-draft arm: the draft's measured acceptance priced at this
    machine's costs. A draft is timed here (a few proposals) only if it has a measured acceptance."""
    measured = {name: d for name, d in drafts.items() if d.accepted_lengths}
    costs = {name: draft_token_seconds(d, vocab) for name, d in measured.items()}
    accepted = {name: d.accepted_lengths for name, d in measured.items()}
    router.set_expected_goodput(expected_goodput(router.arms, accepted, costs, forward_seconds))
