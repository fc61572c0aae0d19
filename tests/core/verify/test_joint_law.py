"""The joint law of everything one verify step emits, at γ = 3 and 8, with teeth.

Each outcome of a step is the tuple of emitted tokens: the accepted draft tokens, then the
recovered or bonus token; its length is the acceptance pattern. `laws.hazard_design` picks p and q
per position under which all k outcomes are equally likely, for a one-hot draft (prompt lookup's
kind) and for a model draft whose q both fails and passes the min(1, p/q) test and leaves residuals
with and without the draft token. One G-test over all k outcomes (α = 0.01) compares the output of
`verify` on N independent rows with `laws.step_law`, the law derived from the algebra alone.

Power: N = `laws.rows_for(law)`, the rows at which moving 2 % of the mass of any one outcome
elsewhere is detected with probability 0.9 (noncentral chi-square, k - 1 degrees of freedom):
504k rows for k = 9 (one-hot, γ = 3) up to 2.04M for k = 24 (model q, γ = 8).

The planted bugs of issue 15 (plants.py: the recovered token of a row rejected at position n >= 2
drawn with the acceptance uniform u[n], or from a residual built with q at position 1) are the
power checks: applied to the same rows and uniforms, the same G-test must reject each of them.

The Triton kernel's law with its own random numbers (Philox) runs the same test at full N on CUDA
(marked gpu); on the CPU under TRITON_INTERPRET (slow) it runs γ = 4 on INTERPRET_ROWS rows only,
which detects gross errors such as re-using one uniform twice.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from helpers import ALPHA, check_exact, g_test, needs_cuda
from laws import Design, detectable_error, hazard_design, rows_for, step_law
from plants import BUGS, redraw

from flashspec_core.processors.sampling import SamplingParams, probs_from_logits
from flashspec_core.verify import PAD, verify

T1 = SamplingParams(temperature=1.0)
CHUNK = {"torch": 250_000, "triton": 65_536}  # rows per verify call (the kernel's MAX_BATCH)
CASES = [("one_hot", 3), ("one_hot", 8), ("model_q", 3), ("model_q", 8)]
INTERPRET_GAMMA, INTERPRET_ROWS = 4, 200  # one-hot design


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _count(tokens: torch.Tensor, counts: dict) -> None:
    """Add each row's emitted tokens (PAD cut off) as one outcome. tokens: [N, γ+1] on any device."""
    vocab = int(tokens.max()) + 2
    width = tokens.shape[1]
    code = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for j in reversed(range(width)):  # base-(V+1) digits, PAD as the largest digit
        code = code * vocab + torch.where(tokens[:, j] == PAD, vocab - 1, tokens[:, j]).cpu()
    values, freq = torch.unique(code, return_counts=True)
    for value, c in zip(values.tolist(), freq.tolist()):
        key = []
        for _ in range(width):
            value, digit = divmod(value, vocab)
            if digit == vocab - 1:
                break
            key.append(digit)
        counts[tuple(key)] = counts.get(tuple(key), 0) + c


def sample_step(design: Design, rows: int, seed: int, backend: str, device: str = "cpu",
                bugs: tuple[str, ...] = (), per_row: bool = False) -> dict[str, dict]:
    """Outcome counts of `rows` independent verify steps under `design`, and of each planted bug.

    The torch backend gets explicit uniforms (the bugs re-use them); Triton draws its own, from
    one generator, or with `per_row` from a seed per row (what a step's sampled rows get).
    """
    gen = torch.Generator().manual_seed(seed)
    device_gen = torch.Generator(device).manual_seed(seed + 1)
    gamma, vocab = design.q.shape
    logits = torch.from_numpy(design.p).log().float().to(device)  # [γ+1, V], -inf where p = 0
    q = torch.from_numpy(design.q).float()  # [γ, V]
    p = probs_from_logits(logits.cpu(), T1)  # [γ+1, V] what verify tests against, for the bugs
    counts: dict[str, dict] = {name: {} for name in ("verify",) + bugs}
    for start in range(0, rows, CHUNK[backend]):
        size = min(CHUNK[backend], rows - start)
        if design.one_hot:
            draft, probs = q.argmax(-1).expand(size, -1), None
        else:
            draft = torch.stack([torch.multinomial(q[j], size, replacement=True, generator=gen)
                                 for j in range(gamma)], 1)
            probs = q.to(device).expand(size, -1, -1)
        uniforms = torch.rand(size, gamma + 1, generator=gen) if backend == "torch" else None
        seeds = torch.randint(0, 2**62, (size,), generator=gen).to(device) if per_row else None
        n_acc, tokens = verify(logits.expand(size, -1, -1), draft.to(device), probs, T1,
                               uniforms=None if uniforms is None else uniforms.to(device),
                               backend=backend, generator=device_gen, seed=seeds)
        n_acc, tokens = n_acc.cpu(), tokens.cpu()
        _count(tokens, counts["verify"])
        for bug in bugs:
            _count(redraw(bug, p.expand(size, -1, -1), q.expand(size, -1, -1), n_acc, tokens, uniforms), counts[bug])
    return counts


