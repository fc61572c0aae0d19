"""The forward of a Llama-family HF model over a static KV cache, in a shape CUDA graphs can replay.

It calls the model's own submodules (norms, projections, MLP, rotary embedding), so each number is
computed as transformers computes it, and owns only what must be static: the cache tensors and
the attention mask. One K and one V tensor per layer, [B, H_kv, S, D]; row b holds its sequence at
positions 0..len_b - 1 and a query at p attends to slots 0..p of its row, so rolling back is moving
the row's length (the runner's job) and growing (`resize`) copies into larger tensors. `fuse=True`
(the CUDA-graph runner's) is the same function in fewer kernels (`decode_attention` up to
SPLIT_WIDTH tokens, `fused_ops` where Triton runs), other rounding. Why: docs/backends.md.
"""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from flashspec_core.backends.cpu_linear import project

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
# Widths up to this attend with `decode_attention` on the fused path (a step: few queries, every
# slot); wider ones (prompt pieces) with SDPA, whose one program per block of queries is then busy.
SPLIT_WIDTH = 32


def _fused_ops(device: torch.device) -> ModuleType | None:
    """`fused_ops` when its Triton kernels run on `device`, else None (Triton is an optional extra)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from flashspec_core.backends import fused_ops

    return fused_ops if fused_ops.usable(device) else None


def _eps(norm: nn.Module) -> float:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


# transformers' RMSNorm classes of SUPPORTED models: weight * (x * rsqrt(mean(x^2) + eps)) in fp32.
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x) for x [..., hidden]: `F.rms_norm`'s one kernel for transformers' RMSNorm classes in
    fp32 (their forward is six; the results are the same bit for bit, tests/core/backends checks), else
    the module itself."""
    weight: Any = norm.weight  # [hidden] (a Tensor attribute of the norm module)
    if type(norm).__name__ in _RMS_NORMS and x.dtype == torch.float32 == weight.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, _eps(norm))
    return norm(x)


def supports(model: nn.Module) -> bool:
    """Whether `model` has the Llama-family layout this forward drives (else: transformers' own)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED:
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        if config.model_type == "mistral":
            return False  # a sliding window needs its own mask
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not hasattr(inner, "rotary_emb") or not hasattr(inner, "embed_tokens"):
        return False
    attn = layers[0].self_attn
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and hasattr(layers[0], "mlp")


class _FusedWeights(TypedDict):
    """One layer's concatenated weights (`StaticLlama._fuse`)."""

    qkv: torch.Tensor  # [(H + 2 H_kv) * D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 H_kv) * D]
    gate_up: torch.Tensor  # [2I, hidden]
    gate_up_bias: torch.Tensor | None  # [2I]


