"""What `generate` returns and `stream` yields."""
from __future__ import annotations

from dataclasses import dataclass, field

from flashspec_core.records import StepRecord


@dataclass
class GenerationStats:
    """Per-request speculation statistics (a batch shares `records`, counts are per row)."""

    domain: str
    prompt_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0  # prefill + every step's draft and verify time
    prefill_seconds: float = 0.0  # feeding the prompt before the first step
    cached_prompt_tokens: int = 0  # prompt tokens reused from a cache (an earlier request's slot, another row)
    # Host work after each step's verification (output text, stop strings, router update): not
    # in `seconds`, which the router charges to arms; measured so it can be kept small.
    host_seconds: float = 0.0
    step_rows: int = 0  # rows of the running batch, summed over this request's steps
    records: list[StepRecord] = field(default_factory=list, repr=False)

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def arms(self) -> list[str]:
        """The arm of each step, e.g. 'prompt_lookup@4' or 'none'."""
        return [str(r.arm) for r in self.records]

    @property
    def mean_rows(self) -> float:
        """The mean number of rows this request's steps decoded together (0 before a step)."""
        return self.step_rows / self.steps if self.records else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {
            "domain": self.domain,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "seconds": round(self.seconds, 6),
            "prefill_seconds": round(self.prefill_seconds, 6),
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "arms": self.arms,
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_new_tokens)
    stats: GenerationStats
    prompt_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.stats.seconds if self.stats.seconds else 0.0


@dataclass
class StreamChunk:
    text: str  # the new text since the previous chunk
    token_ids: list[int]  # the tokens this step added
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # set on the last chunk
