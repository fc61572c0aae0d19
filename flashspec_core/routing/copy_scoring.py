"""Full-information scoring of deterministic drafts: what would a copy draft have emitted here?

Prompt lookup and the suffix cache cost next to nothing to run and have no side effects, so after
every step the router asks each of them what it would have proposed from the step's context and
scores that against the tokens verified from there on. A plain step verifies one token, so the
tokens that decide a proposal come from later steps of the same request: a proposal is scored once
a mismatch shows or all of it has been verified, and whatever is left when the request moves on is
scored against what was verified. Only finished steps are used (exactness invariant).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from flashspec_core.drafts.base import DraftSource
from flashspec_core.proposals import cut_length
from flashspec_core.sampling import SamplingParams
from flashspec_core.types import Arm, StepRecord

MAX_PENDING = 64  # steps whose proposals wait for verified tokens; past this, all are scored as they stand
_GREEDY = SamplingParams()  # deterministic drafts ignore sampling; built once, not per step


@dataclass
class CopyScore:
    """One after-the-fact scoring of a free arm."""

    domain: str
    arm: int  # index into the router's arms
    emitted: int  # tokens the arm's step would have emitted (summed over the step's rows)
    proposed: int  # tokens it would have proposed (one row), which sets its verify cost
    draft_seconds: float  # what proposing took
    step_seconds: float  # what the step that really ran took: a stand-in before any better estimate


@dataclass
class _Pending:
    """Free arms' proposals from one step's context, waiting for the tokens that will score them."""

    domain: str
    sequence: Sequence[int]  # the step's live token list: later steps of the request extend it
    context_len: int
    rows: int
    seconds: float
    proposals: dict[int, list[int]]  # arm index -> proposed tokens
    draft_seconds: dict[int, float]  # arm index -> what proposing them took


class CopyScorer:
    """Proposes from each finished step's context with every free draft; scores when verified.

    drafts: name -> deterministic DraftSource; each serves the arms of `arms` with its name.
    """

    def __init__(self, arms: Sequence[Arm], drafts: Mapping[str, DraftSource]) -> None:
        self.arms = tuple(arms)
        self._index = {a: i for i, a in enumerate(self.arms)}
        # (draft, [(arm index, γ)]): one call per draft and step, at its largest γ.
        self._drafts = [(d, [(i, a.gamma) for i, a in enumerate(self.arms) if a.draft == name])
                        for name, d in drafts.items()]
        self._pending: deque[_Pending] = deque()

    def _propose(self, record: StepRecord) -> _Pending | None:
        """What each free arm would have proposed from this step's context, to score later."""
        ctx, seq = record.context_len, record.sequence
        if not self._drafts or ctx <= 0 or len(seq) <= ctx:
            return None
        context = seq[:ctx]  # a copy: drafts must not see or touch the live list
        if not isinstance(context, list):
            context = list(context)
        ran = self._index.get(record.arm)
        proposals, seconds = {}, {}
        for draft, arms in self._drafts:
            arms = [(i, g) for i, g in arms if i != ran]  # the arm that ran has its own
            if not arms:
                continue
            # A deterministic draft's γ proposal is the head of its longer one (DraftSource):
            # one call at the largest γ serves every γ, each charged that call's time.
            start = time.perf_counter()
            longest = [int(t) for t in draft.propose([context], max(g for _, g in arms), _GREEDY).tokens[0]]
            elapsed = time.perf_counter() - start
            for i, gamma in arms:  # cut as the step's runner would have cut it
                head = longest[:gamma]
                proposals[i], seconds[i] = head[:cut_length(len(head), record.draft_lengths)], elapsed
        if not proposals:
            return None
        return _Pending(record.domain, seq, ctx, record.rows, record.steady_seconds, proposals, seconds)

    @staticmethod
    def _resolve(pending: _Pending, final: bool) -> dict[int, tuple[int, int]]:
        """(tokens emitted, tokens proposed) of each free arm of `pending` whose count is known.

        Emitted = matched + 1: the verifier accepts the matching prefix and then emits one target
        token (the correction, or the bonus after a full match). The count is known once a
        mismatch shows or every proposed token has been verified; `final` (the request has moved
        on) scores what is left against what was verified.
        """
        verified = [int(t) for t in pending.sequence[pending.context_len:]]
        out = {}
        for i, proposal in list(pending.proposals.items()):
            matched = 0
            for p, v in zip(proposal, verified):
                if p != v:
                    break
                matched += 1
            if final or matched < min(len(proposal), len(verified)) or len(verified) >= len(proposal):
                out[i] = ((matched + 1) * pending.rows, len(proposal))  # a batch step emits for every row
                del pending.proposals[i]
        return out

    def step(self, record: StepRecord) -> list[CopyScore]:
        """Add this finished step's proposals; return every scoring that is now decided."""
        new = self._propose(record)
        if new is not None:
            self._pending.append(new)
        out: list[CopyScore] = []
        keep: deque[_Pending] = deque()
        for pending in self._pending:
            final = pending.sequence is not record.sequence or len(self._pending) > MAX_PENDING
            for i, (emitted, proposed) in self._resolve(pending, final).items():
                out.append(CopyScore(pending.domain, i, emitted, proposed, pending.draft_seconds[i], pending.seconds))
            if pending.proposals:
                keep.append(pending)
        self._pending = keep
        return out
