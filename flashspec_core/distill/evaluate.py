"""Offline acceptance of a draft on held-back rows: what the engine would see, without running it.

On a row whose continuation is the target's greedy output, greedy speculation is fully determined
by teacher forcing: a step drafting γ tokens from position t accepts the run of positions where the
draft's argmax equals the target's, capped at γ, and the next step starts after the corrected
token. `simulate_steps` replays exactly that, so the mean accepted length and α it reports are the
engine's greedy numbers for these rows (up to float noise). Σ min(p, q) is the acceptance
probability of one sampled draft token at temperature 1.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from transformers import PreTrainedModel

from flashspec_core.distill.data import TokenSet
from flashspec_core.distill.model import DraftNetwork
from flashspec_core.distill.train import make_batch, target_logprobs

GAMMAS = (2, 4, 8)


def simulate_steps(matches: list[bool], gamma: int) -> tuple[int, int, int]:
    """Greedy speculation over one row: (steps, drafted, accepted) given per-position argmax matches."""
    steps = drafted = accepted = 0
    t, n = 0, len(matches)
    while t < n:
        g = min(gamma, n - t - 1)  # the engine drafts at most what is left minus the target's own token
        run = 0
        while run < g and matches[t + run]:
            run += 1
        steps += 1
        drafted += g
        accepted += run
        t += run + 1
    return steps, drafted, accepted


@torch.no_grad()
def evaluate_draft(
    network: DraftNetwork,
    target: PreTrainedModel,
    rows: TokenSet,
    pad_token_id: int,
    batch_size: int = 16,
    max_len: int = 640,
) -> dict[str, dict[str, float]]:
    """Per-domain offline metrics on `rows` (prompt + greedy target continuation), plus 'all'.

    The head of each row is the trained subset united with that row's prompt tokens, as in the engine.
    """
    device = network.vocab_ids.device
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    order = [i for i in range(len(rows)) if len(rows.seqs[i]) > rows.prompt_lens[i]]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        ids, attn, loss_mask, _ = make_batch(rows, chunk, pad_token_id, max_len, device)
        with autocast:
            hidden = network.hidden(ids, attn)  # [B, T, H]
            for b, r in enumerate(chunk):
                logp = target_logprobs(target, ids[b:b + 1], attn[b:b + 1], loss_mask[b:b + 1])  # [n, V]
                p_top = logp.argmax(-1)
                seq = ids[b, attn[b].bool()]
                prompt_end = int(loss_mask[b].nonzero()[0])
                head = network.head_with(seq[: prompt_end + 1])
                logq = (hidden[b, loss_mask[b]] @ network._out_weight.index_select(0, head).T.to(hidden.dtype)).float()
                q = torch.zeros_like(logp).index_copy_(1, head, logq.softmax(-1))  # [n, V]
                matches = (head[logq.argmax(-1)] == p_top).tolist()
                cell = sums[rows.domains[r]]
                cell["rows"] += 1
                cell["positions"] += len(matches)
                cell["greedy_match"] += sum(matches)
                cell["alpha_t1"] += float(torch.minimum(logp.exp(), q).sum())
                cell["coverage"] += float(torch.isin(p_top, head).sum())
                for g in GAMMAS:
                    steps, drafted, accepted = simulate_steps(matches, g)
                    cell[f"steps@{g}"] += steps
                    cell[f"drafted@{g}"] += drafted
                    cell[f"accepted@{g}"] += accepted
    for domain in list(sums):
        for k, v in sums[domain].items():
            sums["all"][k] += v
    return {d: _summarise(c) for d, c in sums.items()}


def _summarise(cell: dict[str, float]) -> dict[str, float]:
    n = max(cell["positions"], 1)
    out = {"rows": int(cell["rows"]), "positions": int(cell["positions"]),
           "greedy_match": cell["greedy_match"] / n, "alpha_t1": cell["alpha_t1"] / n, "coverage": cell["coverage"] / n}
    for g in GAMMAS:
        out[f"accept_len@{g}"] = cell[f"accepted@{g}"] / max(cell[f"steps@{g}"], 1)
        out[f"alpha@{g}"] = cell[f"accepted@{g}"] / max(cell[f"drafted@{g}"], 1)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
