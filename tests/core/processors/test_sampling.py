"""The shared logits -> distribution function against the one HF `generate` samples through.

Target and drafts both go through `flashspec_core.processors.sampling`; if it processed temperature, top-k or
top-p differently from transformers, the engine would be exact with respect to the wrong law.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import reference_probs
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import flashspec_core.processors.sampling as sampling_module
from flashspec_core.processors.sampling import (
    SamplingParams,
    greedy_argmax,
    logprobs_from_logits,
    probs_from_logits,
    sample_from_probs,
)


@st.composite
def logits_and_params(draw):
    """Distinct logits (gaps >= 1e-3: ties would make top-p order-dependent) and sampling params."""
    vocab = draw(st.integers(2, 40))
    gaps = draw(st.lists(st.floats(1e-3, 1.0), min_size=vocab, max_size=vocab))
    order = draw(st.permutations(range(vocab)))
    values = torch.tensor(gaps, dtype=torch.float64).cumsum(0) - draw(st.floats(0.0, 40.0))
    logits = values[list(order)].float()
    sampling = SamplingParams(
        temperature=draw(st.floats(0.1, 3.0)),  # logits / T stays within float64 exp range
        top_k=draw(st.integers(0, vocab + 2)),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0))),
    )
    return logits, sampling


def _near_top_p_boundary(logits: torch.Tensor, sampling: SamplingParams) -> bool:
    """True when a cumulative mass lands within rounding of top_p (both answers are then right)."""
    if sampling.top_p >= 1.0:
        return False
    scores = logits.double() / sampling.temperature
    if 0 < sampling.top_k < len(scores):
        scores = torch.topk(scores, sampling.top_k).values
    mass = torch.sort(scores.softmax(-1), descending=True).values.cumsum(-1)
    return bool((mass - sampling.top_p).abs().min() < 1e-4)


@settings(max_examples=300, deadline=None)
@given(logits_and_params())
def test_probs_match_transformers_warpers(case):
    logits, sampling = case
    assume(not _near_top_p_boundary(logits, sampling))
    ours = probs_from_logits(logits[None], sampling)[0].double().numpy()
    theirs = reference_probs(logits[None], sampling)[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=2e-6)  # float32 logits / small T: ~1e-5 relative
    support = torch.isfinite(logprobs_from_logits(logits[None], sampling)[0]).numpy()  # exp may underflow
    assert (support == (theirs > 0)).all(), "supports differ"


@settings(max_examples=100, deadline=None)
@given(logits_and_params())
def test_logprobs_are_normalised_and_minus_inf_outside_the_support(case):
    logits, sampling = case
    logp = logprobs_from_logits(logits[None].repeat(3, 1), sampling)  # batch dims are preserved
    assert logp.shape == (3, len(logits)) and logp.dtype == torch.float32
    assert torch.allclose(logp.exp().sum(-1), torch.ones(3), atol=1e-5)
    assert not torch.isnan(logp).any()
    if sampling.top_k:
        assert int(torch.isfinite(logp[0]).sum()) <= max(sampling.top_k, 1)


def test_greedy_is_one_hot_at_the_first_argmax_and_ignores_top_k_and_top_p():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 5.0]])
    for sampling in (SamplingParams(), SamplingParams(temperature=0.0, top_k=1, top_p=0.1)):
        probs = probs_from_logits(logits, sampling)
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_temperature_applies_before_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, (logits / 0.5).softmax(-1))


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass_and_always_the_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.75)) > 0
    assert kept.tolist() == [[True, True, False, False]]
    kept = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.01)) > 0
    assert kept.tolist() == [[True, False, False, False]]


def _sorted_nucleus(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """By a sort of the whole vocabulary in float64: the nucleus ([N, V] bool) and each token's
    mass before it ([N, V]); what the top-k candidates must find."""
    values, order = torch.sort(logits.double(), dim=-1, descending=True)
    probs = values.softmax(-1)
    before = probs.cumsum(-1) - probs
    keep = before < top_p
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(-1, order, keep), torch.zeros_like(before).scatter_(-1, order, before)


@pytest.mark.parametrize("spread", [8.0, 3.0, 0.3])  # nuclei of a few tokens to most of the vocabulary
def test_top_p_over_a_large_vocabulary_keeps_the_nucleus_a_full_sort_finds(spread, monkeypatch):
    """At a real vocabulary's size the nucleus is looked for among the tokens above a probability
    floor first: it must be the set a full sort gives (up to float32 rounding of the mass at the
    top_p boundary), in rows whose nucleus lies above the floor and in rows of the same call
    whose nucleus does not (the flat row: every floor fails, the whole vocabulary is sorted)."""
    ranked: list[int] = []  # how many tokens each candidate ranking took
    among = sampling_module._outside_among

    def counted(rows: torch.Tensor, lse: torch.Tensor, top_p: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ranked.append(k)
        return among(rows, lse, top_p, k)

    monkeypatch.setattr(sampling_module, "_outside_among", counted)
    generator = torch.Generator().manual_seed(int(spread * 10))
    logits = torch.randn(6, 50_000, generator=generator) * spread
    logits[3] *= 0.05  # one nearly flat row beside the others: its nucleus spans most of the vocabulary
    for top_p in (0.5, 0.9, 0.99):
        kept = torch.isfinite(logprobs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p)))
        nucleus, before = _sorted_nucleus(logits, top_p)
        differ = kept != nucleus
        assert ((before[differ] - top_p).abs() < 1e-4).all(), f"spread {spread}, top_p {top_p}: off the boundary"
        assert differ.sum() <= 2
    assert 50_000 in ranked  # the flat row's full sort
    assert min(ranked) < 50_000 or spread < 1  # the other rows' nuclei found among the candidates


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 5.0)), min_size=1, max_size=20),
       st.floats(0.0, 1.0, exclude_max=True, width=32))  # what torch.rand can return: [0, 1) in float32
def test_sample_from_probs_never_picks_a_zero_probability_token(weights, u):
    probs = torch.tensor([weights])
    assume(float(probs.sum()) > 1e-3)
    token = int(sample_from_probs(probs, torch.tensor([u]))[0])
    assert 0 <= token < len(weights) and weights[token] > 0


def test_sample_from_probs_is_inverse_cdf_of_unnormalised_weights():
    probs = torch.tensor([[0.0, 2.0, 0.0, 6.0]] * 4)  # mass 0.25 on token 1, 0.75 on token 3
    uniforms = torch.tensor([0.0, 0.2499, 0.2501, 0.9999])
    assert sample_from_probs(probs, uniforms).tolist() == [1, 1, 3, 3]


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2),
    # Non-finite or absurd values: 1e-45 overflowed logits / T to inf and the engine emitted
    # token V-1 from a NaN distribution; inf and NaN reached the processors unchecked.
    ("temperature", 1e-45), ("temperature", 0.001), ("temperature", float("inf")), ("temperature", float("nan")),
    ("temperature", 1e6), ("top_p", float("nan")), ("repetition_penalty", float("inf")),
    ("repetition_penalty", 1e-30), ("repetition_penalty", float("nan")),
    ("seed", 2**64), ("seed", -1),  # 2**64 failed in torch with "Overflow when unpacking long long"
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_the_temperature_bounds_and_the_largest_seed_are_accepted():
    for temperature in (0.0, 0.01, 100.0):
        assert SamplingParams(temperature=temperature).temperature == temperature
    seed = 2**64 - 1
    torch.Generator().manual_seed(SamplingParams(seed=seed).seed)  # what the engine does with it


def test_greedy_never_picks_a_nan():
    """torch.argmax takes NaN as the maximum; a draft's greedy proposal must not."""
    logits = torch.tensor([[1.0, float("nan"), 3.0, 2.0], [float("nan")] * 4])
    assert probs_from_logits(logits, SamplingParams()).argmax(-1).tolist() == [2, 0]
    assert greedy_argmax(logits.bfloat16()).tolist() == [2, 0]


def test_sampling_params_reject_unknown_fields():
    with pytest.raises(ValueError, match="top_n"):
        SamplingParams(top_n=5)
