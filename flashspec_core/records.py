"""What one decode step did (`StepRecord`), for the request's stats and the router's reward, and
the check a router runs on a record before it learns from it."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flashspec_core.arms import Arm


@dataclass
class StepRecord:
    """What one decode step did, for stats and for the router's reward.

    `sequence` is the row's full token list after the step (prompt + output so far, not a copy);
    `sequence[:context_len]` is what the draft saw, so a router can score other drafts after the
    fact against `sequence[context_len:]`, the verified tokens of this step.
    """

    domain: str
    arm: Arm
    drafted: int
    accepted: int
    emitted: int
    draft_seconds: float
    verify_seconds: float
    context_len: int = 0
    sequence: Sequence[int] = field(default_factory=list, repr=False)
    rows: int = 1  # active rows of the batch; drafted/accepted/emitted are summed over them
    catchup_seconds: float = 0.0  # part of draft_seconds: see Proposal.catchup_seconds
    # Part of verify_seconds the target's runner spent on one-time work (capturing a CUDA graph,
    # growing its cache): paid once by whichever step triggered it, not a cost of the step's arm.
    warmup_seconds: float = 0.0
    # The draft lengths this step's runner verifies as proposed, others being cut to the longest
    # of them that fits (a sampled step on CUDA graphs, proposals.cut_length); () when any.
    draft_lengths: tuple[int, ...] = ()
    # The request's first step: its first token was scored by the prefill's own forward, so its
    # pass fed only the drafted tokens (none for plain decoding) instead of drafted + 1.
    prefilled: bool = False
    # Drafts that could not propose for this step's row (those that need a grammar, for a row
    # without one): the router neither offered their arms nor scores them on this request.
    unavailable: frozenset[str] = frozenset()

    @property
    def seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds

    @property
    def steady_seconds(self) -> float:
        """What the step would have cost had its draft also run the step before and the target's
        runner been warm."""
        return self.seconds - self.catchup_seconds - self.warmup_seconds

    @property
    def steady_verify_seconds(self) -> float:
        """The target's pass without its one-time work: what a pass this wide costs."""
        return self.verify_seconds - self.warmup_seconds


def check_record(record: StepRecord, index: Mapping[Arm, int]) -> None:
    """ValueError naming the field when `record` cannot be a finished step of a router with these arms."""
    if not isinstance(record, StepRecord):
        raise ValueError(f"record must be a StepRecord, got {type(record).__name__}")
    if not isinstance(record.domain, str) or not record.domain:
        raise ValueError(f"record.domain must be a non-empty str, got {record.domain!r}")
    if record.arm not in index:
        raise ValueError(f"record.arm {record.arm} is not one of the router's arms {list(index)}")
    if record.emitted < 0:
        raise ValueError(f"record.emitted must be >= 0, got {record.emitted}")
    if not 0.0 <= record.catchup_seconds <= record.draft_seconds:
        raise ValueError(
            f"record.catchup_seconds must be within [0, draft_seconds={record.draft_seconds}], "
            f"got {record.catchup_seconds}"
        )
    if record.warmup_seconds < 0 or (record.warmup_seconds and record.warmup_seconds >= record.verify_seconds):
        raise ValueError(
            f"record.warmup_seconds must be within [0, verify_seconds={record.verify_seconds}), "
            f"got {record.warmup_seconds}"
        )
    if not record.seconds > 0:
        raise ValueError(
            f"record.seconds (draft_seconds + verify_seconds) must be > 0, got {record.seconds}; "
            "time the step with time.perf_counter()"
        )
