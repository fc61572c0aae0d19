"""Triton backend for `verify`: the whole verification step in one kernel launch (triton_kernel.py).

With shared `uniforms` it returns what `verify_torch` returns (acceptance rule, residual and its
fall-back, inverse CDF in float64, temperature rounding); only summation orders differ, so a
decision flips only for a uniform within a few ulps of a boundary. Top-k and top-p go to
`verify_torch`, and `supports` is False for what the kernel does not take. NaN or +inf logits, all
-inf rows and draft tokens outside [0, V) give n_accepted = -1 and PAD; `check_finite=True` makes
that a ValueError (one host sync, skipped under graph capture). T comes from `sampling` or per
sequence from a device tensor; one workspace per device: call once before capture.
"""
from __future__ import annotations

import math
import os

import torch
import triton

from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.verify import kernel_samples
from flashspec_core.verify.reference import BAD_INPUT, PAD, verify_torch
from flashspec_core.verify.triton_kernel import PAD_TOKEN, WS_SLOTS, verify_kernel

assert PAD == PAD_TOKEN.value, "the kernel's PAD must be the reference's"

MAX_VOCAB = 1 << 20
MAX_ROWS = 32  # γ + 1; the issue asks for γ <= 16
MAX_BATCH = 1 << 16  # the Philox offset packs the sequence index into 16 bits
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WORKSPACES: dict[int, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown workspaces: CUDA graphs captured on them still use them

# The scale for the launch plan: the resident programs of a large GPU (132 SMs x 8 programs of 8 warps).
_RESIDENT = 1056


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(target_logits: torch.Tensor) -> bool:
    """Whether the kernel takes these logits (target_logits: [B, γ+1, V]); otherwise use torch."""
    if target_logits.dim() != 3 or target_logits.dtype not in _DTYPES:
        return False
    bsz, rows, vocab = target_logits.shape
    if not (1 <= rows <= MAX_ROWS and 1 <= vocab <= MAX_VOCAB and bsz <= MAX_BATCH):
        return False
    return target_logits.is_cuda or (_interpreting() and target_logits.device.type == "cpu")


def _workspace(device: torch.device, bsz: int) -> torch.Tensor:
    """The self-resetting int32 counters: [ticket, then per sequence WS_SLOTS ints]."""
    need = 1 + WS_SLOTS * bsz
    if device.type != "cuda":
        return torch.zeros(need, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    ws = _WORKSPACES.get(index)
    if ws is None or ws.numel() < need:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "verify_triton: call it once with this batch size before CUDA-graph capture "
                "(that allocates its workspace and compiles the kernel)"
            )
        if ws is not None:
            _RETIRED.append(ws)
        ws = torch.zeros(1 + WS_SLOTS * max(bsz, 256), dtype=torch.int32, device=device)
        _WORKSPACES[index] = ws
    return ws


def _plan(bsz: int, rows: int, vocab: int, block: int | None, tiles: int | None) -> tuple[int, int]:
    """BLOCK (elements per tile) and TILES (tiles per phase-1 program).

    Small problems get one tile per program, so that even B = 1 spreads over many SMs; large ones
    give each program several tiles, so that the partials and atomics stay few.
    """
    if block is None:
        block = 4096 if vocab >= 4096 else max(128, triton.next_power_of_2(vocab))
    if tiles is None:
        total = bsz * rows * triton.cdiv(vocab, block)
        tiles = max(1, min(16, total // (4 * _RESIDENT)))
    return block, tiles


def verify_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingParams,
    uniforms: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    check_finite: bool = True,
    seed: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    block: int | None = None,
    tiles: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification step in one kernel launch; same contract as `verify_torch`.

    target_logits: [B, γ+1, V] bf16/fp16/fp32; draft_tokens: [B, γ] int;
    draft_probs: [B, γ, V] float or None (one-hot drafts); uniforms: [B, γ+1] in [0, 1) or None.
    check_finite: raise ValueError on NaN/+inf logits (one host sync; skipped under graph capture);
    False leaves the test to the caller, which finds such rows' n_accepted negative (`BAD_INPUT`).
    seed: [1] or [B] int64 on the logits' device, the Philox seed when sampling without
    `uniforms` (instead of one drawn from `generator`): a CUDA graph captures the pointer, and the
    caller copies a seed drawn from the request's generator into it before each replay. [B]: a
    seed per sequence, whose draws then do not depend on its index in the batch (a row verified
    beside others samples what it samples alone with that seed).
    temperature: [B] float32 on the logits' device, each sequence's T (> 0), read by the kernel
    instead of `sampling.temperature`: a CUDA graph captures the pointer, so one graph serves every
    temperature, and rows of different temperatures share a launch. A sequence gets exactly what a
    launch at its temperature alone gives (`sampling` still picks greedy or not, and top-k / top-p,
    which take no tensor). A temperature that is not positive and finite poisons its sequence as
    NaN logits do (check_finite: a ValueError naming it).
    block, tiles: launch-plan overrides for tuning and tests; None picks them from the shape.
    Returns n_accepted [B] int64 and tokens [B, γ+1] int64 (PAD after the recovered/bonus token).
    """
    vocab = target_logits.shape[-1]
    if temperature is not None and (sampling.greedy or not kernel_samples(sampling, vocab)):
        raise ValueError("temperature: a tensor of temperatures is for sampled steps the kernel draws; "
                         "greedy, top-k and top-p take theirs from `sampling`")
    if not kernel_samples(sampling, vocab):  # the documented fall-back
        if seed is not None and uniforms is None:
            raise ValueError("seed: top-k and top-p verify on torch ops, which draw from uniforms or a "
                             "generator; pass one of those for this setting")
        return verify_torch(target_logits, draft_tokens, draft_probs, sampling, uniforms, generator)
    if not supports(target_logits):
        raise ValueError(
            "verify_triton takes [B, γ+1, V] bf16/fp16/fp32 logits on CUDA (or on the CPU under "
            f"TRITON_INTERPRET=1) with γ+1 <= {MAX_ROWS}, V <= {MAX_VOCAB}, B <= {MAX_BATCH}; got "
            f"{tuple(target_logits.shape)} {target_logits.dtype} on {target_logits.device}"
        )
    bsz, rows, _ = target_logits.shape
    gamma = rows - 1
    device = target_logits.device
    if temperature is not None and (temperature.shape != (bsz,) or temperature.dtype != torch.float32
                                    or temperature.device != device):
        raise ValueError(f"temperature: must be [B] = [{bsz}] float32 on {device}; got "
                         f"{tuple(temperature.shape)} {temperature.dtype} on {temperature.device}")
    n_acc = torch.empty(bsz, dtype=torch.int64, device=device)
    tokens = torch.empty(bsz, rows, dtype=torch.int64, device=device)
    if bsz == 0:
        return n_acc, tokens

    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    drafts = draft_tokens.to(torch.int64)
    if gamma == 0:
        drafts = n_acc.view(bsz, 1)  # never read; avoids passing a pointer to an empty tensor
    elif drafts.stride(-1) != 1:
        drafts = drafts.contiguous()
    one_hot = draft_probs is None or gamma == 0
    q = logits if one_hot or draft_probs is None else draft_probs  # (one_hot covers None; the test narrows)
    if q.stride(-1) != 1:
        q = q.contiguous()
    has_u = uniforms is not None and not sampling.greedy
    u = uniforms.to(torch.float32) if has_u and uniforms is not None else n_acc.view(bsz, 1)
    if u.stride(-1) != 1:
        u = u.contiguous()
    seed_from_ptr = False
    seed_t = n_acc
    host_seed = 1
    seed_stride = 0
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not has_u and not sampling.greedy:
        if seed is not None:
            if seed.shape not in ((1,), (bsz,)) or seed.dtype != torch.int64 or seed.device != device:
                raise ValueError(f"seed: must be [1] or [B] = [{bsz}] int64 on {device}; got "
                                 f"{tuple(seed.shape)} {seed.dtype} on {seed.device}")
            seed_t, seed_from_ptr, seed_stride = seed, True, int(seed.shape[0] == bsz > 1)
        elif generator is not None and generator.device.type == "cuda":
            seed_t = torch.randint(0, 2**62, (1,), device=generator.device, generator=generator)
            seed_from_ptr = True
        else:
            host_seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())

    block, tiles = _plan(bsz, rows, vocab, block, tiles)
    n_tiles = triton.cdiv(vocab, block)
    n_chunks = triton.cdiv(n_tiles, tiles)
    per_seq1 = rows * n_chunks
    per_seq2 = 0 if sampling.greedy else n_tiles
    lag = max(1, min(bsz, triton.cdiv(2 * _RESIDENT, per_seq1)))
    ws = _workspace(device, bsz)
    # float32 partials and stop values, one float32 of padding, then float64 tile masses [B, NT, 2]
    fs = torch.empty(2 * bsz * per_seq1 + 3 * bsz + 1 + 4 * bsz * n_tiles, dtype=torch.float32, device=device)
    is_ = torch.empty(2 * bsz * per_seq1 + 2 * bsz, dtype=torch.int32, device=device)
    # The kernel derives 1/T and log2(e)/T from T itself (float32), for one T or one per sequence.
    temp_t = n_acc if temperature is None else temperature
    one_t = 1.0 if sampling.greedy else sampling.temperature

    verify_kernel[(bsz * (per_seq1 + per_seq2),)](
        logits, logits.stride(0), logits.stride(1),
        drafts, drafts.stride(0),
        q, q.stride(0), q.stride(1),
        u, u.stride(0),
        seed_t, host_seed, seed_stride, int(capturing and not seed_from_ptr),
        ws, fs, is_, n_acc, tokens,
        temp_t, one_t,
        bsz, gamma, vocab, n_chunks, tiles, n_tiles, lag,
        BLOCK=block,
        GP=triton.next_power_of_2(rows),
        NCP=triton.next_power_of_2(n_chunks),
        NTP=triton.next_power_of_2(n_tiles),
        GREEDY=sampling.greedy,
        ONE_HOT=one_hot,
        HAS_U=has_u,
        SEED_FROM_PTR=seed_from_ptr,
        T_FROM_PTR=temperature is not None,
        RECIP=device.type == "cuda",
        num_warps=8 if block >= 2048 else 4,
    )
    if check_finite and not capturing:
        if bool((n_acc < 0).any()):
            if temperature is not None and not bool(((temperature > 0) & (temperature < math.inf)).all()):
                raise ValueError("temperature: each must be positive and finite; got "
                                 f"{temperature.tolist()}")
            raise ValueError(BAD_INPUT)
    return n_acc, tokens


__all__ = ["supports", "verify_triton", "MAX_VOCAB", "MAX_ROWS", "MAX_BATCH"]