class StaticLlama(nn.Module):
    """model: an HF Llama-family causal LM (its weights are shared, not copied).

    max_len: slots per row; batch: rows. Call `forward(ids, positions)` with ids and positions
    [B, W] (B = `batch`); it writes K/V at those positions and returns logits [B, W, V].
    `ops`: the fused_ops module whose kernels the fused path runs, or None for torch ops (set it
    to None to compare the two).
    """

    def __init__(self, model: nn.Module, max_len: int, batch: int = 1, fuse: bool = False) -> None:
        super().__init__()
        if not supports(model):
            raise ValueError(f"model: {type(model).__name__} is not a Llama-family model this forward supports")
        hf: Any = model  # HF submodules are reached by name (model.model.layers[i].self_attn...): Any
        self.model = hf
        inner = hf.model
        self.layers = inner.layers  # nn.ModuleList of decoder layers
        cfg = hf.config
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.n_heads: int = cfg.num_attention_heads
        self.n_kv: int = cfg.num_key_value_heads
        self.scaling: float = attn.scaling
        self._rope: Any = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.batch = batch  # rows the forward feeds: the first `batch` of the `rows` allocated
        self.rows = 0
        self.fuse = fuse
        self._fused: list[_FusedWeights] = [self._fuse(layer) for layer in self.layers] if fuse else []
        self.ops = _fused_ops(self.device) if fuse else None
        self._silu: bool = cfg.hidden_act in ("silu", "swish")  # what fused_ops.silu_mul computes
        self.max_len = 0
        self._cache = torch.empty(0)  # [2, layers, rows, H_kv, max_len, D]: keys, then values
        self.keys: list[torch.Tensor] = []  # each [rows, H_kv, max_len, D], a view of _cache
        self.values: list[torch.Tensor] = []
        self.resize(max_len, batch)

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    def resize(self, max_len: int, batch: int | None = None) -> None:
        """Reallocate the cache for `max_len` slots per row and `batch` rows (default: as now),
        keeping what the rows both shapes have hold in the slots both have. Every layer's keys and
        values are views of one tensor [2, layers, rows, H_kv, max_len, D], so a row's whole cache
        moves in one copy (`copy_prefix`) rather than two a layer, each a launch of its own on a GPU."""
        rows = self.rows if batch is None else batch
        keep, keep_rows = min(self.max_len, max_len), min(self.rows, rows)
        cache = torch.zeros((2, len(self.layers), rows, self.n_kv, max_len, self.head_dim), dtype=self.dtype,
                            device=self.device)
        if keep and keep_rows:
            cache[:, :, :keep_rows, :, :keep].copy_(self._cache[:, :, :keep_rows, :, :keep])
        self._cache = cache
        self.keys, self.values = list(cache[0]), list(cache[1])
        self.max_len, self.rows = max_len, rows
        if batch is not None:
            self.batch = batch

    @torch.inference_mode()  # the cache may be inference tensors (grown inside a forward)
    def copy_prefix(self, source: int, row: int, length: int) -> None:
        """Copy cache row `source`'s keys and values at positions 0..length - 1 into row `row`."""
        self._cache[:, :, row, :, :length].copy_(self._cache[:, :, source, :, :length])

    def use_rows(self, batch: int) -> bool:
        """Feed `batch` rows from now on: the first `batch` of those allocated, or, past them, a
        cache reallocated for `batch` rows (the rows it had keep their contents). Returns whether
        it was reallocated (tensors that captured graphs read are then gone). Why keep the rows: a
        server's batches change size from one step to the next, and each reallocation meant
        capturing every graph again."""
        if batch <= self.rows:
            self.batch = batch
            return False
        self.resize(self.max_len, batch)
        return True

    @staticmethod
    @torch.no_grad()
    def _fuse(layer: Any) -> _FusedWeights:
        """Concatenated q|k|v and gate|up weights (and biases) of one layer: a copy, made once."""
        attn, mlp = layer.self_attn, layer.mlp
        biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        mlp_biases = [p.bias for p in (mlp.gate_proj, mlp.up_proj)]  # Llama's mlp_bias=True
        return {
            "qkv": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            "qkv_bias": None if biases[0] is None else torch.cat(biases),
            "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            "gate_up_bias": None if mlp_biases[0] is None else torch.cat(mlp_biases),
        }

    def _add_norm(self, norm: Any, x: torch.Tensor,
                  delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)) for x, delta [B, W, hidden]: one kernel where Triton runs."""
        if self.ops is not None:
            return self.ops.add_rms_norm(x, delta, norm.weight, _eps(norm))
        x = x if delta is None else x + delta
        return x, F.rms_norm(x, (x.shape[-1],), norm.weight, _eps(norm))

    def _rope_and_cache(self, i: int, attn: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fused_ops.rope_and_cache's contract in torch ops. qkv: [B, W, (H + 2 H_kv) * D];
        cos, sin: [B, W, D]; rows, positions: [B, W];
        returns q [B, H_kv, G*W, D] (query head h = kv*G + g at row g*W + w of kv head kv)."""
        bsz, width, _ = qkv.shape
        d, nq, nkv = self.head_dim, self.n_heads, self.n_kv
        qkv = qkv.view(bsz, width, nq + 2 * nkv, d)
        qk, v = qkv[:, :, : nq + nkv], qkv[:, :, nq + nkv:]
        if hasattr(attn, "q_norm"):
            qk = torch.cat([attn.q_norm(qk[:, :, :nq]), attn.k_norm(qk[:, :, nq:])], dim=2)
        qk, _ = self._rope(qk.transpose(1, 2), qk[:, :, :0].transpose(1, 2), cos, sin)  # [B, H+Hkv, W, D]
        q, k = qk[:, :nq], qk[:, nq:]
        self.keys[i][rows, :, positions] = k.transpose(1, 2).to(self.dtype)
        self.values[i][rows, :, positions] = v.to(self.dtype)
        return q.reshape(bsz, nkv, nq // nkv * width, d)

    def _cached(self, i: int, bsz: int, slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values [B, H_kv, S, D] of the rows fed: the first bsz rows (views), or
        the cache rows `slots` [B] (gathered)."""
        if slots is None:
            return self.keys[i][:bsz], self.values[i][:bsz]
        return self.keys[i].index_select(0, slots), self.values[i].index_select(0, slots)

    def _attend_fused(self, i: int, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      rows: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                      slots: torch.Tensor | None = None) -> torch.Tensor:
        """`_attend` in fewer kernels. h: [B, W, hidden]; cos, sin: [B, W, D]; rows, positions: [B, W];
        mask: [B, 1, G*W, S] (query rows packed per kv head) for SDPA, or None for the split kernel,
        whose rule (slots 0..position) needs no mask; slots: `hidden`'s."""
        attn, w = layer.self_attn, self._fused[i]
        bsz, width, _ = h.shape
        d, nq, nkv = self.head_dim, self.n_heads, self.n_kv
        qkv = F.linear(h, w["qkv"], w["qkv_bias"])  # [B, W, (H + 2 H_kv) * D]
        if self.ops is None:
            q = self._rope_and_cache(i, attn, qkv, cos, sin, rows, positions)
        else:
            norms: dict[str, Any] = {}
            if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotation, in the same kernel
                norms = {"q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight, "norm_eps": _eps(attn.q_norm)}
            q = self.ops.rope_and_cache(qkv, cos, sin, self.keys[i], self.values[i], rows, positions,
                                        nq, nkv, d, **norms)
        if mask is None:  # split along the slots, each row read through its index (`decode_attention`)
            from flashspec_core.backends.decode_attention import attend  # Triton: imported where it runs

            return attn.o_proj(attend(q, self.keys[i], self.values[i], rows[:, 0], positions, self.scaling))
        keys, values = self._cached(i, bsz, slots)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
        out = out.reshape(bsz, nq, width, d).transpose(1, 2).reshape(bsz, width, nq * d)
        return attn.o_proj(out)

    def _mlp_fused(self, i: int, layer: Any, h: torch.Tensor) -> torch.Tensor:
        """The MLP from one gate|up product. h: [B, W, hidden]."""
        gate_up = F.linear(h, self._fused[i]["gate_up"], self._fused[i]["gate_up_bias"])  # [B, W, 2I]
        if self.ops is not None and self._silu:
            return layer.mlp.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def _layers_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                      positions: torch.Tensor, mask: torch.Tensor | None,
                      slots: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer and the final norm on the fused path; x: [B, W, hidden], cos, sin: [B, W, D],
        rows, positions: [B, W], mask: `_attend_fused`'s, slots: `hidden`'s.

        Each norm also does the residual add before it, so the loop carries the residual stream x
        and the normed input h of the next block; returns the final norm's output [B, W, hidden].
        """
        norms = [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(self.model.model.norm)
        x, h = self._add_norm(norms[0], x, None)
        for i, layer in enumerate(self.layers):
            delta = self._attend_fused(i, layer, h, cos, sin, rows, positions, mask, slots)
            x, h = self._add_norm(norms[2 * i + 1], x, delta)
            x, h = self._add_norm(norms[2 * i + 2], x, self._mlp_fused(i, layer, h))
        return h

    def _attend(self, i: int, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rows: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """One attention block. h: [B, W, hidden]; cos, sin: [B, W, D]; positions, rows: [B, W];
        mask: [B, 1, W, S] boolean; slots: `hidden`'s.

        q, k and v come from one stacked product where the layers run from GGUF blocks (else three,
        concatenated), and q and k are rotated together (`_rope_and_cache`): element for element
        what transformers computes, in fewer kernels.
        """
        attn = layer.self_attn
        bsz, width, _ = h.shape
        qkv = project(h, (attn.q_proj, attn.k_proj, attn.v_proj), stacked=True)  # [B, W, (H + 2 H_kv) * D]
        q = self._rope_and_cache(i, attn, qkv, cos, sin, rows, positions)  # [B, H_kv, G*W, D]
        q = q.reshape(bsz, self.n_heads, width, self.head_dim)  # [B, H, W, D] (the packing is a reshape)
        keys, values = self._cached(i, bsz, slots)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                             enable_gqa=self.n_heads != self.n_kv)
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, width, -1))

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output [B, W, hidden] for ids, positions: [B, W] long (positions < max_len),
        attending over all max_len slots of each row in fixed shapes (what a graph replays; the CPU
        runner's forward over the live slots only is `ragged.hidden`).

        slots: [B] long on the device, the cache rows ids' rows feed (any rows, in any order, read
        and written through an index, so one captured graph serves every choice); None: the first B.
        """
        inner = self.model.model
        bsz, width = ids.shape
        if slots is not None and tuple(slots.shape) != (bsz,):
            raise ValueError(f"slots: one cache row per row of ids ([{bsz}]); got {tuple(slots.shape)}")
        x: torch.Tensor = inner.embed_tokens(ids)  # [B, W, hidden]
        cos, sin = inner.rotary_emb(x, positions)  # [B, W, D] each
        rows = (torch.arange(bsz, device=ids.device) if slots is None else slots)[:, None].expand(bsz, width)
        if self.fuse and self.ops is not None and width <= SPLIT_WIDTH:
            return self._layers_fused(x, cos, sin, rows, positions, None, slots)
        cols = torch.arange(self.max_len, device=ids.device)
        mask = (cols[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, W, S]
        if self.fuse:
            # Additive, once per forward: given booleans, SDPA converts them in every layer (2 kernels).
            additive = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
            additive = additive.repeat(1, 1, self.n_heads // self.n_kv, 1)  # [B, 1, G*W, S], row g*W + w
            return self._layers_fused(x, cos, sin, rows, positions, additive, slots)
        for i, layer in enumerate(self.layers):
            h = rms_norm(layer.input_layernorm, x)
            x = x + self._attend(i, layer, h, cos, sin, rows, positions, mask, slots)
            x = x + self._mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, x))
        return rms_norm(inner.norm, x)

    @staticmethod
    def _mlp(mlp: Any, h: torch.Tensor) -> torch.Tensor:
        """transformers' Llama MLP, down(act(gate(h)) * up(h)), with gate and up from one block-kernel
        call where they run from GGUF blocks (`cpu_linear.project`). h: [B, W, hidden]."""
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return mlp(h)
        gate, up = project(h, (mlp.gate_proj, mlp.up_proj))
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: int | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """ids, positions: [B, W] long (positions < max_len); slots: `hidden`'s. Returns logits
        [B, keep or W, V]."""
        x = self.hidden(ids, positions, slots=slots)
        if keep is not None:
            x = x[:, -keep:]
        return self.model.lm_head(x)
