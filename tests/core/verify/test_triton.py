"""The Triton verify kernel returns exactly what the torch reference returns under shared uniforms.

On a machine without CUDA the kernel runs under TRITON_INTERPRET=1 (see conftest.py); it is slow
there (milliseconds per program), so the sizes are small and the multi-tile launch plans are
forced through `block` / `tiles` rather than reached with a large V. With CUDA the same tests run
the compiled kernel, and the `gpu` tests add full-size shapes and CUDA-graph capture.
"""
from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from scipy import stats

from flashspec_core.processors.sampling import SamplingParams, probs_from_logits
from flashspec_core.verify import verify
from flashspec_core.verify.reference import PAD, verify_torch
from flashspec_core.verify.triton import supports, verify_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_case(bsz: int, gamma: int, vocab: int, dtype: torch.dtype, model_drafts: bool,
              temperature: float, seed: int) -> dict:
    """Random logits with drafts that get accepted often enough to reach every position.

    Returns target_logits [B, γ+1, V], draft_tokens [B, γ], draft_probs [B, γ, V] | None and
    uniforms [B, γ+1], all on DEVICE.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(bsz, gamma + 1, vocab, generator=gen) * 4).to(dtype)
    draft_sampling = SamplingParams(temperature=temperature or 1.0)
    p = probs_from_logits(logits[:, :gamma], draft_sampling).reshape(-1, vocab)
    q = None
    if model_drafts:
        noisy = logits[:, :gamma].float() + torch.randn(bsz, gamma, vocab, generator=gen) * 1.5
        q = probs_from_logits(noisy, draft_sampling)
        src = q.reshape(-1, vocab)
    else:
        src = p
    if gamma == 0:
        drafts = torch.zeros(bsz, 0, dtype=torch.int64)
    elif temperature == 0.0:
        drafts = logits[:, :gamma].argmax(-1)
        flip = torch.rand(bsz, gamma, generator=gen) < 0.25
        drafts = torch.where(flip, torch.randint(0, vocab, (bsz, gamma), generator=gen), drafts)
    else:
        drafts = torch.multinomial(src, 1, generator=gen).view(bsz, gamma)
    uniforms = torch.rand(bsz, gamma + 1, generator=gen)
    return {
        "target_logits": logits.to(DEVICE),
        "draft_tokens": drafts.to(DEVICE),
        "draft_probs": None if q is None else q.to(DEVICE),
        "uniforms": uniforms.to(DEVICE),
    }


def assert_matches(case: dict, sampling: SamplingParams, **plan: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel == reference, token for token, at every V.

    The recovered / bonus token is the first index whose cumulative mass exceeds u * total; both
    sides sum in float64 (in float32 the kernel's block sums and torch's running sum picked
    different tokens in ~0.2 % of rows at V >= 32000), so the orders agree to ~1e-16 of the mass.
    """
    got = verify_triton(case["target_logits"], case["draft_tokens"], case["draft_probs"], sampling,
                        case["uniforms"], **plan)
    want = verify_torch(case["target_logits"], case["draft_tokens"], case["draft_probs"], sampling,
                        case["uniforms"])
    assert torch.equal(got[0], want[0]), f"n_accepted {got[0].tolist()} != {want[0].tolist()}"
    differ = (got[1] != want[1]).any(-1).nonzero().flatten().tolist()
    assert not differ, f"rows {differ}: tokens {got[1][differ].tolist()} != {want[1][differ].tolist()}"
    return got


# Every B x γ x T x draft kind at V = 17 and 1000 with the dtype rotating, so that each dtype meets
# every other axis; V = 4096 (the interpreter's slowest) on a diagonal of B x γ.
SMALL = itertools.product((17, 1000), (1, 3, 8), (1, 4, 8), (0.0, 0.7, 1.3), (False, True))
LARGE = itertools.product((4096,), ((1, 8), (3, 4), (8, 1)), (0.0, 0.7, 1.3), (False, True))
MATRIX = [
    pytest.param(bsz, gamma, vocab, temperature, model, DTYPES[i % 3],
                 id=f"V{vocab}-B{bsz}-g{gamma}-T{temperature}-{'model' if model else 'onehot'}"
                    f"-{str(DTYPES[i % 3])[6:]}")
    for i, (vocab, bsz, gamma, temperature, model) in enumerate(
        list(SMALL) + [(v, b, g, t, m) for v, (b, g), t, m in LARGE]
    )
]


