"""Exact laws to test speculative output against, and the power of the G-tests that do it.

* `step_law`: the law of everything one verify step emits (the accepted draft tokens, then the
  recovered or bonus token; the length is the acceptance pattern) from the target's p and the
  draft's q at each position, by the algebra of speculative sampling alone (Leviathan et al. 2023,
  Chen et al. 2023): accepting x at position j has probability q_j(x) min(1, p_j(x)/q_j(x)) =
  min(p_j(x), q_j(x)); stopping there with y, max(0, p_j(y) - q_j(y)); the bonus after γ
  acceptances, p_γ(y). Nothing from flashspec_core is used.
* `hazard_design`: p and q per position under which every outcome of a step is equally likely,
  so that a G-test over all of them sees a 2 % error in any one of them with few rows.
* `prefix_law`: the law of the first L tokens of autoregressive sampling from a tiny target with
  transformers' own processors and warpers (repetition penalty over the prefix, n-gram ban over
  the output, temperature, top-k, top-p), optionally under a grammar's allowed sets.
* `rows_for` / `detectable_error`: the power calculation. A G-test over k cells against the exact
  law is asymptotically noncentral chi-square with k - 1 degrees of freedom; moving a relative
  share δ of the mass of one cell of probability p to the others gives noncentrality
  λ = N p δ² / (1 - p). With λ₀ the noncentrality at which the α = 0.01 test rejects with
  probability 0.9, N = λ₀ (1 - p) / (δ² p) rows see that error in the smallest cell.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from helpers import ALPHA, MIN_EXPECTED, next_logits, reference_probs
from scipy import optimize, stats
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from flashspec_core.processors.sampling import SamplingParams

POWER = 0.9
Law = dict[tuple[int, ...], float]


def step_law(p: np.ndarray, q: np.ndarray) -> Law:
    """Exact law of one verify step's emitted tokens.

    p: [γ+1, V] target probabilities at each position (the last one for the bonus token);
    q: [γ, V] the law each draft token is drawn from (one-hot rows for a deterministic draft).
    Positions are taken as fixed (prefix-independent), which is all `verify` sees.
    """
    gamma = q.shape[0]
    law: Law = {}

    def walk(prefix: tuple[int, ...], mass: float, j: int) -> None:
        stop = p[j] if j == gamma else np.maximum(p[j] - q[j], 0.0)
        for y in np.flatnonzero(stop > 0):
            law[prefix + (int(y),)] = mass * float(stop[y])
        if j < gamma:
            both = np.minimum(p[j], q[j])
            for x in np.flatnonzero(both > 0):
                walk(prefix + (int(x),), mass * float(both[x]), j + 1)

    walk((), 1.0, 0)
    assert abs(sum(law.values()) - 1.0) < 1e-9
    return law


@dataclass
class Design:
    """One verify step's inputs: p [γ+1, V], q [γ, V]; `one_hot` drafts propose argmax q_j."""

    p: np.ndarray
    q: np.ndarray
    one_hot: bool


def hazard_design(gamma: int, one_hot: bool) -> Design:
    """p and q under which each of the k outcomes of a step has probability 1/k.

    A stop at position j has k_j outcomes (its residual's support), the bonus k_γ; the step stops
    at j with probability w_j = k_j / k, so position j accepts with probability a_j = 1 - w_j /
    (1 - w_0 - ... - w_{j-1}) (a hazard rate).

    one_hot (V = 3, the draft token j % 3 at position j, so that position 1's q differs from
    later ones'): p_j gives the draft token a_j and the other two (1 - a_j) / 2 each; bonus uniform.
    model q (V = 4; at position j token A = j % 4 is proposed with probability α_j and token
    R = (j+1) % 4, which the target never emits (logit -inf), otherwise; C and D only the target
    emits): at even j, q_j(A) = (1 + a_j) / 2 > p_j(A) = a_j, so A passes the min(1, p/q) test
    with probability a_j / α_j and the residual is p on C and D; at odd j, q_j(A) = a_j < p_j(A),
    so A always passes and the residual keeps p_j(A) - q_j(A) beside C and D. Bonus uniform.
    """
    vocab = 3 if one_hot else 4
    k_stop = [2 if one_hot or j % 2 == 0 else 3 for j in range(gamma)] + [vocab]
    cell = 1.0 / sum(k_stop)
    p, q = np.zeros((gamma + 1, vocab)), np.zeros((gamma, vocab))
    p[gamma] = 1.0 / vocab
    survive = 1.0
    for j in range(gamma):
        w = k_stop[j] * cell
        a = 1.0 - w / survive
        survive -= w
        tok = j % vocab
        if one_hot:
            q[j, tok] = 1.0
            p[j], p[j, tok] = (1.0 - a) / 2, a
            continue
        decoy = (tok + 1) % vocab  # proposed, never emitted: p = 0
        others = [t for t in range(vocab) if t not in (tok, decoy)]
        if j % 2 == 0:  # q(A) > p(A): the ratio test decides
            q[j, tok], q[j, decoy] = (1.0 + a) / 2, (1.0 - a) / 2
            p[j, tok], p[j, others] = a, (1.0 - a) / 2
        else:  # q(A) < p(A): A always passes, the residual keeps p(A) - q(A)
            q[j, tok], q[j, decoy] = a, 1.0 - a
            p[j, tok], p[j, others] = a + (1.0 - a) / 3, (1.0 - a) / 3
    return Design(p, q, one_hot)


