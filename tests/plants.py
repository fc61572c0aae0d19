"""Planted bugs the tests must catch, each with the test that shows it is caught.

Issue 15's, as verify functions (test_joint_law.py, test_engine_joint.py). Both keep every
acceptance test (so n_accepted is unchanged) and the support of the output, and change only how
the recovered token of a row rejected at draft position n >= 2 (0-based) is drawn:

- "u[n]": from the right residual max(0, p_n - q_n), but with the acceptance uniform u[n] instead
  of its own u[γ]. Given the rejection, u[n] >= p_n(x)/q_n(x) is not uniform, so the law moves
  while the support stays: the kind of bug only a law test can see.
- "q1": from max(0, p_n - q_1), the residual built with the draft's q at position 1.

Before issue 15 every exactness test passed with either (they looked at the first two tokens).

Issue 46's, a runner that reuses a slot's cached prompt one token past the prefix it shares with
the new request (`reuse_one_past`): the last reused position holds the previous request's keys
and values. test_prefix_reuse.py must fail with it on the default model on every CPU runner (the
tiny-model prefix test of test_engine.py fails too, on its count and on its output). And its
twin for a prefix copied from another row's cache (`share_one_past`): the copy takes one position
more than the two prompts share, so that position holds the other row's keys and values.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from flashspec_core.backends.prefix import common_prefix
from flashspec_core.processors.sampling import probs_from_logits, sample_from_probs
from flashspec_core.verify import verify

BUGS = ("u[n]", "q1")


def redraw(bug: str, p: torch.Tensor, q: torch.Tensor, n_acc: torch.Tensor, tokens: torch.Tensor,
           uniforms: torch.Tensor) -> torch.Tensor:
    """The tokens `verify` with `bug` returns, given the real call's output on the same inputs.

    p: [N, γ+1, V] target probabilities; q: [N, γ, V] draft laws (one-hot for deterministic
    drafts); n_acc: [N]; tokens: [N, γ+1]; uniforms: [N, γ+1]. Returns a new tokens [N, γ+1].
    """
    gamma = q.shape[1]
    if gamma < 3:
        return tokens  # no rejection at a position n >= 2
    rows = ((n_acc >= 2) & (n_acc < gamma)).nonzero().flatten()
    n = n_acc[rows]
    q_used = q[rows, 1] if bug == "q1" else q[rows, n]
    u = uniforms[rows, n] if bug == "u[n]" else uniforms[rows, gamma]
    out = tokens.clone()
    out[rows, n] = sample_from_probs((p[rows, n] - q_used.float()).clamp(min=0.0), u)
    return out


def planted_verify(bug: str):
    """A drop-in for `flashspec_core.verify.verify` (torch backend) with `bug` planted."""

    def run(target_logits, draft_tokens, draft_probs, sampling, uniforms=None, backend="auto", generator=None,
            check_finite=True):
        bsz, positions, vocab = target_logits.shape
        if uniforms is None:
            uniforms = torch.rand((bsz, positions), generator=generator, device=target_logits.device)
        n_acc, tokens = verify(target_logits, draft_tokens, draft_probs, sampling, uniforms, backend="torch")
        q = F.one_hot(draft_tokens.long(), vocab) if draft_probs is None else draft_probs
        return n_acc, redraw(bug, probs_from_logits(target_logits, sampling), q, n_acc, tokens, uniforms)

    return run


def reuse_one_past(runner):
    """A drop-in for `runner.prefix_len` (set on the instance: a draft's runner is left alone)
    with issue 46's bug planted.

    Where the row's cache and a new prompt first differ, at position n, it reports n + 1 and
    records the prompt's token there, so the forward that feeds the prompt keeps n + 1 positions
    and feeds from n + 1 on: position n keeps the previous request's keys and values. A prompt
    that extends the row (or that the row extends) is reused as before: nothing differs.
    """
    shared = runner.prefix_len

    def prefix_len(row: int, sequence: Sequence[int]) -> int:
        n = shared(row, sequence)
        held = runner.held[row]  # the tokens the runner takes its cache row to hold
        if n < min(len(held), len(sequence)):
            held[n] = sequence[n]
            n += 1
        return n

    return prefix_len


def share_one_past(runner):
    """A drop-in for `runner.share_prefix` (set on the instance) that, when it copies another row's
    prefix, copies one position more and reports it as the new prompt's own."""
    share = runner.share_prefix

    def share_prefix(row: int, sequence: Sequence[int]) -> int:
        own = runner.prefix_len(row, sequence)
        n = share(row, sequence)
        if own < n < len(sequence):  # copied from the row that holds the most of `sequence`
            source = max((b for b in range(len(runner.held)) if b != row),
                         key=lambda b: common_prefix(runner.held[b], sequence))
            runner.static.copy_prefix(source, row, n + 1)
            runner.held[row].append(sequence[n])
            n += 1
        return n

    return share_prefix
