"""A `StaticLlama`'s layer stack in one native call, where every layer runs from GGUF blocks.

`decode_layers.c` runs every layer (norms, q|k|v, rotation and cache writes, attention over the
live slots, o, gate|up, SiLU, down, residual adds) in one OpenMP region over the blocks of
`blockq.py` and the same cache tensors, in fp32, step for step as transformers computes it; the
embedding, transformers' rotary cos and sin and the LM head stay in torch. Which widths it runs is
the calibration's (kernels NATIVE and NATIVE_4ROW: products in tiles of 1 and of 4 rows). It takes
Llama-family models (Qwen2's q/k/v biases and Qwen3's q/k norms included, no other bias) whose
seven projections per layer are all blocks, with a SiLU-gated MLP; others keep the torch forward.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from flashspec_core.backends import blockq
from flashspec_core.backends.blockq import LAYOUTS, BlockWeight
from flashspec_core.backends.cpu_linear import PackedLinear
from flashspec_core.backends.static_llama import _RMS_NORMS, StaticLlama, _eps

logger = logging.getLogger(__name__)

NATIVE = "gguf-native"
NATIVE_4ROW = "gguf-native-4row"  # the same with the block kernel's tiles of 4 rows (blockq.set_tile_rows)
CHUNK = 128  # cache slots per attention work item: 32 KB of keys and values per kv head


def _projections(layer: Any) -> tuple[Any, ...]:
    """A decoder layer's projection modules (nn.Linear or PackedLinear) in decode_layers.c's order."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def _qk_norms(layer: Any) -> tuple[Any, Any] | None:
    """A decoder layer's per-head q and k norms (Qwen3's q_norm, k_norm), or None without them."""
    attn = layer.self_attn
    if not hasattr(attn, "q_norm"):
        return None
    return attn.q_norm, attn.k_norm


def _qk_eps(static: StaticLlama) -> float:
    """The q/k norms' eps (one for every layer: `eligible` checks), or the layer norms' without them."""
    norms = _qk_norms(static.layers[0])
    return _eps(static.layers[0].input_layernorm if norms is None else norms[0])


def _fp32_vector(t: Any, size: int) -> bool:
    """Whether t is a contiguous fp32 CPU tensor of `size` values (what decode_layers.c reads)."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
            and t.is_contiguous() and t.numel() == size and t.dim() == 1)


def _attention_extras_refusal(static: StaticLlama, layer: Any, qk_eps: float) -> str | None:
    """Why a layer's q/k/v biases or q/k norms are not what decode_layers.c computes (None: they
    are): it takes fp32 vectors of the projections' widths, transformers' RMSNorms over head_dim
    with the model's one q/k eps, and no bias on o, gate, up or down."""
    (q, k, v, *rest) = _projections(layer)
    if any(p.bias is not None for p in rest):
        return "a bias on o, gate, up or down"
    if not all(p.bias is None or _fp32_vector(p.bias, p.out_features) for p in (q, k, v)):
        return "a q/k/v bias that is not an fp32 vector"
    norms = _qk_norms(layer)
    if norms is not None and not all(type(n).__name__ in _RMS_NORMS and _fp32_vector(n.weight, static.head_dim)
                                     and _eps(n) == qk_eps for n in norms):
        return "q/k norms other than RMSNorms over head_dim with one eps"
    return None


