"""Properties of `verify` that hold for every input (Hypothesis).

Whatever the logits, draft, q, sampling and uniforms: the shapes are right, 0 <= n_accepted <= γ,
the output repeats the draft up to n_accepted, then one real token, then PAD; the same uniforms
give the same answer; the last token is possible under the law it is drawn from; greedy is argmax
matching; a token its draft could not have drawn (q = 0) is never accepted.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashspec_core.processors.sampling import SamplingParams, probs_from_logits
from flashspec_core.verify import PAD, verify

samplings = st.one_of(
    st.just(SamplingParams()),
    st.builds(SamplingParams, temperature=st.floats(0.2, 2.0), top_k=st.integers(0, 6),
              top_p=st.one_of(st.just(1.0), st.floats(0.3, 1.0))),
)


@st.composite
def verify_inputs(draw):
    """target_logits [B, γ+1, V], draft_tokens [B, γ], draft_probs [B, γ, V] | None, uniforms [B, γ+1]."""
    bsz, gamma, vocab = draw(st.integers(1, 4)), draw(st.integers(0, 6)), draw(st.integers(2, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, gamma + 1, vocab, generator=gen) * draw(st.floats(0.1, 5.0))
    if draw(st.booleans()):  # near-ties and repeated rows happen in real models
        logits = logits.round()
    draft = torch.randint(0, vocab, (bsz, gamma), generator=gen)
    probs = None
    if draw(st.booleans()):
        weights = torch.rand(bsz, gamma, vocab, generator=gen)
        weights = weights * (torch.rand(bsz, gamma, vocab, generator=gen) > draw(st.floats(0.0, 0.7)))
        weights[..., 0] += 1e-3  # every row has some mass
        probs = weights / weights.sum(-1, keepdim=True)
    uniforms = torch.rand(bsz, gamma + 1, generator=gen)
    return logits, draft, probs, uniforms, draw(samplings)


def _check_structure(n_acc, tokens, draft, vocab):
    bsz, gamma = draft.shape
    assert n_acc.shape == (bsz,) and n_acc.dtype == torch.int64
    assert tokens.shape == (bsz, gamma + 1) and tokens.dtype == torch.int64
    for b in range(bsz):
        n = int(n_acc[b])
        assert 0 <= n <= gamma
        assert tokens[b, :n].tolist() == draft[b, :n].tolist()
        assert 0 <= int(tokens[b, n]) < vocab
        assert (tokens[b, n + 1:] == PAD).all()


@settings(max_examples=120, deadline=None)
@given(verify_inputs())
def test_structure_and_determinism_under_fixed_uniforms(case):
    logits, draft, probs, uniforms, sampling = case
    n_acc, tokens = verify(logits, draft, probs, sampling, uniforms=uniforms, backend="torch")
    _check_structure(n_acc, tokens, draft, logits.shape[-1])
    again = verify(logits.clone(), draft.clone(), None if probs is None else probs.clone(), sampling,
                   uniforms=uniforms.clone(), backend="torch")
    assert torch.equal(n_acc, again[0]) and torch.equal(tokens, again[1])


@settings(max_examples=120, deadline=None)
@given(verify_inputs())
def test_accepted_tokens_are_possible_and_the_last_token_has_mass(case):
    logits, draft, probs, uniforms, sampling = case
    n_acc, tokens = verify(logits, draft, probs, sampling, uniforms=uniforms, backend="torch")
    p = probs_from_logits(logits, sampling)  # [B, γ+1, V]
    gamma = draft.shape[1]
    for b in range(draft.shape[0]):
        n = int(n_acc[b])
        for j in range(n):  # accepted: the target could emit it, and its draft could have drawn it
            assert p[b, j, draft[b, j]] > 0
            # (greedy verification is argmax matching and ignores q, as an honest greedy q is one-hot there)
            assert probs is None or sampling.greedy or probs[b, j, draft[b, j]] > 0
        last = int(tokens[b, n])
        if n == gamma:
            assert p[b, n, last] > 0, "bonus token outside the target's support"
        else:
            q = torch.zeros_like(p[b, n]) if probs is None else probs[b, n]
            if probs is None:
                q[draft[b, n]] = 1.0
            residual = (p[b, n] - q).clamp(min=0)
            law = residual if residual.sum() > 1e-6 else p[b, n]
            assert law[last] > 0, "recovered token outside max(0, p - q)"


@settings(max_examples=100, deadline=None)
@given(verify_inputs())
def test_greedy_accepts_exactly_the_matching_prefix_then_the_argmax(case):
    logits, draft, probs, uniforms, _ = case
    target = logits.argmax(-1)  # [B, γ+1]
    gamma = draft.shape[1]
    draft = torch.where(uniforms[:, :gamma] < 0.6, target[:, :gamma], draft)  # long matching prefixes too
    n_acc, tokens = verify(logits, draft, probs, SamplingParams(), uniforms=uniforms, backend="torch")
    for b in range(draft.shape[0]):
        match = 0
        while match < gamma and int(draft[b, match]) == int(target[b, match]):
            match += 1
        assert int(n_acc[b]) == match
        assert tokens[b, : match + 1].tolist() == target[b, : match + 1].tolist()


@settings(max_examples=100, deadline=None)
@given(verify_inputs(), st.integers(0, 5))
def test_a_draft_token_with_q_zero_is_never_accepted(case, position):
    logits, draft, probs, uniforms, sampling = case
    gamma = draft.shape[1]
    if gamma == 0 or sampling.greedy:
        return
    position = position % gamma
    vocab = logits.shape[-1]
    probs = torch.full((draft.shape[0], gamma, vocab), 1.0 / vocab) if probs is None else probs.clone()
    probs[:, position, :] = 0.0
    rows = torch.arange(draft.shape[0])
    probs[rows, position, (draft[:, position] + 1) % vocab] = 1.0  # all mass elsewhere
    uniforms = uniforms * 1e-6  # acceptance would otherwise be near certain
    n_acc, _ = verify(logits, draft, probs, sampling, uniforms=uniforms, backend="torch")
    assert (n_acc <= position).all()


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(2, 10), samplings)
def test_gamma_zero_emits_one_target_token(bsz, vocab, sampling):
    logits = torch.randn(bsz, 1, vocab)
    n_acc, tokens = verify(logits, torch.empty(bsz, 0, dtype=torch.long), None, sampling, backend="torch")
    assert n_acc.tolist() == [0] * bsz and tokens.shape == (bsz, 1)
    p = probs_from_logits(logits[:, 0], sampling)
    assert all(p[b, tokens[b, 0]] > 0 for b in range(bsz))