def _noncentrality(df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """λ₀: the noncentrality at which a chi-square test with `df` degrees of freedom rejects at
    level `alpha` with probability `power`."""
    crit = stats.chi2.isf(alpha, df)
    return optimize.brentq(lambda lam: stats.ncx2.sf(crit, df, lam) - power, 1e-6, 1e6)


def rows_for(law: Law, rel: float = 0.02) -> int:
    """Rows for which a relative error `rel` in the law's smallest cell is detected with
    probability POWER at α = ALPHA (every cell then has expected count far above MIN_EXPECTED)."""
    p_min = min(law.values())
    return int(np.ceil(_noncentrality(len(law) - 1) * (1.0 - p_min) / (rel ** 2 * p_min)))


def detectable_error(law: Law, rows: int, p_cell: float | None = None) -> float:
    """The relative error in one cell of probability `p_cell` (default: the smallest cell the
    G-test keeps, expected >= MIN_EXPECTED) detected with probability POWER at α = ALPHA."""
    kept = [p for p in law.values() if p * rows >= MIN_EXPECTED]
    p_cell = min(kept) if p_cell is None else p_cell
    df = len(kept) - (0 if len(kept) < len(law) else 1)  # the pooled rest is one more cell
    return float(np.sqrt(_noncentrality(df) * (1.0 - p_cell) / (rows * p_cell)))


def marginal(law: Law, length: int) -> Law:
    """The law of the first `length` tokens of each outcome."""
    out: Law = {}
    for key, prob in law.items():
        out[key[:length]] = out.get(key[:length], 0.0) + prob
    return out


@torch.no_grad()
def prefix_law(model, prompt: Sequence[int], sampling: SamplingParams, eos_ids: frozenset[int], length: int,
               allowed: Callable[[tuple[int, ...]], list[int]] | None = None) -> Law:
    """Exact law of the first `length` generated tokens, cut after an EOS.

    Processors in the engine's order with HF's implementations: the repetition penalty over the
    whole prefix, the grammar's `allowed(output)` tokens (others -inf), the n-gram ban over the
    output only (the engine's choice, ngram_ban.py), then the warpers (`reference_probs`).
    """
    law: Law = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    for depth in range(length):
        if not frontier:
            break
        contexts = torch.tensor([list(prompt) + list(prefix) for prefix, _ in frontier])
        logits = next_logits(model, contexts.tolist())
        if sampling.repetition_penalty != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)(contexts, logits)
        if allowed is not None:
            for row, (prefix, _) in enumerate(frontier):
                forbidden = torch.ones(logits.shape[1], dtype=torch.bool)
                forbidden[allowed(prefix)] = False
                logits[row, forbidden] = float("-inf")
        if sampling.no_repeat_ngram_size and depth:
            outputs = contexts[:, len(prompt):]  # [rows, depth]
            logits = NoRepeatNGramLogitsProcessor(sampling.no_repeat_ngram_size)(outputs, logits)
        probs = reference_probs(logits, sampling)
        nxt = []
        for (prefix, p_prefix), row in zip(frontier, probs):
            for tok in np.flatnonzero(row > 0):
                key, prob = prefix + (int(tok),), p_prefix * float(row[tok])
                if tok in eos_ids or depth == length - 1:
                    law[key] = law.get(key, 0.0) + prob
                else:
                    nxt.append((key, prob))
        frontier = nxt
    assert abs(sum(law.values()) - 1.0) < 1e-9
    return law
