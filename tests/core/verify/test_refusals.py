"""Input with no target law is refused the same way by both backends, greedy and sampling alike.

Before issue 15, the torch backend turned a NaN row into token V-1 (no token "has mass", so the
inverse CDF fell back to the last one), greedy argmax took a NaN as the maximum, and an
out-of-range draft id was silently rejected in greedy mode but crashed in `gather` when sampling.
The Triton kernel already refused all of them. Under TRITON_INTERPRET on the CPU (conftest.py)
each Triton call here takes about 0.2 s.
"""
from __future__ import annotations

import pytest
import torch

from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.verify import verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    pytest.importorskip("triton") is None, reason="needs triton"))]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0)]
# What each kind of bad input must be called (the Triton message covers all of them at once).
BAD = {"nan": "NaN", "+inf": "NaN or \\+inf", "row of -inf": "all -inf", "draft id": r"outside \[0, V\)"}


def _case(bad: str, model_q: bool) -> dict:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 3, 8, generator=gen)  # [B, γ+1, V]
    draft = logits[:, :2].argmax(-1)  # [B, γ]: greedy accepts, so later positions are read
    q = torch.softmax(logits[:, :2], -1) if model_q else None
    if bad == "nan":
        logits[1, 1, 5] = float("nan")
    elif bad == "+inf":
        logits[1, 1, 5] = float("inf")
    elif bad == "row of -inf":
        logits[1, 2] = float("-inf")
    elif bad == "draft id":
        draft[1, 1] = 8
    return dict(target_logits=logits.to(DEVICE), draft_tokens=draft.to(DEVICE),
                draft_probs=None if q is None else q.to(DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "T1"])
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_raises_a_value_error_on_both_backends(backend, sampling, bad):
    case = _case(bad, model_q=not sampling.greedy)
    match = "NaN" if backend == "triton" else BAD[bad]
    with pytest.raises(ValueError, match=match):
        verify(**case, sampling=sampling, backend=backend, generator=torch.Generator(DEVICE).manual_seed(0))


@pytest.mark.parametrize("value", [float("nan"), -0.5])
def test_a_dishonest_q_is_refused(value):
    case = _case("none", model_q=True)
    case["draft_probs"][0, 0, 3] = value
    with pytest.raises(ValueError, match="draft_probs"):
        verify(**case, sampling=SamplingParams(temperature=1.0), backend="torch")


def test_minus_inf_alone_is_a_mask_not_an_error():
    case = _case("none", model_q=False)
    case["target_logits"][:, :, 4:] = float("-inf")  # a grammar forbids half the vocabulary
    n_acc, tokens = verify(**case, sampling=SamplingParams(temperature=1.0), backend="torch")
    assert (tokens.gather(1, n_acc[:, None]) < 4).all(), "the recovered or bonus token is inside the mask"