@pytest.mark.parametrize("bsz, gamma, vocab, temperature, model, dtype", MATRIX)
def test_matches_reference(bsz, gamma, vocab, temperature, model, dtype):
    case = make_case(bsz, gamma, vocab, dtype, model, temperature, seed=bsz * 1000 + gamma * 10 + vocab)
    assert_matches(case, SamplingParams(temperature=temperature))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_multi_tile_plans(dtype, model, temperature):
    """V split over several tiles per program and several programs per row (what large V does)."""
    case = make_case(3, 4, 600, dtype, model, temperature, seed=7)
    assert_matches(case, SamplingParams(temperature=temperature), block=128, tiles=3)
    case = make_case(2, 2, 4096, dtype, model, temperature, seed=8)
    assert_matches(case, SamplingParams(temperature=temperature), block=512, tiles=3)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_gamma_zero_is_bonus_only(temperature):
    case = make_case(3, 0, 1000, torch.float32, False, temperature, seed=3)
    n_acc, tokens = assert_matches(case, SamplingParams(temperature=temperature))
    assert n_acc.tolist() == [0, 0, 0] and tokens.shape == (3, 1)


def test_p_equals_q_accepts_everything():
    case = make_case(8, 4, 1000, torch.float32, True, 1.0, seed=11)
    case["draft_probs"] = probs_from_logits(case["target_logits"][:, :4], SamplingParams(temperature=1.0))
    case["draft_tokens"] = torch.multinomial(case["draft_probs"].reshape(-1, 1000), 1).view(8, 4)
    case["uniforms"] = case["uniforms"].clamp(max=0.999)
    n_acc, _ = assert_matches(case, SamplingParams(temperature=1.0))
    assert n_acc.tolist() == [4] * 8


@pytest.mark.parametrize("model", [False, True])
def test_disjoint_supports_reject_and_recover_from_p(model):
    """Target mass only on even tokens (-inf logits elsewhere), drafts only on odd ones."""
    case = make_case(4, 3, 64, torch.float32, True, 1.0, seed=5)
    logits = case["target_logits"].clone()
    logits[..., 1::2] = float("-inf")
    q = torch.zeros(4, 3, 64, device=DEVICE)
    q[..., 1::2] = torch.softmax(torch.randn(4, 3, 32), -1).to(DEVICE)
    case.update(target_logits=logits, draft_probs=q if model else None,
                draft_tokens=torch.multinomial(q.reshape(-1, 64), 1).view(4, 3))
    n_acc, tokens = assert_matches(case, SamplingParams(temperature=1.0))
    assert n_acc.tolist() == [0] * 4
    assert (tokens[:, 0] % 2 == 0).all() and (tokens[:, 1:] == PAD).all()


def test_zero_draft_probability_rejects():
    case = make_case(6, 4, 100, torch.float32, True, 1.0, seed=9)
    q = case["draft_probs"].clone()
    rows = torch.arange(6, device=DEVICE)
    q[rows, 0, case["draft_tokens"][:, 0]] = 0.0  # the first draft token could not have been drawn
    case["draft_probs"] = q / q.sum(-1, keepdim=True)
    case["uniforms"][:, 0] = 0.0  # log u = -inf would accept anything with q > 0
    n_acc, _ = assert_matches(case, SamplingParams(temperature=1.0))
    assert n_acc.tolist() == [0] * 6


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_equal_logits(temperature):
    case = make_case(3, 4, 1000, torch.bfloat16, False, 1.0, seed=13)
    case["target_logits"] = torch.full_like(case["target_logits"], 2.5)
    case["draft_tokens"] = torch.zeros_like(case["draft_tokens"])
    n_acc, tokens = assert_matches(case, SamplingParams(temperature=temperature), block=256, tiles=2)
    if temperature == 0.0:  # argmax ties go to the first index, as torch.argmax
        assert n_acc.tolist() == [4, 4, 4] and (tokens == 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "row-of-minus-inf", "draft-out-of-range"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_invalid_inputs_raise_and_poison(bad, temperature):
    case = make_case(3, 2, 100, torch.float16, True, 1.0, seed=17)
    logits = case["target_logits"].clone()
    if bad == "row-of-minus-inf":
        logits[1, 2] = float("-inf")
    elif bad == "draft-out-of-range":
        case["draft_tokens"][1, 1] = 100
    else:
        logits[1, 1, 37] = bad
    case["target_logits"] = logits
    sampling = SamplingParams(temperature=temperature)
    args = (case["target_logits"], case["draft_tokens"], case["draft_probs"], sampling, case["uniforms"])
    with pytest.raises(ValueError, match="NaN"):
        verify_triton(*args)
    n_acc, tokens = verify_triton(*args, check_finite=False)
    assert n_acc[1].item() == -1 and (tokens[1] == PAD).all()
    good = torch.tensor([0, 2], device=DEVICE)  # the other sequences are unaffected
    want = verify_torch(*(a if a is sampling else a[good] for a in args))
    assert torch.equal(n_acc[good], want[0]) and torch.equal(tokens[good], want[1])


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.8, top_k=5),
                                      SamplingParams(temperature=0.8, top_p=0.9)])
