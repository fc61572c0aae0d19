"""Requests that arrive together -> engine batches.

The engine decodes a list of prompts as one batch (one forward per step for all rows, exact for
every row), but with one setting for the batch: one domain, sampling, stop list, token budget and
schema. Requests are therefore grouped by `Plan.batch_key` and each group is one engine call;
seeded requests run alone so that a seed reproduces its output. A group's failure is reported to
that group's callers only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flashspec_core.results import GenerationResult
from flashspec_integrations.serve.translate import Plan


@dataclass
class Decoded:
    """One request's engine result and how many requests shared its engine batch."""

    result: GenerationResult
    rows: int


def group(plans: Sequence[Plan]) -> list[list[int]]:
    """Indices of `plans` in engine batches, in arrival order of each batch's first request."""
    groups: dict[Any, list[int]] = {}
    for i, plan in enumerate(plans):
        key = plan.batch_key()
        groups.setdefault(("alone", i) if key is None else key, []).append(i)
    return list(groups.values())


def decode_batch(engine: Any, plans: Sequence[Plan]) -> list[Decoded | Exception]:
    """Decode `plans` in as few engine calls as their settings allow (blocking; call it from a
    worker thread). Each entry is the request's result, or the exception its group raised."""
    out: list[Decoded | Exception | None] = [None] * len(plans)
    for indices in group(plans):
        first = plans[indices[0]]
        try:
            results = engine.generate(
                [plans[i].prompt_ids for i in indices], max_new_tokens=first.max_new_tokens,
                sampling=first.sampling, stop=list(first.stop) or None, domain=first.domain,
                json_schema=first.json_schema,
            )
            for i, res in zip(indices, results):
                out[i] = Decoded(res, len(indices))
        except Exception as exc:  # handed to this group's callers; other groups still decode
            for i in indices:
                out[i] = exc
    return out  # type: ignore[return-value]
