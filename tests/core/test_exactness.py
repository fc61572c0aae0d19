"""Sampling exactness: speculative output has exactly the target's distribution.

Invariant 1 of DESIGN.md, checked by G-tests (α = 0.01) against the exact law of the first two
tokens, computed from a tiny random target with transformers' own logits warpers:

* verify level: 10^5 rows per case through `verify` on batched tensors, covering every
  temperature, top-k, top-p, γ ∈ {1, 3, 8}, model-drawn q and one-hot drafts. The second token of
  a row rejected at position 0 comes from a second, vectorised verify step, as in the engine.
* engine level: the whole engine (drafts, KV rollback, per-row finish, EOS) with many identical
  prompts in one batch, for each draft kind and for a router that switches arm at random.

Every random draw is seeded, so each case is deterministic. The power checks break the residual
(a rejected position draws from p instead of max(0, p - q)) and require the same tests to reject.
These tests see the first two tokens only; the joint law of everything one step emits (with bugs
that only touch later positions as power checks) is tests/core/verify/test_joint_law.py, four tokens
over several engine steps tests/core/test_engine_joint.py.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from helpers import (
    ALPHA,
    BACKENDS,
    ENGINE_ROWS,
    RandomRouter,
    break_residual,
    check_exact,
    check_rejects,
    count_outcomes,
    g_test,
    greedy_ids,
    next_logits,
    on_backend,
    one_thread,
    reference_probs,
)
from laws import marginal, prefix_law

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.drafts import ModelDraft, PromptLookupDraft, SuffixCacheDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.fixed import FixedRouter
from flashspec_core.verify import verify

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SAMPLINGS = {
    "T0.5": SamplingParams(temperature=0.5),
    "T1": SamplingParams(temperature=1.0),
    "T1.5": SamplingParams(temperature=1.5),
    "T1-topk4": SamplingParams(temperature=1.0, top_k=4),
    "T1-topp0.7": SamplingParams(temperature=1.0, top_p=0.7),
    "T1.5-topk6-topp0.9": SamplingParams(temperature=1.5, top_k=6, top_p=0.9),
    "T1-rep2": SamplingParams(temperature=1.0, repetition_penalty=2.0),
    "T1-rep3": SamplingParams(temperature=1.0, repetition_penalty=3.0),
    # Size 1: the output never repeats a token, so the second token's ban is the first token,
    # which the engine must read from the draft path when the first token was drafted.
    "T1-ng1": SamplingParams(temperature=1.0, no_repeat_ngram_size=1),
}
VERIFY_SAMPLINGS = [name for name, s in SAMPLINGS.items() if s.repetition_penalty == 1.0 and not s.no_repeat_ngram_size]
# Ends in a token seen before, so prompt lookup drafts [7, 7, 8, ...]; the tiny target gives that
# first draft token p ≈ 0.4 at T = 1, so both acceptance and the residual matter.
PROMPT = [5, 7, 7, 8, 9, 10, 11, 12, 13, 5]
LOOKUP_FIRST = 7
N_VERIFY = 100_000
N_ENGINE = 4_000


def _seed(*parts) -> int:
    """A fixed seed per case (str hashes are salted per process; crc32 is not)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


# ------------------------------------------------------------------------------ verify level


@dataclass
class Tables:
    """Logits of the target and the draft after the prompt (1) and after prompt + t (2)."""

    target1: torch.Tensor  # [V]
    target2: torch.Tensor  # [V, V]: row t = logits after prompt + [t]
    draft1: torch.Tensor  # [V]
    draft2: torch.Tensor  # [V, V]
    filler: torch.Tensor  # [V]: logits for positions >= 2, which cannot affect the first two tokens


@pytest.fixture(scope="module")
def tables(tiny_target, tiny_draft_model) -> Tables:
    target, draft = tiny_target.model, tiny_draft_model
    vocab = target.config.vocab_size
    after = [PROMPT + [t] for t in range(vocab)]
    with one_thread():
            return Tables(next_logits(target, [PROMPT])[0], next_logits(target, after),
                      next_logits(draft, [PROMPT])[0], next_logits(draft, after),
                      next_logits(target, [PROMPT + [0, 0]])[0])