def test_top_k_top_p_fall_back_to_torch(sampling):
    case = make_case(3, 2, 50, torch.float32, True, 0.8, seed=19)
    assert_matches(case, sampling)


def test_dispatch_and_supports():
    case = make_case(2, 2, 40, torch.float32, False, 1.0, seed=23)
    got = verify(case["target_logits"], case["draft_tokens"], None, SamplingParams(temperature=1.0),
                 case["uniforms"], backend="triton")
    want = verify_torch(case["target_logits"], case["draft_tokens"], None,
                        SamplingParams(temperature=1.0), case["uniforms"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert supports(case["target_logits"])
    assert not supports(case["target_logits"].double())
    assert not supports(torch.zeros(1, 40, 8, device=DEVICE))  # γ + 1 > 32


def test_own_randomness_is_seeded():
    case = make_case(8, 3, 30, torch.float32, True, 1.0, seed=29)
    args = (case["target_logits"], case["draft_tokens"], case["draft_probs"], SamplingParams(temperature=1.0))
    runs = [verify_triton(*args, None, torch.Generator(device=DEVICE).manual_seed(s))[1] for s in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_seed_tensor_is_the_generators_draw():
    """`seed=` (what a CUDA graph feeds) gives what drawing the seed from the generator gives, and
    a new seed in the same tensor gives new draws."""
    case = make_case(8, 3, 30, torch.float32, True, 1.0, seed=43)
    args = (case["target_logits"], case["draft_tokens"], case["draft_probs"], SamplingParams(temperature=1.0))
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    want = verify_triton(*args, None, gen)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    if DEVICE == "cuda":
        seed = torch.randint(0, 2**62, (1,), device=DEVICE, generator=gen)
    else:  # the wrapper draws a CPU generator's seed on the host: same draw, as a tensor
        seed = torch.tensor([int(torch.randint(0, 2**62, (1,), generator=gen).item())])
    got = verify_triton(*args, None, None, seed=seed)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    seed += 1
    assert not torch.equal(verify_triton(*args, None, None, seed=seed)[1], want[1])


def test_a_seed_per_row_draws_as_each_row_alone():
    """`seed=` of shape [B]: row b draws from seed[b] alone, its index in the batch left out, so a
    row verified beside others gets what it gets verified alone with that seed."""
    case = make_case(6, 3, 30, torch.float32, True, 0.8, seed=47)
    args = (case["target_logits"], case["draft_tokens"], case["draft_probs"], SamplingParams(temperature=0.8))
    seeds = torch.tensor([11, 12, 13, 11, 99, 5], device=DEVICE)
    n_acc, tokens = verify_triton(*args, None, None, seed=seeds)
    for b in range(6):
        alone = verify_triton(*(a[b:b + 1] for a in args[:3]), args[3], None, None, seed=seeds[b:b + 1])
        assert int(alone[0]) == int(n_acc[b]) and torch.equal(alone[1][0], tokens[b])
    shared = verify_triton(*args, None, None, seed=seeds[:1])  # one seed: rows told apart by index
    assert not torch.equal(shared[1], tokens)


@pytest.mark.parametrize("bad", ["shape", "dtype", "top_k"])
def test_bad_seeds_are_refused_naming_the_argument(bad):
    case = make_case(3, 2, 30, torch.float32, True, 1.0, seed=53)
    sampling = SamplingParams(temperature=1.0, top_k=5 if bad == "top_k" else 0)
    seed = {"shape": torch.zeros(2, dtype=torch.long), "dtype": torch.zeros(3, dtype=torch.int32),
            "top_k": torch.zeros(3, dtype=torch.long)}[bad].to(DEVICE)
    with pytest.raises(ValueError, match="seed"):
        verify_triton(case["target_logits"], case["draft_tokens"], case["draft_probs"], sampling, None, None, seed=seed)
    with pytest.raises(ValueError, match="seed"):
        verify(case["target_logits"], case["draft_tokens"], case["draft_probs"], sampling, backend="torch", seed=seed)


def g_test_passes(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """G-test (log-likelihood ratio) of sampled tokens against probs, at alpha = 0.01."""
    observed = torch.bincount(tokens.cpu(), minlength=probs.numel()).double().numpy()
    expected = (probs.double() / probs.double().sum()).cpu().numpy() * observed.sum()
    return stats.power_divergence(observed, expected, lambda_="log-likelihood").pvalue > 0.01


@pytest.mark.parametrize("model", [False, True])
def test_output_distribution_is_the_target(model):
    """With the kernel's own random numbers, the first token follows p_0 and the bonus p_1."""
    bsz, vocab = (4096 if DEVICE == "cuda" else 200), 5
    row0 = torch.tensor([0.1, 0.15, 0.2, 0.25, 0.3]).log()
    row1 = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1]).log()
    logits = torch.stack([row0, row1]).expand(bsz, 2, vocab).contiguous().to(DEVICE)
    q_row = torch.tensor([0.5, 0.05, 0.05, 0.1, 0.3])
    gen = torch.Generator().manual_seed(31)
    if model:
        drafts = torch.multinomial(q_row, bsz, replacement=True, generator=gen).view(bsz, 1)
        q = q_row.expand(bsz, 1, vocab).contiguous().to(DEVICE)
    else:
        drafts, q = torch.full((bsz, 1), 4), None  # p_0(4) = 0.3: accepted often enough
    n_acc, tokens = verify_triton(logits, drafts.to(DEVICE), q, SamplingParams(temperature=1.0),
                                  None, torch.Generator(device=DEVICE).manual_seed(37))
    assert g_test_passes(tokens[:, 0], row0.exp())
    accepted = n_acc == 1
    assert accepted.sum() > bsz // 5
    assert g_test_passes(tokens[accepted, 1], row1.exp())


@pytest.mark.parametrize("vocab, dtype", [(128256, torch.bfloat16), (262144, torch.float16), (32000, torch.float32)])
@pytest.mark.parametrize("model", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("gamma", [4, 16])
@pytest.mark.gpu
@needs_cuda
def test_full_size_on_gpu(vocab, dtype, model, temperature, gamma):
    case = make_case(64, gamma, vocab, dtype, model, temperature, seed=vocab + gamma)
    assert_matches(case, SamplingParams(temperature=temperature))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("own_randomness", [False, True])
def test_cuda_graph_capture_and_replay(own_randomness):
    """The step has no host sync: it captures into a CUDA graph and replays with new inputs."""
    case = make_case(8, 4, 32000, torch.bfloat16, True, 0.7, seed=41)
    sampling = SamplingParams(temperature=0.7)
    static = {k: v.clone() for k, v in case.items()}
    uniforms = None if own_randomness else static["uniforms"]

    def step():  # check_finite stays on: under capture it must skip its host sync by itself
        return verify_triton(static["target_logits"], static["draft_tokens"], static["draft_probs"],
                             sampling, uniforms)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        n_acc, tokens = step()
    for seed in range(3):
        fresh = make_case(8, 4, 32000, torch.bfloat16, True, 0.7, seed=100 + seed)
        for k, v in fresh.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        if own_randomness:
            first = tokens.clone()
            graph.replay()  # same inputs: the device-side step counter gives new random numbers
            torch.cuda.synchronize()
            assert not torch.equal(first, tokens)
            assert (n_acc >= 0).all() and ((tokens >= 0) | (tokens == PAD)).all()
        else:
            want = verify_torch(fresh["target_logits"], fresh["draft_tokens"], fresh["draft_probs"],
                                sampling, fresh["uniforms"])
            assert torch.equal(n_acc, want[0]) and torch.equal(tokens, want[1])
