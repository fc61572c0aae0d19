"""Full-information scoring of deterministic drafts: what would a copy draft have emitted here?

The router asks each free arm (prompt lookup, the suffix cache: no side effects) what it would have
proposed and scores that against the tokens verified from there on, whichever arm ran, along the
path its own steps would have taken: its first step where the request's first decode step started,
each next one where the previous would have ended (matched + 1 tokens later), so a long copy
counts once. Under sampling that path runs through the tokens drawn, the same law. A proposal is
scored once a mismatch shows or all of it is verified; when the request moves on, a waiting one is
scored against what was verified, never past the last token. Only finished steps are used.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flashspec_core.arms import Arm
from flashspec_core.backends.prefix import common_prefix
from flashspec_core.drafts.base import DraftSource
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.proposals import cut_length
from flashspec_core.records import StepRecord

_GREEDY = SamplingParams()  # deterministic drafts ignore sampling; built once, not per step


@dataclass
class CopyScore:
    """One after-the-fact scoring of a free arm."""

    domain: str
    arm: int  # index into the router's arms
    emitted: int  # tokens the arm's step would have emitted (summed over the step's rows)
    proposed: int  # tokens it would have proposed (one row), which sets its verify cost
    context: int  # tokens before its step (the other thing its verify cost depends on)
    draft_seconds: float  # what proposing took
    step_seconds: float  # what the latest real step took: a stand-in before any better estimate


@dataclass
class _Track:
    """One request's free arms, each at the position where its own next step would start."""

    domain: str
    sequence: Sequence[int]  # the request's live token list: later steps extend it
    cursor: dict[int, int]  # arm index -> where its next step starts
    rows: int = 1
    seconds: float = 0.0
    lengths: tuple[int, ...] = ()  # the draft lengths the runner verifies uncut (StepRecord.draft_lengths)
    waiting: dict[int, tuple[list[int], float]] = field(default_factory=dict)  # arm -> (proposal, seconds)


class CopyScorer:
    """Walks each free arm's own path through the current request, scoring its steps as verified.

    drafts: name -> deterministic DraftSource; each serves the arms of `arms` with its name.
    """

    def __init__(self, arms: Sequence[Arm], drafts: Mapping[str, DraftSource]) -> None:
        self.arms = tuple(arms)
        self._index = {a: i for i, a in enumerate(self.arms)}
        # (name, draft, [(arm index, γ)]): per position, one call at its largest γ serves every γ.
        self._drafts = [(name, d, [(i, a.gamma) for i, a in enumerate(self.arms) if a.draft == name])
                        for name, d in drafts.items()]
        self._drafts = [(name, d, arms) for name, d, arms in self._drafts if arms]
        self._track: _Track | None = None

    def step(self, record: StepRecord) -> list[CopyScore]:
        """Take this finished step's tokens; return every scoring now decided."""
        out: list[CopyScore] = []
        track = self._track
        if track is not None and track.sequence is not record.sequence:  # the request moved on
            out += self._walk(track, final=True)
            track = self._track = None
        ctx, seq = record.context_len, record.sequence
        if track is None:
            if not self._drafts or ctx <= 0 or len(seq) <= ctx:
                return out
            cursor = {i: ctx for name, _, arms in self._drafts if name not in record.unavailable for i, _ in arms}
            track = self._track = _Track(record.domain, seq, cursor)
        track.rows, track.seconds, track.lengths = record.rows, record.steady_seconds, record.draft_lengths
        ran = self._index.get(record.arm)
        if ran in track.cursor:  # its own step is timed for real: its path goes on from there
            track.cursor[ran] = len(seq)
            track.waiting.pop(ran, None)
        out += self._walk(track, final=False)
        return out

    def _walk(self, track: _Track, final: bool) -> list[CopyScore]:
        """Score each arm's steps while their tokens are verified; `final`: the request is over,
        so the step left waiting is scored against what was verified, and no new one is proposed
        (the suffix cache has been shown the request's output by then)."""
        seq, end, out = track.sequence, len(track.sequence), []
        for _, draft, arms in self._drafts:
            if arms[0][0] not in track.cursor:  # not scored on this request (StepRecord.unavailable)
                continue
            asked: dict[int, tuple[list[int], float]] = {}  # position -> (largest-γ proposal, seconds)
            for i, gamma in arms:
                while track.cursor[i] < end and (i in track.waiting or not final):
                    pos = track.cursor[i]
                    if i not in track.waiting:
                        tokens, seconds = self._ask(draft, arms, seq, pos, asked)
                        head = tokens[:gamma]  # cut as the step's runner would have cut it
                        track.waiting[i] = (head[:cut_length(len(head), track.lengths)], seconds)
                    proposal, seconds = track.waiting[i]
                    verified = seq[pos:pos + len(proposal)]
                    matched = common_prefix(proposal, verified)
                    if not (final or matched < len(verified) or len(verified) == len(proposal)):
                        break  # undecided: later steps of the request will verify more
                    emitted = matched + 1
                    if final:  # the request's last step: it never emits past the request's end
                        emitted = min(emitted, end - pos)
                    out.append(CopyScore(track.domain, i, emitted * track.rows, len(proposal), pos, seconds,
                                         track.seconds))
                    del track.waiting[i]
                    track.cursor[i] = pos + matched + 1
        return out

    @staticmethod
    def _ask(draft: DraftSource, arms: list[tuple[int, int]], seq: Sequence[int], pos: int,
             asked: dict[int, tuple[list[int], float]]) -> tuple[list[int], float]:
        """The draft's proposal at its largest γ from `seq[:pos]` and what it took: one call per
        position serves every γ (a deterministic draft's shorter proposal is the head of its longer)."""
        if pos not in asked:
            context = seq[:pos]
            if not isinstance(context, list):
                context = list(context)
            start = time.perf_counter()
            tokens = draft.propose([context], max(g for _, g in arms), _GREEDY).tokens[0]
            asked[pos] = ([int(t) for t in tokens], time.perf_counter() - start)
        return asked[pos]
