"""BlockedLinear: the CPU linear the engine swaps in computes what nn.Linear computes."""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from torch import nn

from flashspec_core.cpu_linear import MAX_ROWS, BlockedLinear, use_blocked_linear


@pytest.mark.parametrize("shape", [(3,), (1, 1), (2, 5), (4, 4), (1, MAX_ROWS + 1), (2, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_blocked_linear_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 192, bias=bias)
    blocked = BlockedLinear(linear, block=64)
    x = torch.randn(*shape, 48)
    got = blocked(x)
    assert got.shape == (*shape, 192)
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


def test_swap_shares_parameters_and_keeps_the_model_output():
    model = tiny_llama(vocab=64, hidden=64, layers=2, seed=3)
    x = torch.randint(0, 64, (2, 7))
    with torch.inference_mode():
        before = model(x).logits
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    params = {id(p) for p in model.parameters()}
    assert use_blocked_linear(model) == n_linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert {id(p) for p in model.parameters()} == params, "the swap must not copy weights"
    assert use_blocked_linear(model) == 0, "a second swap finds nothing left to swap"
    with torch.inference_mode():
        torch.testing.assert_close(model(x).logits, before, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(x[:, :1]).logits, before[:, :1], rtol=1e-4, atol=1e-5)


class _QuantLinear(nn.Linear):
    """Stands for a quantized subclass (bitsandbytes' Linear4bit is one): it has its own kernel."""


def test_only_plain_fp32_linears_are_swapped():
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(8, 64).to(torch.bfloat16), _QuantLinear(8, 64),
                          nn.Linear(8, 7))
    assert use_blocked_linear(model) == 1
    assert [type(m).__name__ for m in model] == ["BlockedLinear", "Linear", "_QuantLinear", "Linear"]