@pytest.mark.parametrize("design_name, gamma", CASES, ids=[f"{d}-g{g}" for d, g in CASES])
def test_one_step_joint_law_and_the_planted_bugs(torch_one_thread, design_name, gamma):
    design = hazard_design(gamma, one_hot=design_name == "one_hot")
    law = step_law(design.p, design.q)
    rows = rows_for(law)
    samples = []

    def run(replicate: int) -> tuple[float]:
        samples.append(sample_step(design, rows, _seed(design_name, gamma, replicate), "torch", bugs=BUGS))
        return (g_test(samples[-1]["verify"], law),)

    check_exact(run, f"verify {design_name} γ={gamma} ({rows} rows)")
    assert set(samples[0]["verify"]) == set(law), "every outcome of the law must be seen"
    for bug in BUGS:
        p_bug = g_test(samples[0][bug], law)
        assert p_bug < ALPHA, f"the planted bug {bug} went unnoticed: p = {p_bug:.3g} over {rows} rows"
    assert set(samples[0]["u[n]"]) <= set(law), "the u[n] plant keeps the support: only the law may catch it"


@pytest.mark.parametrize("design_name, gamma", CASES, ids=[f"{d}-g{g}" for d, g in CASES])
def test_the_power_calculation_holds_by_simulation(design_name, gamma):
    """The claim behind N, checked without the asymptotics: draw multinomial counts of N rows from
    the law with one outcome 2 % more likely (the rest scaled down) and from the law itself; the
    G-test must reject the first about 90 % of the time and the second about 1 %."""
    design = hazard_design(gamma, one_hot=design_name == "one_hot")
    law = step_law(design.p, design.q)
    assert max(law.values()) / min(law.values()) < 1 + 1e-9, "the design makes outcomes equally likely"
    rows = rows_for(law)
    assert detectable_error(law, rows) == pytest.approx(0.02) and rows < 2_100_000
    keys, probs = list(law), np.array(list(law.values()))
    off = probs.copy()
    off[0] *= 1.02
    off[1:] *= (1 - off[0]) / off[1:].sum()
    rng = np.random.default_rng(_seed("power", design_name, gamma))
    rejected = {}
    for name, truth in (("2% off", off), ("exact", probs)):
        draws = rng.multinomial(rows, truth, size=400)
        rejected[name] = np.mean([g_test(dict(zip(keys, row.tolist())), law) < ALPHA for row in draws])
    assert rejected["2% off"] >= 0.84 and rejected["exact"] <= 0.04, rejected


TRITON_CASES = [pytest.param(d, g, per_row, marks=(pytest.mark.gpu, needs_cuda), id=f"{d}-g{g}{'-rows' * per_row}")
                for d, g, per_row in [(d, g, False) for d, g in CASES + [("one_hot", 4), ("model_q", 4)]]
                + [("one_hot", 4, True), ("model_q", 4, True)]]


@pytest.mark.parametrize("design_name, gamma, per_row", TRITON_CASES)
def test_kernel_joint_law_with_its_own_random_numbers_on_gpu(design_name, gamma, per_row):
    pytest.importorskip("triton")
    design = hazard_design(gamma, one_hot=design_name == "one_hot")
    law = step_law(design.p, design.q)
    rows = rows_for(law)
    check_exact(lambda rep: (g_test(sample_step(design, rows, _seed("triton", design_name, gamma, rep), "triton",
                                                "cuda", per_row=per_row)["verify"], law),),
                f"triton {design_name} γ={gamma}{' seeds per row' * per_row}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the full-size test above")
def test_kernel_joint_law_with_a_seed_per_row_under_the_interpreter(torch_one_thread):
    """As below, each row drawing from a seed of its own (a step's sampled rows)."""
    pytest.importorskip("triton")
    design = hazard_design(INTERPRET_GAMMA, one_hot=True)
    law = step_law(design.p, design.q)
    check_exact(lambda rep: (g_test(sample_step(design, INTERPRET_ROWS, _seed("interpret-rows", rep), "triton",
                                                per_row=True)["verify"], law),),
                f"triton (interpreter, seeds per row) γ={INTERPRET_GAMMA}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the full-size test above")
def test_kernel_joint_law_under_the_interpreter(torch_one_thread):
    """γ = 4 on INTERPRET_ROWS rows: 11 outcomes, ~18 rows each. This sees a cell doubled or
    emptied (what re-using one uniform twice does), not a 2 % error; the power check runs the
    u[n] plant (torch) on as many rows and requires the same test to reject it."""
    pytest.importorskip("triton")
    design = hazard_design(INTERPRET_GAMMA, one_hot=True)
    law = step_law(design.p, design.q)
    assert detectable_error(law, INTERPRET_ROWS) > 1.0, "the docstring's claim"
    check_exact(lambda rep: (g_test(sample_step(design, INTERPRET_ROWS, _seed("interpret", rep), "triton")["verify"],
                                    law),), f"triton (interpreter) γ={INTERPRET_GAMMA}")
    for rep in range(3):
        counts = sample_step(design, INTERPRET_ROWS, _seed("interpret-plant", rep), "torch", bugs=("u[n]",))
        assert g_test(counts["u[n]"], law) < ALPHA, "at this size the test must still catch a re-used uniform"
