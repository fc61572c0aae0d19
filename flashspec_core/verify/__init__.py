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
VERIFY_BACKENDS = ("auto", "torch", "triton")  # the values of Backend


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


def triton_usable(target_logits: torch.Tensor) -> bool:
    """Whether the Triton backend takes these logits ([B, γ+1, V]; CUDA, or the CPU interpreter)."""
    try:
        from flashspec_core.verify import triton as triton_backend
    except ImportError:
        return False
    return triton_backend.supports(target_logits)


def pick_backend(backend: Backend, target_logits: torch.Tensor) -> Backend:
    """The backend that verifies these logits: "auto" is the Triton kernel on CUDA when it takes
    them, torch otherwise; a pinned backend is itself."""
    if backend == "auto":
        return "triton" if target_logits.is_cuda and triton_usable(target_logits) else "torch"
    return backend


def kernel_samples(sampling: SamplingParams, vocab: int) -> bool:
    """Whether the Triton backend draws this setting's tokens in its kernel: top-k and top-p need a
    sort or a threshold search per row and verify on torch ops instead (exact, slower)."""
    return sampling.greedy or not (0 < sampling.top_k < vocab or sampling.top_p < 1.0)


def draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The Philox seed the Triton verify draws from `generator` (None: torch's default CPU one), as
    a [1] int64 tensor on `device`: one draw per step, on the generator's own device, so a graph
    replay, a row verified alone and a row verified beside others consume its state alike."""
    if generator is not None and generator.device.type == "cuda":
        return torch.randint(0, 2**62, (1,), device=generator.device, generator=generator).to(device)
    return torch.randint(0, 2**62, (1,), generator=generator).to(device, non_blocking=True)


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingParams,
    uniforms: torch.Tensor | None = None,
    backend: Backend = "auto",
    generator: torch.Generator | None = None,
    check_finite: bool = True,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's draft and append the recovered or bonus token.

    target_logits: [B, γ+1, V]; draft_tokens: [B, γ]; draft_probs: [B, γ, V] or None (one-hot);
    uniforms: [B, γ+1] or None. Returns n_accepted [B] and tokens [B, γ+1] (PAD after the last).
    check_finite=False spares the Triton backend its host sync over the input's validity: a row
    it cannot verify then has a negative n_accepted, for the caller to refuse when it reads the
    result (the torch backend checks either way). seed: [1] or [B] int64 Philox seeds on the
    logits' device for the Triton backend (one per row: each row draws as it would alone); the
    torch backend takes `uniforms` instead.
    """
    if backend not in VERIFY_BACKENDS:
        raise ValueError(f"backend must be one of {VERIFY_BACKENDS}; got {backend!r}")
    _check_inputs(target_logits, draft_tokens, draft_probs, uniforms)
    backend = pick_backend(backend, target_logits)
    if seed is not None and backend != "triton":
        raise ValueError("seed: only the triton backend draws from seeds; give the torch backend uniforms")
    if backend == "triton":
        from flashspec_core.verify import triton as triton_backend

        return triton_backend.verify_triton(
            target_logits, draft_tokens, draft_probs, sampling, uniforms, generator, check_finite=check_finite,
            seed=seed)
    return verify_torch(target_logits, draft_tokens, draft_probs, sampling, uniforms, generator)


__all__ = ["BAD_INPUT", "PAD", "draw_seed", "kernel_samples", "pick_backend", "triton_usable", "verify", "verify_torch",
           "VERIFY_BACKENDS"]
