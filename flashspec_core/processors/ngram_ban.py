"""No repeated n-grams in the output, along draft paths: exact under speculation, safe under a grammar.

A token that would complete an n-gram the output already holds is banned (HF's
`NoRepeatNGramLogitsProcessor`, which the tests hold it to), with two differences: only the output
counts, not the prompt; and under a JSON schema tokens carrying JSON punctuation are exempt, and a
position where the ban would forbid every token the grammar allows keeps its logits. Each verify
position gets the ban of its own path (output + draft[:j]), so speculation keeps the law; float32
whatever the model's dtype, as HF `generate`. The output lives on the logits' device (`OutputTokens`)
and a few tensor ops ban every position of every row, no host sync. Why: docs/design.md, "Processors".
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_JSON_PUNCTUATION = frozenset('"{}[]:,')


def json_punctuation_tokens(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> torch.Tensor:
    """[V] bool: the token ids whose text contains JSON punctuation (exempt under a schema)."""
    exempt = torch.zeros(vocab_size, dtype=torch.bool)
    for i, text in enumerate(tokenizer.batch_decode([[i] for i in range(min(vocab_size, len(tokenizer)))])):
        exempt[i] = not _JSON_PUNCTUATION.isdisjoint(text)
    return exempt


class OutputTokens:
    """Each row's generated tokens (prompt excluded), on the logits' device, for one request.

    tokens: [B, C] long, row b's output in tokens[b, :lengths[b]] (the rest is padding); lengths
    stay host ints, since they set the shapes of the ban's tensors. The engine commits each step's
    verified tokens, so the ban never copies the whole output over.
    """

    def __init__(self, outputs: Sequence[Sequence[int]], device: torch.device | str = "cpu", capacity: int = 64):
        """outputs: B token lists (empty at the start of a request)."""
        self.lengths = [0] * len(outputs)
        width = max([capacity, *(len(o) for o in outputs)])
        self.tokens = torch.zeros((len(outputs), width), dtype=torch.long, device=device)  # [B, C]
        for row, tokens in enumerate(outputs):
            self.commit(row, tokens)

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to `row`'s output (the buffer doubles when full)."""
        if not tokens:
            return
        start, end = self.lengths[row], self.lengths[row] + len(tokens)
        capacity = self.tokens.shape[1]
        if end > capacity:
            grown = self.tokens.new_zeros((self.tokens.shape[0], max(end, 2 * capacity)))  # [B, C']
            grown[:, :capacity] = self.tokens
            self.tokens = grown
        self.tokens[row, start:end].copy_(torch.tensor([int(t) for t in tokens], dtype=torch.long), non_blocking=True)
        self.lengths[row] = end


def ban_repeated_ngrams(
    logits: torch.Tensor, outputs: OutputTokens, drafts: torch.Tensor, size: int, exempt: torch.Tensor | None = None,
) -> torch.Tensor:
    """Set to -inf every token that would repeat an n-gram of `size` tokens along each draft path.

    logits: [B, P, V] processed logits (penalty and grammar mask applied); position j of row b
    scores the token after row b's output + drafts[b, :j]. drafts: [B, >= P - 1] long, on the
    logits' device. exempt: [V] bool, tokens never banned (None: none), best on the logits' device.
    Returns a [B, P, V] float32 tensor (the input is never modified); a position the ban would
    empty keeps its logits. size 0 returns `logits` itself.
    """
    if size <= 0:
        return logits
    logits = logits.float()
    device = logits.device
    bsz, positions, vocab = logits.shape
    longest = max(outputs.lengths)
    width = max(longest + positions - 1, size)  # every row's whole path fits; unfold needs >= size
    lengths = torch.tensor(outputs.lengths, dtype=torch.long).to(device, non_blocking=True)  # [B]

    # Row b's path, output + drafts[b, :P - 1], left-aligned (what lies past it is never read).
    path = torch.zeros((bsz, width), dtype=torch.long, device=device)  # [B, W]
    path[:, :longest] = outputs.tokens[:, :longest].to(device)
    draft_cols = lengths[:, None] + torch.arange(positions - 1, device=device)  # [B, P - 1]
    path.scatter_(1, draft_cols, drafts[:, : positions - 1].to(device))

    # Position j's prefix is path[:, :L + j]: its last size - 1 tokens (the tail), and the windows
    # path[:, i : i + size] that lie inside it (i <= L + j - size).
    ends = lengths[:, None] + torch.arange(positions, device=device)  # [B, P]: L + j
    tail_cols = ends[:, :, None] - (size - 1) + torch.arange(size - 1, device=device)  # [B, P, size - 1]
    tails = path.gather(1, tail_cols.clamp(min=0).view(bsz, -1)).view(bsz, positions, size - 1)
    windows = path.unfold(1, size, 1)  # [B, N, size], N = W - size + 1
    starts = torch.arange(windows.shape[1], device=device)  # [N]
    inside = starts[None, None, :] <= ends[:, :, None] - size  # [B, P, N]
    match = (windows[:, None, :, :-1] == tails[:, :, None, :]).all(-1) & inside  # [B, P, N]

    # Ban each matching window's last token: non-matches write to a spare column V, dropped after,
    # so every write is a True and duplicates cannot race.
    targets = torch.where(match, windows[:, None, :, -1], vocab)  # [B, P, N]
    banned = torch.zeros((bsz, positions, vocab + 1), dtype=torch.bool, device=device)
    banned = banned.scatter_(2, targets, True)[..., :vocab]  # [B, P, V]
    if exempt is not None:
        banned &= ~exempt.to(device)
    processed = logits.masked_fill(banned, float("-inf"))
    keeps = torch.isfinite(processed).any(-1, keepdim=True)  # [B, P, 1]: the ban left something
    return torch.where(keeps, processed, logits)
