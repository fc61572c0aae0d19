"""The one function that turns logits into the distribution a token is drawn from.

The target and every draft go through `logprobs_from_logits`, so the p the verifier tests against
and the q a draft claims are processed identically: temperature on the logits before the softmax,
then top-k, then top-p (nucleus) on what remains. The prefix-dependent processors (penalty.py,
ngram_ban.py) run before it, along each draft path. Temperature 0 means greedy: a one-hot
distribution at the argmax (first index on ties, as `torch.argmax` and HF `generate` pick; a NaN
logit is never the argmax). Everything computes in float32 whatever the logits' dtype, as HF
`generate` does (lower precision rounds ties into existence: docs/design.md, "Processors").
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

# Temperatures and penalties outside these bounds only produce overflow (logits / 1e-45 is ±inf
# and the softmax NaN) or a distribution indistinguishable from greedy or uniform. vLLM clamps
# temperatures below 0.01 for the same reason; here they are refused, so nothing is changed silently.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MIN_PENALTY, MAX_PENALTY = 0.01, 100.0
# Probabilities down to which a top-p nucleus is looked for among a row's tokens, in turn, before
# the whole vocabulary is sorted (`_outside_nucleus`).
NUCLEUS_FLOORS = (1e-5, 1e-8)


class SamplingParams(BaseModel):
    """How to sample. Validation errors are `ValueError`s naming the field; NaN and inf are refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    temperature: float = Field(
        default=0.0, ge=0.0, le=MAX_TEMPERATURE,
        description=f"0 means greedy; otherwise in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]",
    )
    top_k: int = Field(default=0, ge=0, description="0 disables; otherwise keep the k most likely tokens")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus mass in (0, 1]; 1 disables")
    seed: int | None = Field(
        default=None, ge=0, lt=2**64,
        description="seeds every random draw of a request; an int in [0, 2**64), None for fresh",
    )
    repetition_penalty: float = Field(
        default=1.0, ge=MIN_PENALTY, le=MAX_PENALTY,
        description="HF's CTRL penalty on tokens already in the sequence; 1 disables (penalty.py)",
    )
    no_repeat_ngram_size: int = Field(
        default=0, ge=0, description="ban tokens that would repeat an n-gram of the output; 0 disables (ngram_ban.py)"
    )

    @field_validator("temperature")
    @classmethod
    def _not_absurdly_small(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {value!r} is below {MIN_TEMPERATURE}: logits / T would overflow or be "
                "greedy in all but name; use temperature=0 for greedy decoding"
            )
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logprobs_from_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the processed distribution, -inf outside its support.

    logits: [..., V] any float dtype. Returns [..., V] float32.
    """
    logits = logits.float()
    if sampling.greedy:
        out = torch.full_like(logits, float("-inf"))
        return out.scatter_(-1, greedy_argmax(logits)[..., None], 0.0)
    logits = logits / sampling.temperature
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        logits = logits.masked_fill(_outside_nucleus(logits, sampling.top_p), float("-inf"))
    return logits.log_softmax(-1)


def _outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] bool: the tokens past the smallest prefix (most likely first) whose mass reaches
    `top_p`; the most likely token always stays. logits: [..., V] float32.

    On the CPU each row's prefix is looked for first among its tokens of probability at least
    each of `NUCLEUS_FLOORS` in turn (a compare against the row's log-sum-exp counts them; only
    that many are ranked): a nucleus is usually far smaller than the vocabulary, and sorting the
    whole vocabulary, or ranking a fixed thousand of it, costs a CPU more than the rest of a
    step's verification; only the rows whose nucleus reaches below the last floor, or with more
    than an eighth of the vocabulary above a floor, sort it all.
    The masses are the full softmax's either way, so the kept set is the same (up to rounding at
    the top_p boundary, and which of tied tokens comes first).
    """
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)  # [N, V]
    lse = rows.logsumexp(-1, keepdim=True)  # [N, 1]
    if rows.device.type != "cpu":  # an accelerator sorts fast, and rounds would make the host wait on it
        return _outside_among(rows, lse, top_p, vocab)[0].reshape(logits.shape)
    drop = torch.ones_like(rows, dtype=torch.bool)
    left = torch.arange(rows.shape[0], device=rows.device)  # rows whose nucleus is not found yet
    for floor in NUCLEUS_FLOORS:
        counts = (rows[left] >= lse[left] + math.log(floor)).sum(-1)  # [n] tokens above the floor
        few = counts <= vocab // 8  # ranking more of a row costs about what sorting it does
        if not few.any():
            break
        rows_few = left[few]
        found, fits = _outside_among(rows[rows_few], lse[rows_few], top_p, max(int(counts[few].max()), 1))
        drop[rows_few[fits]] = found[fits]
        left = torch.cat([left[~few], rows_few[~fits]])
        if not len(left):
            return drop.reshape(logits.shape)
    drop[left] = _outside_among(rows[left], lse[left], top_p, vocab)[0]
    return drop.reshape(logits.shape)


