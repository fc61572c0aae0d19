"""Repetition penalty along draft paths: HF's `repetition_penalty`, exact under speculation.

The CTRL penalty: the logit of every token already in the sequence (prompt included) is divided by
the penalty when positive and multiplied by it when negative. Position j of a verify pass scores
the token after context + draft[:j], so each position gets the penalty of its own prefix (as the
grammar mask does) and the output law is unchanged by speculation. The seen tokens live on the
logits' device (`SeenTokens`, [B, V] bool), built from the prompts and added to with each step's
committed tokens. Computed in float32 whatever the model's dtype, as HF `generate` does. Why:
docs/design.md, "Processors".
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class SeenTokens:
    """Which tokens each row's sequence holds so far, on the logits' device, for one request.

    mask: [B, V] bool. The engine builds it from the prompts and commits each step's verified
    tokens, so the penalty never rereads the sequence from the host. Commits wait on the host
    until the mask is read, and rows of many requests penalized together (`penalize_rows`) write
    theirs in one device op (`stacked`), not a few ops per row and step.
    """

    def __init__(self, contexts: Sequence[Sequence[int]], vocab: int, device: torch.device | str = "cpu"):
        """contexts: B token lists (the prompts); vocab: V, the logits' last dimension."""
        self._mask = torch.zeros((len(contexts), vocab), dtype=torch.bool, device=device)  # [B, V]
        self._rows: list[int] = []  # committed (row, token) pairs not written to the mask yet
        self._ids: list[int] = []
        for row, tokens in enumerate(contexts):
            self.commit(row, tokens)

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        """Mark `tokens` as seen in `row` (ids outside [0, V) are ignored, as HF ignores them)."""
        vocab = self._mask.shape[1]
        ids = [int(t) for t in tokens if 0 <= t < vocab]
        self._rows += [row] * len(ids)
        self._ids += ids

    @property
    def mask(self) -> torch.Tensor:
        """[B, V] bool: every token committed so far (written now if some wait)."""
        if self._ids:
            _write(self._mask, self._rows, self._ids)
            self._rows, self._ids = [], []
        return self._mask

    @staticmethod
    def stacked(seen: Sequence[SeenTokens]) -> torch.Tensor:
        """[n, V]: the masks of n one-row requests, one under the other, with every waiting commit
        written in one op; each request's mask is then its row of the result (a view)."""
        if any(s._mask.shape[0] != 1 for s in seen):
            raise ValueError("seen: SeenTokens.stacked takes requests of one row each")
        stack = torch.cat([s._mask for s in seen])  # [n, V]
        rows = [i for i, s in enumerate(seen) for _ in s._ids]
        _write(stack, rows, [t for s in seen for t in s._ids])
        for i, s in enumerate(seen):
            s._mask, s._rows, s._ids = stack[i:i + 1], [], []
        return stack


def _write(mask: torch.Tensor, rows: list[int], ids: list[int]) -> None:
    """mask[rows[k], ids[k]] = True for every k: an async copy of the indices and one write, no host sync."""
    if ids:
        index = torch.tensor([rows, ids], dtype=torch.long).to(mask.device, non_blocking=True)  # [2, n]
        mask.index_put_((index[0], index[1]), torch.ones((), dtype=torch.bool, device=mask.device))


def penalize_paths(logits: torch.Tensor, seen: SeenTokens, drafts: torch.Tensor, penalty: float) -> torch.Tensor:
    """Apply the repetition penalty to each position of each row along its draft path.

    logits: [B, P, V] raw logits; position j of row b scores the token after the row's sequence
    (the tokens in `seen`) + drafts[b, :j]. drafts: [B, >= P - 1] long, on the logits' device.
    Returns a new [B, P, V] float32 tensor (the input is not modified); penalty 1 returns `logits`
    itself, in its own dtype (casting to float32 is exact, so nothing downstream can tell).
    """
    if penalty == 1.0:
        return logits
    return _penalize(logits, seen.mask.to(logits.device), drafts, penalty)


def penalize_rows(logits: Sequence[torch.Tensor], seen: Sequence[SeenTokens], drafts: torch.Tensor,
                  penalty: float) -> list[torch.Tensor]:
    """`penalize_paths` for rows of different requests (each its own tokens seen) and different
    path lengths, in one set of device ops for all of them rather than one per row. The penalty is
    one number, as penalize_paths takes it: a number and a tensor of numbers may round a division
    differently (CUDA divides by a host number as a product with its reciprocal).

    logits: n tensors [P_i, V]; seen: each row's (one row each); drafts: [n, >= max P_i - 1] long on
    the logits' device, row i's draft first (ids past it are ignored). Returns n float32 tensors
    [P_i, V], each equal to penalize_paths on its row alone.
    """
    lengths = [t.shape[0] for t in logits]
    stacked = torch.nn.utils.rnn.pad_sequence(list(logits), batch_first=True)  # [n, max P_i, V], zeros past P_i
    mask = SeenTokens.stacked(seen).to(stacked.device)  # [n, V]
    # past a row's draft, padding ids (< 0) would index nothing: their positions are dropped below
    path = drafts[:, : max(max(lengths) - 1, 0)].clamp(min=0)
    out = _penalize(stacked, mask, path, penalty)
    return [out[i, :n] for i, n in enumerate(lengths)]


def _penalize(logits: torch.Tensor, seen: torch.Tensor, drafts: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits: [B, P, V]; seen: [B, V] bool; drafts: [B, >= P - 1] long. Returns [B, P, V]
    float32 (see penalize_paths)."""
    logits = logits.float()
    positions = logits.shape[1]
    marked = seen[:, None, :].repeat(1, positions, 1)  # [B, P, V]
    if positions > 1:
        # Position j (>= 1) also holds drafts[:, :j]: a [B, P - 1, P - 1] index whose entries k >= j
        # repeat drafts[:, 0] (held at every j >= 1), so every write is a True that belongs there.
        path = drafts[:, : positions - 1].to(logits.device)  # [B, P - 1]
        k = torch.arange(positions - 1, device=logits.device)
        held = k[None, :] < k[:, None] + 1  # [P - 1, P - 1]: row j - 1, column k: k < j
        ids = torch.where(held, path[:, None, :], path[:, :1, None])  # [B, P - 1, P - 1]
        marked[:, 1:].scatter_(2, ids, True)
    scaled = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(marked, scaled, logits)