def refusal(static: StaticLlama) -> str | None:
    """Why `static`'s (a StaticLlama) model cannot run in `decode_layers.c` now, or None where it
    can: fp32 on the CPU, SiLU-gated MLP, transformers' RMSNorms, q/k/v biases and per-head q/k
    norms only as `_attention_extras_refusal` allows, and every projection of every layer a
    PackedLinear with blocks (each of any kind the kernel reads)."""
    model = static.model
    if static.fuse or static.dtype != torch.float32 or static.device.type != "cpu":
        return "not an fp32 CPU forward"
    if blockq.library() is None:
        return "no C compiler for the kernels"
    if getattr(model.config, "hidden_act", None) not in ("silu", "swish"):
        return f"activation {getattr(model.config, 'hidden_act', None)!r}, not SiLU"
    norms = [model.model.norm] + [n for layer in static.layers for n in (layer.input_layernorm,
                                                                        layer.post_attention_layernorm)]
    if any(type(n).__name__ not in _RMS_NORMS for n in norms):
        return "a norm other than transformers' RMSNorm"
    if len({_qk_norms(layer) is None for layer in static.layers}) > 1:
        return "q/k norms in some layers only"
    qk_eps = _qk_eps(static)
    for i, layer in enumerate(static.layers):
        if not hasattr(layer.mlp, "gate_proj"):
            return "an MLP without gate_proj"
        reason = _attention_extras_refusal(static, layer, qk_eps)
        if reason is not None:
            return f"layer {i}: {reason}"
        if not all(isinstance(p, PackedLinear) and p.blocks() is not None for p in _projections(layer)):
            return f"layer {i}: a projection without GGUF blocks (a type the kernel does not read, or edited)"
    return None


def eligible(static: StaticLlama) -> bool:
    """Whether `static`'s (a StaticLlama) model can run in `decode_layers.c` now (`refusal`); logs
    the reason where it cannot, so a model left on the torch layers says why."""
    reason = refusal(static)
    if reason is not None:
        logger.info("native layer stack: not for %s (%s); its layers run in torch",
                    type(static.model).__name__, reason)
    return reason is None


def _extras_row(layer: Any) -> list[int]:
    """A layer's q, k and v bias and q and k norm weight addresses (0 where absent): the five slots
    of its row of decode_layers.c's table after the caches'."""
    q, k, v = _projections(layer)[:3]
    norms = _qk_norms(layer)
    biases = [0 if p.bias is None else p.bias.data_ptr() for p in (q, k, v)]
    return biases + ([0, 0] if norms is None else [n.weight.data_ptr() for n in norms])


