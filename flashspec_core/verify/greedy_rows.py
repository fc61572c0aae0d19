"""Greedy verification of rows of any draft lengths with one read of the device.

Greedy speculation keeps the longest prefix of the draft that equals the target's argmax at each
position, then the argmax after it (the recovered or bonus token). Every row's positions are
stacked into one [sum of (g+1), V] tensor; one `max` gives each position's argmax and whether its
logits are usable, the caller's one read of the step's results brings them to the host, and the
comparison with the drafts is a few integer tests per row. The law is the reference's: the first
index of the maximum (as torch's `argmax` and HF `generate` pick), and a position whose logits hold
NaN or +inf, or are all -inf, refuses its row (`BAD_INPUT`) whether or not the draft got that far.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from flashspec_core.backends.prefix import common_prefix
from flashspec_core.verify.reference import BAD_INPUT


def greedy_targets(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every row's argmax at each of its positions, stacked: [sum of (g+1)] int64 on the logits'
    device, -1 where a position's logits hold NaN or +inf or are all -inf. No read of the device:
    the caller reads it with whatever else the step reads (`accept_greedy` takes the host list).

    logits: per row [g+1, V] (the target's, processed) on one device, any float dtypes.
    """
    if any(rows.dim() != 2 for rows in logits):
        raise ValueError(f"logits: each row's must be [g+1, V]; got {[tuple(r.shape) for r in logits]}")
    if not logits:
        return torch.empty(0, dtype=torch.long)
    values, argmax = torch.cat(list(logits)).max(-1)  # [sum of (g+1)] each
    return argmax.masked_fill(~torch.isfinite(values), -1)


def accept_greedy(targets: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[tuple[int, list[int]]]:
    """Per row (accepted, tokens): the accepted draft tokens, then the recovered or bonus token.

    targets: `greedy_targets`' output on the host (rows in the order of `drafts`); drafts: per
    row its g draft ids. Raises ValueError(BAD_INPUT) for a row with a position of no law.
    """
    if len(targets) != sum(len(d) + 1 for d in drafts):
        raise ValueError(f"targets: {len(targets)} positions for drafts needing {sum(len(d) + 1 for d in drafts)}")
    out = []
    start = 0
    for draft in drafts:
        row = list(targets[start:start + len(draft) + 1])
        start += len(draft) + 1
        if min(row) < 0:
            raise ValueError(BAD_INPUT)
        n = common_prefix(draft, row)  # at most len(draft): row has one position more
        out.append((n, row[:n + 1]))
    return out


__all__ = ["accept_greedy", "greedy_targets"]
