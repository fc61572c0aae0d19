"""PackedLinear: the CPU linear the engine swaps in computes what nn.Linear computes."""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from torch import nn

from flashspec_core.backends.cpu_linear import PACKED, STOCK, PackedLinear, packing_available, use_packed_linear

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("shape", [(3,), (1, 1), (2, 5), (4, 4), (1, 17), (2, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 192, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape, 48)
    with torch.inference_mode():
        got = packed(x)
        assert got.shape == (*shape, 192)
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed(x.transpose(0, -2).contiguous().transpose(0, -2)), linear(x),
                                   rtol=1e-5, atol=1e-5)  # a non-contiguous input


def test_packed_copy_follows_the_weight():
    """A weight replaced (a trained draft's head per request) or edited in place is re-packed."""
    torch.manual_seed(1)
    linear = nn.Linear(16, 64, bias=False)
    packed = PackedLinear(linear)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        packed(x)
    packed.weight = nn.Parameter(torch.randn(32, 16), requires_grad=False)
    packed.out_features = 32
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), x @ packed.weight.T, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        packed.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), x @ packed.weight.T, rtol=1e-5, atol=1e-5)


def test_autograd_takes_f_linear():
    linear = nn.Linear(8, 16)
    packed = PackedLinear(linear)
    packed(torch.randn(2, 8)).sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0


def test_a_cast_after_the_swap_takes_f_linear():
    packed = PackedLinear(nn.Linear(8, 16))
    x = torch.randn(2, 8)
    with torch.inference_mode():
        packed(x)
    packed.to(torch.float64)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x.double()), x.double() @ packed.weight.T + packed.bias)


def test_swap_shares_parameters_and_keeps_the_model_output():
    model = tiny_llama(vocab=64, hidden=64, layers=2, seed=3)
    x = torch.randint(0, 64, (2, 7))
    with torch.inference_mode():
        before = model(x).logits
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    params = {id(p) for p in model.parameters()}
    choice = use_packed_linear(model)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == n_linear and all(m.choice is choice for m in packed)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert {id(p) for p in model.parameters()} == params, "the swap keeps the parameters it was given"
    assert use_packed_linear(model) is choice, "a second swap finds nothing new and keeps the one choice"
    for kernel in (PACKED, STOCK):  # both kernels the calibration chooses between compute the same
        choice.name = kernel
        with torch.inference_mode():
            torch.testing.assert_close(model(x).logits, before, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(model(x[:, :1]).logits, before[:, :1], rtol=1e-4, atol=1e-5)


class _QuantLinear(nn.Linear):
    """Stands for a quantized subclass (bitsandbytes' Linear4bit is one): it has its own kernel."""


def test_only_plain_fp32_linears_are_swapped():
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(8, 64).to(torch.bfloat16), _QuantLinear(8, 64),
                          nn.Linear(8, 7))
    assert use_packed_linear(model) is not None
    assert [type(m).__name__ for m in model] == ["PackedLinear", "Linear", "_QuantLinear", "PackedLinear"]
