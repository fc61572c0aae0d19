"""Verifying a step's rows from their logits: each row's processors along its path, then greedy
rows all together and sampled rows of one setting together, with one read of the device.

This is how the step verifies every row a graph replay did not verify itself: rows under a
penalty, grammar or n-gram ban, a row's first step, and every row on a CPU. Each row keeps its own
law: its processors see its own path, and a sampled row draws from its own generator (or from a
seed drawn from it) whatever group it is verified in.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch

from flashspec_core.backends.static_rows import padded
from flashspec_core.processors.penalty import SeenTokens, penalize_rows
from flashspec_core.proposals import Drafted
from flashspec_core.request import Row
from flashspec_core.verify import BAD_INPUT, Backend, draw_seed, kernel_samples, pick_backend, verify
from flashspec_core.verify.greedy_rows import accept_greedy, greedy_targets


def verify_rows(rows: Sequence[Row], drafted: Sequence[Drafted], scored: Mapping[int, torch.Tensor],
                device: torch.device, verify_backend: Backend) -> tuple[list[int], list[list[int]]]:
    """Process each row's logits along its path and verify them: greedy rows all together,
    sampled rows of one setting and draft length together. scored: slot -> [need, V] (the
    target's logits after the row's last `need` path tokens); host lists out: accepted per row,
    and per row the accepted draft tokens then the recovered or bonus token. The host reads the
    step's results once (not once per row or group: each read waits for the device)."""
    groups: dict[tuple, list[int]] = defaultdict(list)  # sampled rows by setting and shape
    greedy: list[int] = []
    processed = []
    widest = max(len(d.tokens) for d in drafted)
    device_drafts = padded([d.tokens for d in drafted], widest, -1).to(device, non_blocking=True)  # [rows, widest]
    for i, (row, d) in enumerate(zip(rows, drafted)):
        g = len(d.tokens)
        if row.first is None:
            logits = scored[row.slot][None]  # [1, g+1, V]
        elif g:
            logits = torch.cat([row.first[None], scored[row.slot][None].to(row.first.device)], dim=1)
        else:
            logits = row.first[None]  # [1, 1, V]
        processed.append((logits, device_drafts[i:i + 1, :g].to(logits.device)))  # [1, g]
    processed = _process(rows, drafted, processed, device_drafts)
    for i, (row, d) in enumerate(zip(rows, drafted)):
        g = len(d.tokens)
        if row.sampling.greedy:
            greedy.append(i)
        else:
            # A row's first step verifies on other ops than its later ones (below): that must be
            # the row's own state, never its neighbours', or its random draws would depend on them.
            # Not the seed: each row draws from its own generator whatever its group.
            key = row.sampling.model_dump_json(exclude={"seed"})
            groups[(key, g, d.probs is None, row.first is not None)].append(i)
    # Every row's result in one read of the device: the greedy rows' argmaxes (every draft
    # length and setting together), then each sampled group's accepted counts and tokens.
    parts = [greedy_targets([processed[i][0][0] for i in greedy])] if greedy else []
    shapes = []
    for members in groups.values():
        lead = rows[members[0]]
        logits = torch.cat([processed[i][0] for i in members])  # [n, g+1, V]
        tokens = torch.cat([processed[i][1] for i in members])  # [n, g]
        probs = None if drafted[members[0]].probs is None else torch.stack(
            [drafted[i].probs for i in members])  # type: ignore[misc]  # [n, g, V]
        # A row's first step verifies on torch ops unless pinned: Triton compiles its kernel per
        # shape at first use, which the router would charge to the step's arm and width.
        first = lead.first is not None
        backend: Backend = "torch" if first and verify_backend == "auto" else verify_backend
        if pick_backend(backend, logits) == "triton" and kernel_samples(lead.sampling, logits.shape[-1]):
            # One kernel for the group, each row drawing from a seed taken from its own
            # generator, as a graph replay of a row alone does (`verify_step`): a seeded row
            # samples the same tokens alone, in a graph or beside others.
            seeds = torch.cat([draw_seed(rows[i].generator, logits.device) for i in members])  # [n]
            accepted, tokens_out = verify(logits, tokens, probs, lead.sampling, backend="triton",
                                          check_finite=False, seed=seeds)
        else:
            uniforms = torch.cat([  # [n, g+1]: each row's own draws
                torch.rand((1, tokens.shape[1] + 1), generator=rows[i].generator, device=logits.device)
                for i in members])
            accepted, tokens_out = verify(logits, tokens, probs, lead.sampling, uniforms, backend=backend,
                                          check_finite=False)
        parts += [accepted, tokens_out.flatten()]
        shapes.append((members, tokens.shape[1] + 1))
    flat = torch.cat([part.to(device) for part in parts]).tolist()
    n_acc, out = [0] * len(rows), [[] for _ in rows]  # type: list[int], list[list[int]]
    start = sum(len(drafted[i].tokens) + 1 for i in greedy)
    for i, (n, row_tokens) in zip(greedy, accept_greedy(flat[:start], [drafted[i].tokens for i in greedy])):
        n_acc[i], out[i] = n, row_tokens
    for members, width in shapes:
        counts, start = flat[start:start + len(members)], start + len(members)
        for k, (i, n) in enumerate(zip(members, counts)):
            if n < 0:  # the Triton verify's refusal (check_finite=False above)
                raise ValueError(BAD_INPUT)
            n_acc[i], out[i] = n, flat[start + k * width:start + (k + 1) * width]
        start += len(members) * width
    for row in rows:
        row.first = None
    return n_acc, out


def _process(rows: Sequence[Row], drafted: Sequence[Drafted], inputs: list[tuple[torch.Tensor, torch.Tensor]],
             drafts: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's logits [1, g+1, V] through its processors (inputs: with its draft [1, g] on
    their device; drafts: every row's, [rows, widest], -1 past each). Rows whose one processor
    is the repetition penalty, at one penalty, are penalized together: one set of device ops
    for them all, not one per row."""
    out = list(inputs)
    together: dict[float, list[tuple[int, SeenTokens]]] = defaultdict(list)
    for i, row in enumerate(rows):
        assert row.processors is not None  # set up by the prefill
        if (seen := row.processors.penalty_alone()) is not None:
            together[row.sampling.repetition_penalty].append((i, seen))
    grouped: set[int] = set()
    for penalty, members in together.items():
        if len(members) < 2:
            continue
        index = torch.tensor([i for i, _ in members]).to(drafts.device, non_blocking=True)
        done = penalize_rows([inputs[i][0][0] for i, _ in members], [seen for _, seen in members],
                             drafts.index_select(0, index), penalty)
        for (i, _), logits in zip(members, done):
            out[i] = (logits[None], inputs[i][1])
            grouped.add(i)
    for i in range(len(rows)):
        if i in grouped:
            continue
        logits, draft_tokens = inputs[i]
        processors = rows[i].processors
        assert processors is not None
        out[i] = (processors(logits, [drafted[i].tokens], draft_tokens, [True]), draft_tokens)
    return out
