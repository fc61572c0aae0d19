"""The PyTorch reference for one verification step (speculative rejection sampling).

Draft token x_j (drawn from q_j) is accepted while log u_j < log p_j(x_j) - log q_j(x_j), i.e. with
probability min(1, p/q); at the first rejection the recovered token is drawn from the residual
max(0, p_j - q_j), and after γ acceptances the bonus token from p_γ, so the output has exactly the
target's law (Leviathan et al. 2023, Chen et al. 2023). A draft token with q = 0 is rejected (it
could not have been drawn from q); greedy is exact argmax matching. Input with no target law is a
ValueError in both modes, as in the Triton kernel: a NaN or +inf target logit, a row that is all
-inf (-inf alone marks a masked token), a draft token outside [0, V), a NaN or negative q.
"""
from __future__ import annotations

import torch

from flashspec_core.processors.sampling import SamplingParams, logprobs_from_logits, sample_from_probs

PAD = -1  # fills `tokens` after the recovered or bonus token
# The Triton backend's refusal; without its host check a refused row's n_accepted is negative.
BAD_INPUT = "verify: target_logits hold NaN or +inf (or a row that is all -inf), or a draft token is outside [0, V)"


def _refuse_bad_input(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None
) -> None:
    """Raise ValueError naming the argument if the step has no well-defined law.

    target_logits: [B, γ+1, V]; draft_tokens: [B, γ] int64; draft_probs: [B, γ, V] or None.
    One pass over the logits and one host sync: a row's max is NaN if the row holds a NaN, +inf if
    it holds +inf and -inf if every token is masked, so a finite max says the row is usable.
    """
    vocab = target_logits.shape[-1]
    checks = {
        "target_logits hold NaN or +inf, or a row that is all -inf: the target has no distribution "
        "there (check the model's dtype and inputs; -inf alone is fine, it masks a token)":
            ~torch.isfinite(target_logits.amax(-1)).all(),
        f"draft_tokens: a draft token is outside [0, V) with V = {vocab}; the draft must use the "
        "target's vocabulary": ((draft_tokens < 0) | (draft_tokens >= vocab)).any(),
    }
    if draft_probs is not None:  # NaN fails ">= 0" too
        checks["draft_probs hold NaN or a negative value: q must be the distribution each draft "
               "token was drawn from"] = ~(draft_probs.amin(-1) >= 0).all()
    for message, bad in zip(checks, torch.stack(list(checks.values())).tolist()):
        if bad:
            raise ValueError(message)


def verify_torch(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingParams,
    uniforms: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification step.

    target_logits: [B, γ+1, V] target logits at the positions predicting each draft token and the bonus.
    draft_tokens:  [B, γ] int64 or int32 ids in [0, V).
    draft_probs:   [B, γ, V] the q each draft token was drawn from, or None for one-hot drafts.
    uniforms:      [B, γ+1] in [0, 1): γ acceptance tests, then the recovered or bonus draw.
    Returns n_accepted [B] int64 and tokens [B, γ+1] int64: the accepted draft tokens, then the
    recovered or bonus token, then PAD.
    """
    bsz, gamma_plus_1, _ = target_logits.shape
    gamma = gamma_plus_1 - 1
    positions = torch.arange(gamma_plus_1, device=target_logits.device)
    draft_tokens = draft_tokens.long()  # int32 ids index and scatter like int64 ones
    if sampling.greedy:
        _refuse_bad_input(target_logits, draft_tokens, None)
        target_tokens = target_logits.argmax(-1)  # no NaN left to win the argmax
        matches = (draft_tokens == target_tokens[:, :gamma]).long()
        n_accepted = matches.cumprod(-1).sum(-1)
        return n_accepted, target_tokens.masked_fill(positions > n_accepted[:, None], PAD)

    if uniforms is None:
        uniforms = torch.rand(
            (bsz, gamma_plus_1), generator=generator, device=target_logits.device
        )
    _refuse_bad_input(target_logits, draft_tokens, draft_probs)
    logp = logprobs_from_logits(target_logits, sampling)  # [B, γ+1, V]
    logp_draft = logp[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, γ]
    if draft_probs is None:
        logq_draft = torch.zeros_like(logp_draft)
    else:
        logq_draft = draft_probs.float().gather(-1, draft_tokens[..., None]).squeeze(-1).log()
    accept = (uniforms[:, :gamma].log() < logp_draft - logq_draft) & (logq_draft > float("-inf"))
    n_accepted = accept.long().cumprod(-1).sum(-1)  # [B]

    # The row at the stopping position: residual max(0, p - q) there, or p at the bonus position.
    rows = torch.arange(bsz, device=target_logits.device)
    p_stop = logp[rows, n_accepted].exp()  # [B, V]
    rejected = n_accepted < gamma
    if gamma > 0:
        stop_idx = n_accepted.clamp(max=gamma - 1)
        if draft_probs is None:
            q_stop = torch.zeros_like(p_stop).scatter_(-1, draft_tokens[rows, stop_idx][:, None], 1.0)
        else:
            q_stop = draft_probs[rows, stop_idx].float()
        residual = (p_stop - q_stop).clamp_(min=0.0)
        # p == q up to rounding leaves no residual mass; p itself is then the right law.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)
        p_stop = torch.where(rejected[:, None], residual, p_stop)
    last = sample_from_probs(p_stop, uniforms[:, gamma])  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_full((bsz, 1), PAD)], dim=1)
    tokens = tokens.scatter(1, n_accepted[:, None], last[:, None])
    return n_accepted, tokens.masked_fill(positions > n_accepted[:, None], PAD)
