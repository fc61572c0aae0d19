"""One generation request of a workload, shared by every stream in this package."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One generation request of the stream: what an agent framework would send the model."""

    domain: str
    messages: list[dict[str, str]]
    max_new_tokens: int
    source: str
