"""CachedModel: after any history of rollbacks, each row's logits equal a fresh forward of its sequence.

Rows of a batch roll back by different amounts, leaving masked holes below slots that other rows
still need; positions then come from the count of valid slots. A mistake there (a stale slot, an
off-by-one position, a hole attended to) changes the logits, which this compares against the
plain model run on each row alone, without padding or cache.
"""
from __future__ import annotations

import pytest
import torch
from helpers import one_thread, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from flashspec_core.backends.hf import CachedModel
from flashspec_core.backends.prefix import common_prefix

VOCAB = 16


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=3, layers=2)


@torch.no_grad()
def _fresh(model, seq: list[int], keep: int) -> torch.Tensor:
    """Logits after each of the last `keep` tokens of seq, from a plain forward: [keep, V]."""
    return model(input_ids=torch.tensor([seq])).logits[0, -keep:]


def _check(model, runner: CachedModel, seqs: list[list[int]], active: list[bool], keep: int) -> None:
    logits = runner.forward_to(seqs, active, keep_logits=keep)
    assert logits.shape == (len(seqs), keep, VOCAB)
    for b, seq in enumerate(seqs):
        if active[b]:
            torch.testing.assert_close(logits[b], _fresh(model, seq, keep), atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"row {b}: {m}")


def test_rollback_with_holes_matches_a_fresh_forward(model):
    runner = CachedModel(model, pad_token_id=0)
    runner.reset(3)
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]
    _check(model, runner, seqs, [True] * 3, keep=2)
    # Row 0 rejects 3 tokens (holes below row 2's new slots), row 1 grows, row 2 swaps its last token.
    seqs = [[1, 2, 3, 9], [7, 8, 1, 2, 3, 4, 5], [9, 10, 11, 5, 6, 7, 8, 1]]
    _check(model, runner, seqs, [True] * 3, keep=3)
    seqs = [[1, 2, 3, 9, 4, 4], [7, 8, 1], [9, 10, 11, 5, 6, 7, 8, 1, 2]]
    _check(model, runner, seqs, [True, True, True], keep=1)


def test_inactive_rows_are_untouched_and_resume_later(model):
    runner = CachedModel(model, pad_token_id=0)
    runner.reset(2)
    _check(model, runner, [[1, 2, 3], [4, 5, 6, 7]], [True, True], keep=1)
    # Row 1 is finished: whatever it is passed is ignored.
    _check(model, runner, [[1, 2, 3, 8, 9], [0, 0]], [True, False], keep=2)
    _check(model, runner, [[1, 2, 3, 8, 1], [4, 5, 6, 7, 2]], [True, True], keep=2)


def test_a_row_shorter_than_keep_logits_is_a_value_error(model):
    runner = CachedModel(model, pad_token_id=0)
    runner.reset(1)
    with pytest.raises(ValueError, match="sequences"):
        runner.forward_to([[1]], keep_logits=2)


@st.composite
def histories(draw):
    """Start sequences, then rounds of (per-row (active, tokens cut, tokens added), keep_logits)."""
    bsz = draw(st.integers(1, 4))
    tokens = st.integers(0, VOCAB - 1)
    start = [draw(st.lists(tokens, min_size=1, max_size=6)) for _ in range(bsz)]
    rounds = []
    for _ in range(draw(st.integers(1, 5))):
        ops = [(draw(st.booleans()), draw(st.integers(0, 6)), draw(st.lists(tokens, max_size=5))) for _ in range(bsz)]
        rounds.append((ops, draw(st.integers(1, 3))))
    return start, rounds


@settings(max_examples=60, deadline=None)
@given(histories())
def test_any_history_of_rollbacks_matches_a_fresh_forward(model, history):
    start, rounds = history
    with one_thread():
        runner = CachedModel(model, pad_token_id=0)
        runner.reset(len(start))
        seqs = [list(s) for s in start]
        _check(model, runner, seqs, [True] * len(seqs), keep=1)
        for ops, keep in rounds:
            active = [a for a, _, _ in ops]
            active[0] = True  # the engine never steps a batch with no active row
            passed = []
            for b, (_, cut, add) in enumerate(ops):
                if active[b]:
                    new = seqs[b][: max(0, len(seqs[b]) - cut)] + add
                    seqs[b] = new + [1] * max(0, keep - len(new))
                    passed.append(seqs[b])
                else:
                    passed.append(seqs[b][:1] + add)  # junk: an inactive row's input is ignored
            _check(model, runner, passed, active, keep)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=200), st.lists(st.integers(0, 3), max_size=150),
       st.lists(st.integers(0, 3), max_size=150))
def test_common_prefix_is_the_length_of_the_longest_shared_head(head, a, b):
    """Differences near the ends (walked) and far before them (bisected: tails past 64 tokens)."""
    a, b = head + a, head + b
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix(a, b) == common_prefix(tuple(a), b) == n


def test_common_prefix_finds_a_difference_far_from_the_ends():
    """Rows that part long before their ends (the bisection), at every position."""
    a = list(range(400))
    for k in range(400):
        b = a[:k] + [-1] + a[k + 1:]
        assert common_prefix(a, b) == common_prefix(b, a) == k