def _draw(q: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """n draws by inverse CDF: one row each from q [n, V], or n draws from one law q [V]."""
    cdf = q.double().cumsum(-1)
    u = torch.rand(n, generator=gen, dtype=torch.float64) * cdf[..., -1]
    if q.dim() == 1:
        return torch.searchsorted(cdf, u, right=True).clamp_(max=q.shape[-1] - 1)
    return torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1).clamp_(max=q.shape[-1] - 1)


def _draft_step(q_first: torch.Tensor, q_second: torch.Tensor, filler_q: torch.Tensor, gamma: int,
                onehot: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """γ draft tokens per row and the q each was drawn from.

    q_first: [n, V] law of the first draft token; q_second: [V, V] law of the second given the first;
    filler_q: [V] law of the rest. One-hot drafts propose the argmax instead (a deterministic draft).
    Returns tokens [n, γ] and probs [n, γ, V] (None when one-hot).
    """
    n = q_first.shape[0]
    if onehot:
        tokens = [q_first.argmax(-1)]
        tokens += [q_second[tokens[0]].argmax(-1)] + [filler_q.argmax().expand(n)] * (gamma - 2)
        return torch.stack(tokens[:gamma], 1), None
    tokens = [_draw(q_first, n, gen)]
    tokens += [_draw(q_second[tokens[0]], n, gen)] + [_draw(filler_q, n, gen) for _ in range(gamma - 2)]
    probs = [q_first, q_second[tokens[0]]] + [filler_q.expand(n, -1)] * (gamma - 2)
    return torch.stack(tokens[:gamma], 1), torch.stack(probs[:gamma], 1)


def two_tokens_via_verify(tab: Tables, sampling: SamplingParams, gamma: int, onehot: bool, n: int,
                          seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The first two output tokens of n independent rows, one or two verify steps each."""
    gen = torch.Generator().manual_seed(seed)
    as_q = lambda logits: torch.from_numpy(reference_probs(logits, sampling)).float()
    q1, q2, qf = as_q(tab.draft1[None])[0], as_q(tab.draft2), as_q(tab.filler[None])[0]

    def step(first_logits: torch.Tensor, q_first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = q_first.shape[0]
        tokens, probs = _draft_step(q_first, q2, qf, gamma, onehot, gen)
        logits = [first_logits, tab.target2[tokens[:, 0]]] + [tab.filler.expand(rows, -1)] * (gamma - 1)
        return verify(torch.stack(logits[: gamma + 1], 1), tokens, probs, sampling, backend="torch", generator=gen)

    n_acc, out = step(tab.target1.expand(n, -1), q1.expand(n, -1))
    first, second = out[:, 0].clone(), out[:, 1].clone()
    again = n_acc == 0  # only the recovered token came out: the second needs another step
    _, out2 = step(tab.target2[first[again]], q2[first[again]])
    second[again] = out2[:, 0]
    return first.numpy(), second.numpy()


def _verify_pvalues(tab: Tables, sampling: SamplingParams, gamma: int, onehot: bool, seed: int) -> tuple[float, float]:
    first, second = two_tokens_via_verify(tab, sampling, gamma, onehot, N_VERIFY, seed)
    vocab = tab.target1.shape[0]
    p1 = reference_probs(tab.target1[None], sampling)[0]
    p2 = reference_probs(tab.target2, sampling)
    counts1 = {(t,): int(c) for t, c in enumerate(np.bincount(first, minlength=vocab))}
    joint = np.bincount(first * vocab + second, minlength=vocab * vocab)
    counts2 = {(a, b): int(joint[a * vocab + b]) for a in range(vocab) for b in range(vocab)}
    law1 = {(a,): float(p1[a]) for a in range(vocab)}
    law2 = {(a, b): float(p1[a] * p2[a, b]) for a in range(vocab) for b in range(vocab)}
    return g_test(counts1, law1), g_test(counts2, law2)


# Every sampling at γ = 3 with both draft kinds; γ = 1 and γ = 8 over a spread of samplings.
VERIFY_CASES = [(s, 3, onehot) for s in VERIFY_SAMPLINGS for onehot in (False, True)]
VERIFY_CASES += [(s, 1, False) for s in ("T0.5", "T1.5", "T1-topp0.7")] + [("T1", 1, True)]
VERIFY_CASES += [(s, 8, False) for s in ("T1", "T1-topk4", "T1.5-topk6-topp0.9")] + [("T1", 8, True)]


@pytest.mark.parametrize("name, gamma, onehot", VERIFY_CASES,
                         ids=[f"{s}-g{g}-{'onehot' if o else 'modelq'}" for s, g, o in VERIFY_CASES])
def test_verify_first_two_tokens_follow_the_target(tables, name, gamma, onehot):
    check_exact(lambda rep: _verify_pvalues(tables, SAMPLINGS[name], gamma, onehot, _seed(name, gamma, onehot, rep)),
                f"verify {name} γ={gamma}")


@pytest.mark.parametrize("name, gamma, onehot", [("T1", 3, False), ("T1", 1, True), ("T1-topk4", 8, False)])
def test_verify_tests_reject_a_broken_residual(tables, monkeypatch, name, gamma, onehot):
    broken = break_residual(monkeypatch)
    check_rejects(lambda rep: _verify_pvalues(tables, SAMPLINGS[name], gamma, onehot, _seed(name, gamma, onehot, rep)),
                  f"verify {name} γ={gamma}")
    assert broken.calls > 0, "verify no longer routes the residual through torch.where: update break_residual"


# ------------------------------------------------------------------------------ engine level


def _drafts(kind: str, tiny_target, tiny_draft_model, backend: str = "torch"):
    """A fresh draft pool; the suffix cache is primed with the target's greedy continuation."""
    pad = tiny_target.tokenizer.pad_token_id
    suffix = SuffixCacheDraft()
    suffix.add(PROMPT[-2:] + greedy_ids(tiny_target.model, PROMPT, 9))
    pool = {"prompt_lookup": PromptLookupDraft(), "suffix_cache": suffix,
            "model": ModelDraft(on_backend(tiny_draft_model, backend), name="model", pad_token_id=pad)}
    return list(pool.values()) if kind == "all" else [pool[kind]]


def _engine_pvalues(tiny_target, tiny_draft_model, kind: str, gamma: int, sampling_name: str, replicate: int,
                    calls: int = 1, prompt: list[int] = PROMPT,
                    backend: str = "torch") -> tuple[float, float, SpecEngine]:
    """G-test p-values of the engine's first token and first two tokens over N_ENGINE rows.

    Rows run with max_new_tokens = γ + 1, so the first step drafts a full γ, and with the stop
    string " t": the words "tA tB" contain it once a second token exists, so each row stops after
    two tokens (at most two steps) while its first step still drafted, verified and rolled back γ.
    """
    drafts = _drafts(kind, tiny_target, tiny_draft_model, backend)
    seed = _seed(kind, gamma, sampling_name, replicate)
    if kind == "all":
        arms = [Arm(NO_DRAFT, 0)] + [Arm(d.name, g) for d in drafts for g in (1, 3, 8)]
        router = RandomRouter(arms, seed)
    else:
        router = FixedRouter(Arm(kind, gamma))
    engine = SpecEngine(on_backend(tiny_target, backend), drafts, router=router, verify_backend=backend,
                        max_batch=ENGINE_ROWS)
    outputs = []
    for call in range(calls):
        sampling = SAMPLINGS[sampling_name].model_copy(update={"seed": seed + call})
        results = engine.generate([prompt] * (N_ENGINE // calls), max_new_tokens=gamma + 1, sampling=sampling,
                                  stop=" t")
        outputs += [r.token_ids for r in results]
    sampling = SAMPLINGS[sampling_name]
    law = prefix_law(tiny_target.model, prompt, sampling, engine.eos_ids, 2)
    p_first = g_test(count_outcomes(outputs, 1, engine.eos_ids), marginal(law, 1))
    p_joint = g_test(count_outcomes(outputs, 2, engine.eos_ids), law)
    return p_first, p_joint, engine


ENGINE_CASES = [
    ("model", 3, "T1"), ("model", 8, "T0.5"), ("model", 1, "T1.5-topk6-topp0.9"),
    ("prompt_lookup", 3, "T1"), ("prompt_lookup", 8, "T1-topk4"),
    ("suffix_cache", 8, "T1-topp0.7"), ("suffix_cache", 1, "T0.5"),
    ("model", 3, "T1-rep2"), ("prompt_lookup", 3, "T1-rep2"),
    ("model", 3, "T1-ng1"), ("prompt_lookup", 3, "T1-ng1"),
]
# One token, so every drafted token but one is new: what the penalty must track along the path.
# The draft is the unpenalised target itself, so its first token is often accepted and the
# positions after it, whose penalty depends on it, decide the second token.
SHORT_PROMPT = [3]


@pytest.mark.parametrize("sampling_name", ["T1-rep3", "T1-ng1"])
def test_engine_exact_with_a_path_processor_on_a_short_prompt(tiny_target, sampling_name):
    check_exact(lambda rep: _engine_pvalues(tiny_target, tiny_target.model, "model", 3, sampling_name, rep,
                                            prompt=SHORT_PROMPT)[:2], f"engine model γ=3 {sampling_name} short prompt")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, gamma, sampling_name", ENGINE_CASES, ids=[f"{k}-g{g}-{s}" for k, g, s in ENGINE_CASES])
def test_engine_first_two_tokens_follow_the_target(tiny_target, tiny_draft_model, kind, gamma, sampling_name, backend):
    check_exact(lambda rep: _engine_pvalues(tiny_target, tiny_draft_model, kind, gamma, sampling_name, rep,
                                            backend=backend)[:2], f"engine {kind} γ={gamma} {sampling_name} {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampling_name", ["T1", "T1.5-topk6-topp0.9"])
def test_engine_exact_under_a_router_switching_arms_at_random(tiny_target, tiny_draft_model, sampling_name, backend):
    routers = []

    def run(rep: int) -> tuple[float, float]:
        p_first, p_joint, engine = _engine_pvalues(tiny_target, tiny_draft_model, "all", 8, sampling_name, rep, calls=8,
                                                   backend=backend)
        routers.append(engine.router)
        return p_first, p_joint

    check_exact(run, f"engine random router {sampling_name}")
    assert len(set(routers[0].chosen)) >= 6, "the router should have tried many arms"
    assert any(a.draft == NO_DRAFT for a in routers[0].chosen)


@pytest.mark.parametrize("module, name, sampling_name", [("penalty", "_penalize", "T1-rep3"),
                                                        ("paths", "ban_repeated_ngrams", "T1-ng1")])
def test_engine_tests_reject_a_processor_blind_to_the_draft_path(tiny_target, monkeypatch, module, name, sampling_name):
    """The planted bug: penalise (or ban) every verify position by the verified tokens only, so a
    drafted token does not count at the positions after it (with the ban, the second token may
    then repeat the first, which the law forbids). The first token is unaffected (its prefix is
    the verified context), so the joint test of the first two tokens must reject, on two samples.
    The penalty is planted where a row alone and rows penalized together both compute it."""
    import importlib

    engine_module = importlib.import_module(f"flashspec_core.processors.{module}")
    original = getattr(engine_module, name)

    def blind(logits, history, drafts, *args):
        per_position = [original(logits[:, j:j + 1], history, drafts[:, :0], *args)
                        for j in range(logits.shape[1])]
        return torch.cat(per_position, dim=1)

    monkeypatch.setattr(engine_module, name, blind)
    for rep in (0, 1):
        p_first, p_joint, _ = _engine_pvalues(tiny_target, tiny_target.model, "model", 3, sampling_name, rep,
                                              prompt=SHORT_PROMPT)
        assert p_joint < ALPHA, f"a path-blind {name} went unnoticed (replicate {rep}): p(first two) = {p_joint:.2e}"


@pytest.mark.parametrize("kind, gamma, sampling_name", [("model", 3, "T1"), ("prompt_lookup", 3, "T1")])
def test_engine_tests_reject_a_broken_residual(tiny_target, tiny_draft_model, monkeypatch, kind, gamma, sampling_name):
    p_lookup = reference_probs(next_logits(tiny_target.model, [PROMPT]), SAMPLINGS[sampling_name])[0, LOOKUP_FIRST]
    assert 0.2 < p_lookup < 0.8, "the prompt-lookup draft must be neither hopeless nor certain to show a bias"
    broken = break_residual(monkeypatch)
    check_rejects(lambda rep: _engine_pvalues(tiny_target, tiny_draft_model, kind, gamma, sampling_name, rep)[:2],
                  f"engine {kind} γ={gamma} {sampling_name}")
    assert broken.calls > 0, "verify no longer routes the residual through torch.where: update break_residual"
