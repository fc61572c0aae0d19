"""One forward of ragged rows over a `StaticLlama`'s cache: the CPU runner's forward.

A step's rows (one row's draft, another's single token, a new request's prompt piece) are fed as
one sequence of T tokens in B segments, each segment a row's new tokens, with no padding: every
matrix product reads the weights once for all of them (a CPU forward costs the tokens it
computes), and attention runs per run of alike segments over each row's live slots only. With a
`NativeLayers` (every projection from GGUF blocks) the whole layer stack is one native call
(`decode_layers.c` takes the same segments); otherwise the model's own submodules run in torch,
as `StaticLlama` calls them, with the attention masks built here.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from flashspec_core.backends.cpu_linear import project
from flashspec_core.backends.static_llama import StaticLlama, rms_norm

if TYPE_CHECKING:
    from flashspec_core.backends.native_layers import NativeLayers

CAUSAL = "causal"  # `live_mask`: every segment starts empty, SDPA's own causal mask
CHUNK = 512  # queries per attention pass of a long feed after a reused prefix (see `_runs`)


@dataclass(frozen=True)
class Feed:
    """The tokens of one ragged forward: segment b is tokens starts[b] .. starts[b + 1] - 1, fed
    to cache row rows[b] at its positions (the row's held length onwards)."""

    ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    starts: torch.Tensor  # [B + 1] long, 0 .. T
    rows: torch.Tensor  # [B] long, distinct cache rows

    @classmethod
    def of(cls, chunks: Sequence[Sequence[int]], offsets: Sequence[int], rows: Sequence[int]) -> Feed:
        """chunks[b]: the tokens row rows[b] is fed (at least one), from position offsets[b] on."""
        widths = [len(c) for c in chunks]
        if not widths or min(widths) < 1:
            raise ValueError("chunks: every segment feeds at least one token")
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
        positions = torch.cat([torch.arange(o, o + w) for o, w in zip(offsets, widths)])
        starts = torch.tensor([0, *widths], dtype=torch.long).cumsum(0)
        return cls(ids, positions, starts, torch.tensor(list(rows), dtype=torch.long))

    def ends(self) -> torch.Tensor:
        """[B] each segment's last token's index into the T tokens."""
        return self.starts[1:] - 1


@torch.inference_mode()
def hidden(static: StaticLlama, feed: Feed, native: NativeLayers | None = None) -> torch.Tensor:
    """The final norm's output [T, hidden] of `feed`'s tokens, their keys and values written into
    `static`'s cache at their rows and positions (each below `static.max_len`). A token attends to
    slots 0..its position of its row. native: run the layer stack there where it can."""
    inner = static.model.model
    x: torch.Tensor = inner.embed_tokens(feed.ids[None])  # [1, T, hidden]
    cos, sin = inner.rotary_emb(x, feed.positions[None])  # [1, T, D] each
    if native is not None:
        out = native(x[0], cos[0], sin[0], feed.positions, feed.starts, feed.rows)
        if out is not None:
            return out
    widths = feed.starts[1:] - feed.starts[:-1]
    rows = feed.rows.repeat_interleave(widths)[None]  # [1, T]: each token's cache row
    runs = list(_runs(feed))
    for i, layer in enumerate(static.layers):
        h = rms_norm(layer.input_layernorm, x)
        x = x + _attend(static, i, layer, h, cos, sin, rows, feed.positions[None], runs)
        x = x + static._mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, x))
    return rms_norm(inner.norm, x)[0]


@dataclass(frozen=True)
class _Run:
    """Adjacent segments of one width on consecutive cache rows, attended in one pass per slice:
    tokens t0 .. t0 + n * width - 1, rows row0 .. row0 + n - 1, query columns in slices of `step`."""

    t0: int
    n: int
    width: int
    row0: int
    step: int
    positions: torch.Tensor  # [n, width]


