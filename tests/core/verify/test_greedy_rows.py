"""Greedy rows of any draft lengths verified together (verify/greedy_rows.py) give, row by row,
what the reference's greedy branch gives each row alone, and refuse what it refuses."""
from __future__ import annotations

import pytest
import torch

from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.verify import BAD_INPUT, verify_torch
from flashspec_core.verify.greedy_rows import accept_greedy, greedy_targets

GREEDY = SamplingParams()


def _rows(seed: int, n: int, vocab: int = 6) -> tuple[list[torch.Tensor], list[list[int]]]:
    """n rows of 0..6 draft tokens over a small vocabulary of small integer logits (ties are
    common: the first index must win them), in bf16 and fp32; each draft follows the argmax for
    a random prefix, then leaves it."""
    gen = torch.Generator().manual_seed(seed)
    logits, drafts = [], []
    for k in range(n):
        g = int(torch.randint(0, 7, (1,), generator=gen))
        rows = torch.randint(-3, 3, (g + 1, vocab), generator=gen).float()
        rows = rows.to(torch.bfloat16) if k % 2 else rows
        best = rows.float().argmax(-1).tolist()
        keep = int(torch.randint(0, g + 1, (1,), generator=gen))
        drafts.append([best[j] if j < keep else (best[j] + 1) % vocab for j in range(g)])
        logits.append(rows)
    return logits, drafts


@pytest.mark.parametrize("seed", range(6))
def test_each_row_is_what_the_reference_gives_it_alone(seed):
    logits, drafts = _rows(seed, 9)
    got = accept_greedy(greedy_targets(logits).tolist(), drafts)
    for rows, draft, (n, tokens) in zip(logits, drafts, got):
        ref_n, ref_tokens = verify_torch(rows[None].float(), torch.tensor([draft], dtype=torch.long), None, GREEDY)
        assert n == int(ref_n)
        assert tokens == ref_tokens[0, :n + 1].tolist()


def test_ties_go_to_the_first_index():
    rows = torch.tensor([[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert accept_greedy(greedy_targets([rows]).tolist(), [[1]]) == [(1, [1, 0])]
    assert accept_greedy(greedy_targets([rows]).tolist(), [[2]]) == [(0, [1])]


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), "all -inf"])
def test_a_position_without_a_law_refuses_its_row_even_past_the_accepted_prefix(poison):
    rows = torch.tensor([[0.0, 3.0, 1.0], [4.0, 0.0, 1.0], [0.0, 0.0, 9.0]])  # argmax 1, 0, 2
    if poison == "all -inf":
        rows[2] = float("-inf")
    else:
        rows[2, 0] = poison
    good = torch.tensor([[0.0, 1.0, 0.0], [float("-inf"), 2.0, 0.0]])  # -inf alone masks a token: fine
    targets = greedy_targets([good, rows]).tolist()
    with pytest.raises(ValueError, match="target_logits hold NaN"):
        accept_greedy(targets, [[1], [5, 0]])  # row 2 rejects its first draft token
    assert accept_greedy(greedy_targets([good]).tolist(), [[1]]) == [(1, [1, 1])]
    assert BAD_INPUT.startswith("verify:")


def test_shapes_that_do_not_fit_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="logits"):
        greedy_targets([torch.zeros(4)])
    with pytest.raises(ValueError, match="targets"):
        accept_greedy([0, 1, 2], [[1]])
    assert greedy_targets([]).numel() == 0