class NativeLayers:
    """Runs `static`'s (a StaticLlama) layers through `decode_layers.c`; `__call__` is the layer part of
    `StaticLlama.hidden`. Each projection is its own product over its own blocks (q, k and v, and
    gate and up, without a barrier between them)."""

    def __init__(self, static: StaticLlama, lib: ctypes.CDLL | None = None, chunk: int = CHUNK) -> None:
        """chunk: cache slots per attention work item (see decode_layers.c's `attend`); tests make it
        small so that short contexts span several chunks."""
        self.static = static
        cfg = static.model.config
        self.lib = lib or blockq.library()  # another build (`blockq.build`, `blockq.load`) in tests
        # layers, hidden, heads, kv heads, head dim, intermediate, then per call slots per row and
        # tokens per row, and the chunk (decode_layers.c's dims)
        self.dims = torch.tensor([len(static.layers), cfg.hidden_size, static.n_heads, static.n_kv, static.head_dim,
                                  cfg.intermediate_size, 0, 0, chunk], dtype=torch.int64)
        # eps of the layer norms, the attention scale, eps of the q/k norms (decode_layers.c's fdims)
        self.fdims = torch.tensor([_eps(static.layers[0].input_layernorm), static.scaling, _qk_eps(static)],
                                  dtype=torch.float32)
        self._table: torch.Tensor | None = None  # [layers, SLOTS] int64
        self._held: tuple = ()  # what the table points into, kept alive
        self._projections = [p for layer in static.layers for p in _projections(layer)]
        self._stamp: tuple[list, list[int]] | None = None  # what the table was built from (_stamp_now)

    def _weights(self) -> list[BlockWeight] | None:
        """Per layer: q, k, v, o, gate, up, down; None when a projection no longer runs from its
        blocks (its weight was replaced or edited)."""
        out = [p.blocks() for p in self._projections]
        return None if any(w is None for w in out) else out

    def _stamp_now(self) -> tuple[list, list[int]]:
        """What the table depends on, read cheaply on every forward: each projection's weight and
        attached blocks and the cache's tensor lists (by identity), and the weights' versions (an
        in-place edit). Checking the blocks themselves (`_weights`) would cost a sizeable part of a forward."""
        ps = self._projections
        objects = [p._parameters["weight"] for p in ps] + [p._blocks for p in ps] + [self.static.keys,
                                                                                    self.static.values]
        objects += [p.bias for p in ps]  # by identity: a replaced bias moves its address
        return objects, [PackedLinear._version(w) for w in objects[:len(ps)]]

    def _current_table(self) -> torch.Tensor | None:
        """The table of addresses, rebuilt when the cache was reallocated or a projection's weight or
        blocks changed; None when a projection no longer runs from blocks."""
        static = self.static
        objects, versions = self._stamp_now()
        if self._stamp is not None and versions == self._stamp[1] and all(
                a is b for a, b in zip(objects, self._stamp[0])):
            return self._table
        weights = self._weights()
        if weights is None:
            return None
        held = (*weights, *static.keys, *static.values, *[p.bias for p in self._projections])
        rows = []
        for i, layer in enumerate(static.layers):
            row = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   static.keys[i].data_ptr(), static.values[i].data_ptr(), *_extras_row(layer)]
            for w in weights[7 * i:7 * i + 7]:
                row += [w.qs.data_ptr(), w.scales.data_ptr(), LAYOUTS.index(w.layout)]
            rows.append(row)
        table = torch.tensor(rows, dtype=torch.int64)
        assert self.lib is not None  # eligible() checked that the kernel library loads
        if table.shape[1] != self.lib.decode_layers_slots():
            raise RuntimeError("decode_layers.c's table layout and native_layers.py's disagree")
        self._table, self._held, self._stamp = table, held, (objects, versions)
        return table

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 starts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """x: [T, hidden] embeddings of B segments' tokens, segment b being tokens starts[b] ..
        starts[b + 1] - 1 (starts: [B + 1] long, from 0 to T) of cache row rows[b] (rows: [B] long,
        each at most once); cos, sin: [T, D]; positions: [T] long. Writes K/V at those positions;
        returns the final norm's output [T, hidden], or None (having done nothing) when a
        projection's weight no longer is its blocks' or the rotation covers part of a head only:
        the caller runs the torch forward."""
        static = self.static
        tokens, hidden = x.shape
        bsz = rows.shape[0]
        if tuple(starts.shape) != (bsz + 1,) or int(starts[0]) != 0 or int(starts[-1]) != tokens:
            raise ValueError(f"starts: [{bsz + 1}] offsets from 0 to {tokens}; got {starts.tolist()}")
        widths = starts[1:] - starts[:-1]  # [B]
        if bsz == 0 or int(widths.min()) < 1:
            raise ValueError("starts: every segment holds at least one token")
        if int(rows.min()) < 0 or int(rows.max()) >= static.keys[0].shape[0] or len(set(rows.tolist())) < bsz:
            raise ValueError(f"rows: distinct cache rows in [0, {static.keys[0].shape[0]}); got {rows.tolist()}")
        if positions.device.type != "cpu" or int(positions.min()) < 0 or int(positions.max()) >= static.max_len:
            raise ValueError(f"positions: must lie in [0, {static.max_len}) on the CPU")
        if cos.shape[-1] != static.head_dim:  # a partial rotation: decode_layers.c rotates whole heads
            return None
        table = self._current_table()
        if table is None:
            return None
        self.dims[6], self.dims[7] = static.max_len, int(widths.max())
        x = x.contiguous().clone()  # [T, hidden], the residual stream in place
        pos, starts, rows = (t.to(torch.int64).contiguous() for t in (positions, starts, rows))
        cos, sin = cos.contiguous(), sin.contiguous()  # [T, D]
        out = torch.empty_like(x)  # [T, hidden]
        threads = torch.get_num_threads()
        assert self.lib is not None  # eligible() checked that the kernel library loads
        work = torch.empty(self.lib.decode_layers_work(self.dims.data_ptr(), tokens, threads))
        norm = static.model.model.norm.weight
        ptrs = [t.data_ptr() for t in (table, self.dims, self.fdims, x)]
        self.lib.decode_layers(*ptrs, tokens, pos.data_ptr(), starts.data_ptr(), rows.data_ptr(), bsz,
                               cos.data_ptr(), sin.data_ptr(), norm.data_ptr(), out.data_ptr(), work.data_ptr(),
                               threads)
        return out
