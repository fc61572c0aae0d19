"""`verify`: one speculative verification step, dispatched to a backend.

"torch" is the reference (reference.py). "triton" is the fused kernel (triton.py), used by "auto"
on CUDA when it is available; the dispatcher never trades exactness for speed.
"""
from __future__ import annotations

from typing import Literal

import torch

from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.verify.reference import BAD_INPUT, PAD, verify_torch

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


def _check_inputs(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor | None,
) -> None:
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, γ+1, V]; got shape {tuple(target_logits.shape)}")
    bsz, gp1, vocab = target_logits.shape
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor (int64); got {draft_tokens.dtype}")
    if tuple(draft_tokens.shape) != (bsz, gp1 - 1):
        raise ValueError(
            f"draft_tokens must be [B, γ] = {(bsz, gp1 - 1)} to match target_logits; "
            f"got {tuple(draft_tokens.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (bsz, gp1 - 1, vocab):
        raise ValueError(
            f"draft_probs must be [B, γ, V] = {(bsz, gp1 - 1, vocab)} or None for one-hot drafts; "
            f"got {tuple(draft_probs.shape)}"
        )
    if uniforms is not None and tuple(uniforms.shape) != (bsz, gp1):
        raise ValueError(f"uniforms must be [B, γ+1] = {(bsz, gp1)}; got {tuple(uniforms.shape)}")


def _triton_usable(target_logits: torch.Tensor) -> bool:
    try:
        from flashspec_core.verify import triton as triton_backend
    except ImportError:
        return False
    return triton_backend.supports(target_logits)


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingParams,
    uniforms: torch.Tensor | None = None,
    backend: Backend = "auto",
    generator: torch.Generator | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's draft and append the recovered or bonus token.

    target_logits: [B, γ+1, V]; draft_tokens: [B, γ]; draft_probs: [B, γ, V] or None (one-hot);
    uniforms: [B, γ+1] or None. Returns n_accepted [B] and tokens [B, γ+1] (PAD after the last).
    check_finite=False spares the Triton backend its host sync over the input's validity: a row
    it cannot verify then has a negative n_accepted, for the caller to refuse when it reads the
    result (the torch backend checks either way).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    _check_inputs(target_logits, draft_tokens, draft_probs, uniforms)
    if backend == "auto":
        backend = "triton" if target_logits.is_cuda and _triton_usable(target_logits) else "torch"
    if backend == "triton":
        from flashspec_core.verify import triton as triton_backend

        return triton_backend.verify_triton(
            target_logits, draft_tokens, draft_probs, sampling, uniforms, generator, check_finite=check_finite
        )
    return verify_torch(target_logits, draft_tokens, draft_probs, sampling, uniforms, generator)


__all__ = ["BAD_INPUT", "PAD", "verify", "verify_torch", "BACKENDS"]
