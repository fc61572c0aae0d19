"""The arms a router chooses among for a step: a draft source and its γ, or plain decoding."""
from __future__ import annotations

from dataclasses import dataclass

NO_DRAFT = "none"


@dataclass(frozen=True)
class Arm:
    """One routing choice: which draft source proposes, and how many tokens (γ) it may propose.

    `Arm(NO_DRAFT, 0)` is plain decoding, so speculation can switch itself off.
    """

    draft: str
    gamma: int

    def __str__(self) -> str:
        return self.draft if self.gamma == 0 else f"{self.draft}@{self.gamma}"
