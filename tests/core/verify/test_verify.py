"""`verify` on hand-computed cases: the acceptance rule, the residual, the bonus token, bad input.

The statistical tests (test_exactness.py) show the law is right on average; these pin down each
branch with fixed uniforms so a failure names the broken rule.
"""
from __future__ import annotations

import pytest
import torch

from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.verify import PAD, verify

T1 = SamplingParams(temperature=1.0)


def _logits(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax at temperature 1 is exactly each given distribution: [1, len(rows), V]."""
    return torch.tensor(rows, dtype=torch.float64).log().float()[None]


def _run(logits, draft, q, u):
    """verify on one row. draft: [γ] token ids; q: [γ, V] or None; u: [γ+1] uniforms."""
    probs = None if q is None else torch.tensor(q, dtype=torch.float32)[None]
    tokens = torch.tensor([draft], dtype=torch.long)
    n, tokens = verify(logits, tokens, probs, T1, uniforms=torch.tensor([u]), backend="torch")
    return int(n[0]), tokens[0].tolist()


def test_one_hot_draft_is_accepted_with_probability_p():
    logits = _logits([0.3, 0.7], [0.5, 0.5])
    assert _run(logits, [0], None, [0.29, 0.0])[0] == 1
    n, tokens = _run(logits, [0], None, [0.31, 0.0])
    # Rejected: the recovered token comes from max(0, p - onehot(0)) = [0, 0.7]: token 1 whatever u.
    assert (n, tokens) == (0, [1, PAD])


def test_model_draft_is_accepted_with_probability_p_over_q():
    logits = _logits([0.25, 0.75], [0.5, 0.5])
    q = [[0.5, 0.5]]
    assert _run(logits, [0], q, [0.49, 0.0])[0] == 1  # p/q = 0.5
    assert _run(logits, [0], q, [0.51, 0.0]) == (0, [1, PAD])  # residual [0, 0.25]
    assert _run(logits, [1], q, [0.99, 0.0])[0] == 1  # p/q > 1: always accepted


def test_residual_is_max_of_zero_and_p_minus_q_renormalised():
    logits = _logits([0.5, 0.2, 0.3], [1 / 3, 1 / 3, 1 / 3])
    q = [[0.8, 0.2, 0.0]]  # residual: [0, 0, 0.3] -> token 2 always
    for u in (0.0, 0.5, 0.999):
        assert _run(logits, [0], q, [0.99, u]) == (0, [2, PAD])


def test_a_draft_token_with_q_zero_is_rejected_even_when_p_is_one():
    logits = _logits([1.0 - 1e-7, 1e-7], [0.5, 0.5])
    q = [[0.0, 1.0]]  # claims token 0 could not have been drawn
    n, tokens = _run(logits, [0], q, [0.0, 0.3])
    assert n == 0 and tokens[0] == 0  # recovered from the residual max(0, p - q) = p on token 0


def test_a_draft_token_outside_the_targets_support_is_rejected():
    logits = _logits([0.6, 0.4, 0.0], [0.5, 0.5, 0.0])
    assert _run(logits, [2], None, [0.0, 0.7]) == (0, [1, PAD])  # residual = p: cdf [0.6, 1.0, 1.0]
    assert _run(logits, [2], None, [0.0, 0.2]) == (0, [0, PAD])


def test_all_accepted_appends_the_bonus_token_from_the_last_position():
    logits = _logits([0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5])
    for u_last, bonus in ((0.1, 0), (0.3, 1), (0.6, 2)):
        assert _run(logits, [0, 1], None, [0.1, 0.5, u_last]) == (2, [0, 1, bonus])


def test_rejection_in_the_middle_pads_after_the_recovered_token():
    logits = _logits([0.9, 0.1], [0.1, 0.9], [0.5, 0.5], [0.5, 0.5])
    assert _run(logits, [0, 0, 1], None, [0.5, 0.5, 0.0, 0.0]) == (1, [0, 1, PAD, PAD])


def test_gamma_zero_samples_one_token_from_the_target():
    logits = _logits([0.25, 0.75])
    assert _run(logits, [], None, [0.2]) == (0, [0])
    assert _run(logits, [], None, [0.3]) == (0, [1])


def test_draft_equal_to_target_is_always_accepted():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5, 11, generator=gen)
    q = torch.softmax(logits[:, :4], -1)
    draft = torch.multinomial(q.reshape(-1, 11), 1, generator=gen).view(64, 4)
    n, _ = verify(logits, draft, q, T1, backend="torch", generator=gen)
    assert (n == 4).all()


def test_greedy_is_exact_argmax_matching():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]],
                           [[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    draft = torch.tensor([[1, 0], [1, 2]])
    n, tokens = verify(logits, draft, None, SamplingParams(), backend="torch")
    assert n.tolist() == [2, 1]
    assert tokens.tolist() == [[1, 0, 2], [1, 0, PAD]]


def test_rows_of_a_batch_are_independent():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 4, 9, generator=gen)
    draft = torch.randint(0, 9, (5, 3), generator=gen)
    q = torch.softmax(torch.randn(5, 3, 9, generator=gen), -1)
    u = torch.rand(5, 4, generator=gen)
    n, tokens = verify(logits, draft, q, T1, uniforms=u, backend="torch")
    for b in range(5):
        nb, tb = verify(logits[b:b + 1], draft[b:b + 1], q[b:b + 1], T1, uniforms=u[b:b + 1], backend="torch")
        assert nb.tolist() == n[b:b + 1].tolist() and tb.tolist() == tokens[b:b + 1].tolist()


def test_same_generator_seed_gives_the_same_result():
    logits = torch.randn(8, 4, 7)
    draft = torch.randint(0, 7, (8, 3))
    runs = [verify(logits, draft, None, T1, backend="torch", generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("kwargs, name", [
    (dict(target_logits=torch.zeros(2, 3)), "target_logits"),
    (dict(draft_tokens=torch.zeros(2, 3, dtype=torch.long)), "draft_tokens"),
    (dict(draft_probs=torch.zeros(2, 2, 4)), "draft_probs"),
    (dict(uniforms=torch.zeros(2, 2)), "uniforms"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(target_logits=torch.zeros(2, 3, 5), draft_tokens=torch.zeros(2, 2, dtype=torch.long),
                draft_probs=None, sampling=T1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        verify(**args)


@pytest.mark.parametrize("sampling", [SamplingParams(), T1], ids=["greedy", "T1"])
def test_int32_draft_tokens_give_what_int64_ones_give(sampling):
    """verify() accepted int32 ids, then crashed in `scatter` (issue 15)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4, 9, generator=gen)
    draft = logits[:, :3].argmax(-1)  # greedy accepts some of them
    u = torch.rand(6, 4, generator=gen)
    want = verify(logits, draft, None, sampling, uniforms=u, backend="torch")
    got = verify(logits, draft.int(), None, sampling, uniforms=u, backend="torch")
    assert got[1].dtype == torch.int64
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
