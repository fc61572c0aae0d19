"""A temperature per sequence: `verify_triton(temperature=[B])`, what a CUDA graph of a sampled
step reads so that one graph serves every temperature, gives each sequence exactly what a launch at
its temperature alone gives, with the same uniforms or the same seed per sequence.

Exactly, not within a tolerance: the kernel derives 1/T and log2(e)/T from the float32 T of each
sequence whichever way T came, so the two launches round alike. The temperatures include some
(0.71, 1.08) whose log2(e)/T rounds differently from float32 T than from the float64 T, and a
planted bug (every sequence at sequence 0's temperature) shows the comparison has teeth. On the
CPU the kernel runs under TRITON_INTERPRET=1 (conftest.py).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.verify.triton import verify_triton
from verify.test_triton import DEVICE, make_case

TEMPERATURES = (0.5, 0.7, 0.71, 0.9, 1.0, 1.08, 1.3, 2.0)
Outputs = tuple[torch.Tensor, torch.Tensor]


def _case(model: bool, seed: int, vocab: int = 200, gamma: int = 4) -> dict:
    """A case of one sequence per temperature (drafts drawn at T = 1), on DEVICE."""
    return make_case(len(TEMPERATURES), gamma, vocab, torch.float32, model, 1.0, seed=seed)


def _each_alone(case: dict, randomness: dict, **plan: int) -> Outputs:
    """Row b of a launch at TEMPERATURES[b] for every row: what row b gets at its temperature alone."""
    n_acc = torch.empty(len(TEMPERATURES), dtype=torch.int64, device=DEVICE)
    tokens = torch.empty_like(case["target_logits"][..., 0], dtype=torch.int64)
    for b, t in enumerate(TEMPERATURES):
        got = verify_triton(case["target_logits"], case["draft_tokens"], case["draft_probs"],
                            SamplingParams(temperature=t), **randomness, **plan)
        n_acc[b], tokens[b] = got[0][b], got[1][b]
    return n_acc, tokens


def _one_launch(case: dict, randomness: dict, temperature: torch.Tensor, **plan: int) -> Outputs:
    """Every row in one launch, each at its own temperature (temperature: [B] float32)."""
    return verify_triton(case["target_logits"], case["draft_tokens"], case["draft_probs"],
                         SamplingParams(temperature=1.0), temperature=temperature, **randomness, **plan)


def _rows_that_differ(got: Outputs, want: Outputs) -> list[int]:
    return ((got[0] != want[0]) | (got[1] != want[1]).any(-1)).nonzero().flatten().tolist()


def _randomness(kind: str, case: dict) -> dict:
    """The uniforms of the case, or a seed per sequence (whose draws leave its index out)."""
    if kind == "uniforms":
        return {"uniforms": case["uniforms"]}
    return {"seed": torch.arange(100, 100 + len(TEMPERATURES), device=DEVICE)}


@pytest.mark.parametrize("randomness", ["uniforms", "seed"])
@pytest.mark.parametrize("model", [False, True])
def test_a_temperature_per_row_is_each_rows_launch_alone(model, randomness):
    case = _case(model, seed=61 + model)
    drawn = _randomness(randomness, case)
    temperature = torch.tensor(TEMPERATURES, dtype=torch.float32, device=DEVICE)
    want = _each_alone(case, drawn)
    assert not _rows_that_differ(_one_launch(case, drawn, temperature), want)
    # The plant: every row at row 0's temperature. It must be caught on these very inputs.
    planted = _one_launch(case, drawn, temperature[:1].expand(len(TEMPERATURES)).contiguous())
    assert _rows_that_differ(planted, want), "the comparison cannot see a wrong temperature"


def test_a_temperature_per_row_under_a_multi_tile_plan():
    """V split over several programs per row: each program derives the row's scales itself."""
    case = _case(True, seed=67, vocab=600)
    drawn = _randomness("uniforms", case)
    temperature = torch.tensor(TEMPERATURES, dtype=torch.float32, device=DEVICE)
    want = _each_alone(case, drawn, block=128, tiles=3)
    assert not _rows_that_differ(_one_launch(case, drawn, temperature, block=128, tiles=3), want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter divides by the bad T in numpy
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_temperature_poisons_its_row_only(bad):
    case = _case(False, seed=71)
    drawn = _randomness("uniforms", case)
    temperature = torch.tensor(TEMPERATURES, dtype=torch.float32, device=DEVICE)
    temperature[2] = bad
    with pytest.raises(ValueError, match="temperature"):
        _one_launch(case, drawn, temperature)
    n_acc, _ = verify_triton(case["target_logits"], case["draft_tokens"], None, SamplingParams(temperature=1.0),
                             check_finite=False, temperature=temperature, **drawn)
    assert n_acc[2].item() == -1 and (n_acc[torch.arange(len(TEMPERATURES)) != 2] >= 0).all()


@pytest.mark.parametrize("bad", ["shape", "dtype", "greedy", "top_k"])
def test_bad_temperature_tensors_are_refused_naming_the_argument(bad):
    case = _case(False, seed=73)
    n = len(TEMPERATURES)
    temperature = {"shape": torch.ones(n - 1), "dtype": torch.ones(n, dtype=torch.float64)}.get(bad, torch.ones(n))
    sampling = {"greedy": SamplingParams(), "top_k": SamplingParams(temperature=1.0, top_k=5)}.get(
        bad, SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="temperature"):
        verify_triton(case["target_logits"], case["draft_tokens"], None, sampling, case["uniforms"],
                      temperature=temperature.to(DEVICE))