def _outside_among(rows: torch.Tensor, lse: torch.Tensor, top_p: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_outside_nucleus` of rows [N, V] (lse: [N, 1], their log-sum-exp) from their k most likely
    tokens: the mask [N, V], right for the rows whose nucleus ends within those k (fits: [N]
    bool; every row when k = V)."""
    values, order = torch.topk(rows, k, dim=-1)  # [N, k] most likely first
    probs = (values - lse).exp()  # [N, k] of the full softmax
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before >= top_p
    drop_sorted[:, 0] = False
    fits = drop_sorted[:, -1] | (k == rows.shape[-1])
    drop = torch.ones_like(rows, dtype=torch.bool)  # past the k candidates: dropped
    return drop.scatter_(-1, order, drop_sorted), fits


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of the largest logit, NaN never chosen (`torch.argmax` takes NaN as the max).

    logits: [..., V] any float dtype. Returns [...] int64. A row with no number at all gives 0;
    verification refuses such target rows before this (verify/reference.py), so only a draft's
    proposal can come from one, and the verifier then judges it.
    """
    return logits.float().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")).argmax(-1)


def probs_from_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Probabilities of the processed distribution. logits: [..., V] -> [..., V] float32."""
    return logprobs_from_logits(logits, sampling).exp()


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with given uniforms, so two backends can share the randomness.

    probs: [N, V] non-negative, need not be normalised (a residual max(0, p - q) is not);
    uniforms: [N] in [0, 1). Returns [N] int64: the first token with mass whose cumulative mass
    exceeds u * total. Never picks a zero-probability token.

    The sum runs in float64: in float32 the running sum drops masses below half its ulp, so at
    V ~ 10^5 any other summation order (the Triton kernel's block sums) picks another token in
    ~0.2 % of draws; in float64 the orders agree to ~1e-16 of the mass.
    """
    cdf = probs.double().cumsum(-1)  # [N, V]
    target = uniforms.double() * cdf[:, -1]  # [N]
    has_mass = probs > 0  # [N, V]
    # A parallel cumsum need not repeat the running sum exactly over zero-mass tokens: skip them.
    crossed = (cdf > target[:, None]) & has_mass
    first = crossed.int().argmax(-1)
    # No crossing (rounding, or no mass at all): take the last token with mass.
    last = probs.shape[-1] - 1 - has_mass.flip(-1).int().argmax(-1)
    return torch.where(crossed.any(-1), first, last)


def request_params(max_new_tokens: int, sampling: SamplingParams | dict[str, Any] | None,
                   stop: str | Sequence[str] | None) -> tuple[SamplingParams, tuple[str, ...]]:
    """A request's checked length limit, sampling (None and dicts accepted) and stop strings;
    ValueError naming the argument otherwise."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int; got {max_new_tokens!r}")
    if sampling is None:
        sampling = SamplingParams()
    elif isinstance(sampling, dict):
        sampling = SamplingParams(**sampling)
    elif not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams or a dict of its fields; got {type(sampling).__name__}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them; got {stop!r}")
    return sampling, stops


def request_generator(sampling: SamplingParams, device: torch.device, row: int = 0) -> torch.Generator:
    """The generator every random draw of one row of a request takes from: fresh, or seeded from
    the request's seed and the row's index. Row 0 takes the seed itself, so it draws as a request
    of one prompt with that seed does; row i > 0 a seed mixed from both (splitmix64), so rows of
    requests with nearby seeds do not share streams. Each row's draws never depend on the rows
    beside it."""
    gen = torch.Generator(device=device)
    if sampling.seed is None:
        gen.seed()
    else:
        gen.manual_seed(sampling.seed if row == 0 else _mix(sampling.seed, row))
    return gen


def _mix(seed: int, row: int) -> int:
    """splitmix64 of (seed, row): a 64-bit seed for row `row` of a request seeded with `seed`."""
    mask = (1 << 64) - 1
    z = (seed + row * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)