def _runs(feed: Feed) -> Iterator[_Run]:
    """The attention passes of a feed. Segments fed from an empty row go in one causal pass (SDPA's
    own mask skips the blocks above the diagonal); after a reused prefix, a long segment attends in
    slices of CHUNK queries, so the explicit mask wastes only the blocks above each slice's
    diagonal, not above the whole feed's."""
    starts, rows = feed.starts.tolist(), feed.rows.tolist()
    b = 0
    while b < len(rows):
        width = starts[b + 1] - starts[b]
        n = 1
        while (b + n < len(rows) and starts[b + n + 1] - starts[b + n] == width
               and rows[b + n] == rows[b] + n):
            n += 1
        positions = feed.positions[starts[b]:starts[b + n]].view(n, width)
        fresh = bool((positions[:, 0] == 0).all())
        yield _Run(starts[b], n, width, rows[b], width if fresh else CHUNK, positions)
        b += n


def live_mask(static: StaticLlama, positions: torch.Tensor, length: int) -> torch.Tensor | str | None:
    """The mask over the live slots [0, length) for `attend_live`. positions: [B, W] on the host.

    CAUSAL when every row starts empty (a prompt's prefill: SDPA's own causal mask, no mask
    tensor, as transformers runs a prompt); None when every query sees every live slot (one
    token per row at the end: plain decoding); else additive [B, 1, G*W, length] (0 or -inf; SDPA
    would convert booleans in every layer), row g*W + w for query w of the g-th query head of
    each key/value head (`attend_live` packs them so).
    """
    bsz, width = positions.shape
    if width == length and torch.equal(positions, torch.arange(width).expand(bsz, width)):
        return CAUSAL
    seen = torch.arange(length)[None, None, :] <= positions[:, :, None]  # [B, W, L]
    if width == 1 and bool(seen.all()):
        return None
    mask = torch.zeros(seen.shape, dtype=static.dtype).masked_fill_(~seen, float("-inf"))
    return mask.unsqueeze(1).repeat(1, 1, static.n_heads // static.n_kv, 1)


def attend_live(static: StaticLlama, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | str | None) -> torch.Tensor:
    """Attention over the live slices keys, values: [B, H_kv, L, D] (views of the cache, not copied).

    q: [B, H, W, D]; mask: what `live_mask` returns; returns [B, H, W, D]. The query heads of
    each key/value head are packed as extra query rows (as transformers does for one query token
    with a mask), so grouped heads need no copy of the keys.
    """
    if mask is CAUSAL:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=static.scaling,
                                              enable_gqa=static.n_heads != static.n_kv)
    bsz, heads, width, d = q.shape
    packed = q.reshape(bsz, static.n_kv, heads // static.n_kv * width, d)  # row g*W + w of kv head
    additive = mask if isinstance(mask, torch.Tensor) else None  # CAUSAL returned above
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=additive, scale=static.scaling)
    return out.reshape(bsz, heads, width, d)


def _attend(static: StaticLlama, i: int, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            rows: torch.Tensor, positions: torch.Tensor, runs: Sequence[_Run]) -> torch.Tensor:
    """One attention block over a feed. h: [1, T, hidden]; cos, sin: [1, T, D]; rows, positions:
    [1, T] (each token's cache row and position); runs: `_runs`'. q, k and v come from one
    stacked product where the layers run from GGUF blocks (else three, concatenated)."""
    attn = layer.self_attn
    tokens = h.shape[1]
    nq, d = static.n_heads, static.head_dim
    qkv = project(h, (attn.q_proj, attn.k_proj, attn.v_proj), stacked=True)  # [1, T, (H + 2 H_kv) * D]
    q = static._rope_and_cache(i, attn, qkv, cos, sin, rows, positions).reshape(nq, tokens, d)  # [H, T, D]
    out = torch.empty(tokens, nq, d, dtype=q.dtype)  # [T, H, D]
    for run in runs:
        t1 = run.t0 + run.n * run.width
        q_run = q[:, run.t0:t1].view(nq, run.n, run.width, d).transpose(0, 1)  # [n, H, W, D]
        pieces = []
        for c in range(0, run.width, run.step):
            cols = run.positions[:, c:c + run.step]  # [n, w]
            length = int(cols.max()) + 1
            live = slice(run.row0, run.row0 + run.n)
            pieces.append(attend_live(static, q_run[:, :, c:c + run.step], static.keys[i][live, :, :length],
                                      static.values[i][live, :, :length], live_mask(static, cols, length)))
        part = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]  # [n, H, W, D]
        out[run.t0:t1] = part.permute(0, 2, 1, 3).reshape(run.n * run.width, nq, d)
    return attn.o_proj(out.reshape(1, tokens, nq * d))
