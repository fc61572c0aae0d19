"""Per-request grammar state: mask the target's logits along a draft path, commit verified tokens.

The verifier sees, at every position of the draft path, the target's logits masked by the grammar
state after the draft tokens before it: the matcher walks the draft, fills one mask per position
and rolls back. A forbidden draft token has p = 0 and is rejected (its residual lies inside the
grammar), so the positions after it stay unmasked. Only verified tokens are committed. Nothing
depends on the draft's q, so the law of grammar-masked decoding holds for any draft (see
docs/constrained.md). A row's matcher follows the row's output; `cursor()` positions it at an
earlier context (the router scores drafts after the fact) and restores it on exit.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from flashspec_core.constrained.grammar import Grammar, xgr

_SHIFTS = torch.arange(32, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack xgrammar's bitmask (bit j of word i allows token 32 i + j).

    bitmask: [..., W] int32, on any device. Returns [..., V] bool on the same device.
    """
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()


class GrammarCursor:
    """A row's matcher positioned at some context; everything accepted through it is undone on exit."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._scratch = torch.empty((1, bitmask_width(vocab_size)), dtype=torch.int32)
        self.accepted = 0

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def jump_forward(self) -> list[int]:
        """Tokens spelling the string the grammar forces next (xgrammar's tokenization of it)."""
        return list(self._matcher.find_jump_forward_tokens())

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (none once terminated)."""
        if self._matcher.is_terminated():
            return torch.zeros(self._vocab_size, dtype=torch.bool)
        self._matcher.fill_next_token_bitmask(self._scratch)
        return allowed_from_bitmask(self._scratch, self._vocab_size)[0]

    def sole_token(self) -> int | None:
        """The only token the grammar allows next (a closing bracket, EOS at the end), if unique."""
        if self._matcher.is_terminated():
            return None
        self._matcher.fill_next_token_bitmask(self._scratch)
        words = self._scratch.numpy()[0]
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1:
            return None
        word = int(words[nonzero[0]]) & 0xFFFFFFFF
        if word & (word - 1):
            return None
        return int(nonzero[0]) * 32 + word.bit_length() - 1

    def accept(self, token: int) -> bool:
        """Advance by `token` if the grammar allows it; False (state unchanged) otherwise."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
            return False
        self.accepted += 1
        return True


class Constraint:
    """One grammar applied to every row of a request.

    prompts: each row's prompt ids (rows are told apart by their sequences in `cursor`).
    """

    def __init__(self, grammar: Grammar, prompts: Sequence[Sequence[int]]):
        if not isinstance(grammar, Grammar):
            raise ValueError(f"grammar must be a flashspec_core.constrained.Grammar; got {type(grammar).__name__}")
        self.grammar = grammar
        self.vocab_size = grammar.vocab_size
        self._width = bitmask_width(grammar.vocab_size)
        self._matchers = [xgr.GrammarMatcher(grammar.compiled, max_rollback_tokens=-1) for _ in prompts]
        self._prompts = [list(p) for p in prompts]
        self._outputs: list[list[int]] = [[] for _ in prompts]

    @property
    def batch_size(self) -> int:
        return len(self._matchers)

    def output(self, row: int) -> list[int]:
        """The tokens committed to `row` so far (a copy)."""
        return list(self._outputs[row])

    def is_terminated(self, row: int) -> bool:
        """The row accepted a stop token where the grammar was complete."""
        return self._matchers[row].is_terminated()

    def mask_logits(
        self, logits: torch.Tensor, draft_tokens: Sequence[Sequence[int]], active: Sequence[bool]
    ) -> torch.Tensor:
        """The target's logits masked by the grammar along each row's draft path.

        logits: [B, γ+1, V] (position j scores the token after draft_tokens[b][:j]);
        draft_tokens: B lists of at least γ ids. Returns a [B, γ+1, V] float32 tensor (as every
        logits processor, whatever the model's dtype), -inf where the grammar forbids: a new one,
        or the logits themselves (as float32) where it forbids nothing. Inactive rows, and
        positions after a forbidden draft token, are unmasked.
        """
        bsz, positions, vocab = logits.shape
        if bsz != self.batch_size or vocab != self.vocab_size:
            raise ValueError(
                f"logits must be [B={self.batch_size}, γ+1, V={self.vocab_size}]; got {tuple(logits.shape)}"
            )
        bitmask = self._path_bitmask(draft_tokens, active, positions)
        if bool((bitmask == -1).all()):
            # Nothing is forbidden anywhere (free text under a structural tag, for one): masking
            # would change no logit, so skip unpacking the bits and copying the logits.
            return logits.float()
        allowed = allowed_from_bitmask(bitmask.to(logits.device, non_blocking=True), vocab)
        return logits.float().masked_fill(~allowed.view(bsz, positions, vocab), float("-inf"))

    def forbids_nothing(self, draft_tokens: Sequence[Sequence[int]], active: Sequence[bool]) -> bool:
        """Whether the grammar allows every token at every position of every active row's draft
        path (γ+1 positions for γ draft tokens): `mask_logits` would then return the target's
        logits unchanged, so the step may be verified on them as they are (a fused CUDA-graph
        replay, say) and committed as usual. Free text under a structural tag, mostly."""
        positions = 1 + max((len(d) for d, a in zip(draft_tokens, active) if a), default=0)
        return bool((self._path_bitmask(draft_tokens, active, positions) == -1).all())

    def _path_bitmask(self, draft_tokens: Sequence[Sequence[int]], active: Sequence[bool],
                      positions: int) -> torch.Tensor:
        """[B * positions, W] int32: row b's masks at its path's positions (all bits set where unmasked)."""
        bitmask = torch.full((self.batch_size * positions, self._width), -1, dtype=torch.int32)
        for b in range(self.batch_size):
            if active[b]:
                self._fill_path(b, list(draft_tokens[b][: positions - 1]), bitmask, b * positions)
        return bitmask

    def _fill_path(self, row: int, path: list[int], bitmask: torch.Tensor, base: int) -> None:
        matcher = self._matchers[row]
        walked = 0
        try:
            for j in range(len(path) + 1):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, base + j)
                if j == len(path) or not matcher.accept_token(int(path[j])):
                    break
                walked += 1
        finally:
            if walked:
                matcher.rollback(walked)

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        """Advance `row` by its verified tokens; a token the grammar forbids is a bug upstream."""
        matcher = self._matchers[row]
        for tok in tokens:
            if matcher.is_terminated() or not matcher.accept_token(int(tok)):
                raise RuntimeError(
                    f"token {tok} of row {row} violates the grammar after {len(self._outputs[row])} "
                    "tokens: the target's logits were not masked before verification"
                )
            self._outputs[row].append(int(tok))

    def _find_row(self, context: Sequence[int], row: int | None) -> tuple[int, int] | None:
        """(row, output tokens in context) for the row whose sequence extends `context`."""
        candidates = [row] if row is not None and 0 <= row < self.batch_size else []
        candidates += [b for b in range(self.batch_size) if b != row]
        for b in candidates:
            prompt, out = self._prompts[b], self._outputs[b]
            n_out = len(context) - len(prompt)
            if 0 <= n_out <= len(out) and list(context[len(prompt):]) == out[:n_out] \
                    and list(context[: len(prompt)]) == prompt:
                return b, n_out
        return None

    @contextmanager
    def cursor(self, context: Sequence[int], row: int | None = None) -> Iterator[GrammarCursor | None]:
        """A cursor at `context` (a row's prompt + a prefix of its output), or None if no row matches.

        `row` is tried first. The matcher is rolled back to the context and restored on exit.
        """
        found = self._find_row(context, row)
        if found is None:
            yield None
            return
        b, n_out = found
        matcher = self._matchers[b]
        behind = self._outputs[b][n_out:]
        if behind:
            matcher.rollback(len(behind))
        cursor = GrammarCursor(matcher, self.vocab_size)
        try:
            yield cursor
        finally:
            if cursor.accepted:
                matcher.rollback(cursor.accepted)
            for tok in behind:
                matcher.accept_token(tok)
