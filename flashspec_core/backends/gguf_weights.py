"""Give a model's linear layers the GGUF blocks their fp32 weights were de-quantised from.

transformers loads a GGUF file by de-quantising every tensor to fp32 (and, for Llama's q and k
projections, reordering rows for its rotary layout). This finds each swapped layer's tensor in
the same file through gguf-py's own name map, reorders the block rows the same way (matched row by
row, so no architecture's reordering is hard-coded), and attaches the blocks only when they
de-quantise to the layer's weight bit for bit: a layer whose weight is anything else (a file that
is not the model's, a weight edited after loading, an unsupported block type) keeps the fp32
kernels. The block kernel (`blockq.py`) then computes with exactly the model's weights.
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashspec_core.backends.blockq import BLOCK_BYTES, KINDS, BlockWeight, from_gguf_rows
from flashspec_core.backends.cpu_linear import PackedLinear

logger = logging.getLogger(__name__)


def _name_map(reader: Any, model: nn.Module) -> Any:
    """gguf-py's HF-name -> GGUF-name map (a `gguf.TensorNameMap`) for this file's architecture, or
    None if it has none. reader: a `gguf.GGUFReader`."""
    import gguf

    field = reader.fields.get("general.architecture")
    if field is None:
        return None
    # `contents()` is gguf-py 0.11+; older releases keep the string's bytes in `parts`
    arch_name = field.contents() if hasattr(field, "contents") else bytes(field.parts[field.data[0]]).decode()
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    layers = getattr(model.config, "num_hidden_layers", None)
    return None if arch is None or layers is None else gguf.get_tensor_name_map(arch, layers)


def _tensor_for(name: str, model: Any, names: Any, tensors: dict[str, Any]) -> Any:
    """The GGUF tensor (a `gguf.ReaderTensor`) of module `name`: the mapped one, or the token embedding
    for a tied head. model: the HF model; names: `_name_map`'s map; tensors: the file's, by name."""
    mapped = names.get_name(f"{name}.weight", try_suffixes=(".weight",))
    if mapped in tensors:
        return tensors[mapped]
    if getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        head = model.get_output_embeddings()
        if dict(model.named_modules()).get(name) is head:
            return tensors.get(names.get_name("model.embed_tokens.weight", try_suffixes=(".weight",)))
    return None


def match_rows(blocks: BlockWeight, weight: torch.Tensor) -> BlockWeight | None:
    """`blocks` with rows reordered so they de-quantise to `weight` [out, in] bit for bit, or None.

    Rows are matched by their exact fp32 bytes (transformers reorders q and k rows on loading).
    """
    if tuple(weight.shape) != (blocks.out_features, blocks.in_features) or weight.dtype != torch.float32:
        return None
    values = blocks.dequantize()
    if torch.equal(values.view(torch.int32), weight.view(torch.int32)):
        return blocks
    index = {row.numpy().tobytes(): i for i, row in enumerate(values)}
    rows = [index.get(row.numpy().tobytes()) for row in weight.detach()]
    if None in rows:
        return None
    order = torch.tensor(rows)  # [out]: the block row of each weight row
    return BlockWeight(blocks.kind, blocks.qs[order].contiguous(), blocks.scales[order].contiguous(),
                       blocks.out_features, blocks.in_features)


def attach(model: nn.Module, gguf_path: str | Path) -> int:
    """Attach to each `PackedLinear` of `model` the blocks of its weight in `gguf_path`; returns how
    many layers got them (0 when the file's architecture or block types are not ones the kernel reads).

    The file is read once per model (seconds for the default model): every runner built on
    the same model later counts the blocks its layers still hold.
    """
    import gguf

    if model.__dict__.get("_gguf_blocks") == str(gguf_path):  # attached by an earlier runner on this model
        return sum(1 for m in model.modules() if isinstance(m, PackedLinear) and m.blocks() is not None)
    reader = gguf.GGUFReader(str(gguf_path))
    names = _name_map(reader, model)
    if names is None:
        return 0
    tensors = {t.name: t for t in reader.tensors}
    attached = 0
    blocks_by_kind: Counter[str] = Counter()  # GGUF type -> layers computing from its blocks
    fp32_by_kind: Counter[str] = Counter()  # GGUF type -> layers left on the fp32 kernels
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, PackedLinear):  # a bias (Qwen2's q, k, v) stays fp32, added after
                continue
            tensor = _tensor_for(name, model, names, tensors)
            if tensor is None:
                continue
            kind = tensor.tensor_type.name.lower()
            blocks = _blocks_for(kind, tensor, module)
            if blocks is None:
                fp32_by_kind[kind] += 1
                continue
            module.use_blocks(blocks)
            blocks_by_kind[kind] += 1
            attached += 1
    model.__dict__["_gguf_blocks"] = str(gguf_path)
    logger.info("GGUF linear layers: block kernel for %s; fp32 kernels for %s",
                _counts(blocks_by_kind), _counts(fp32_by_kind))
    return attached


def _counts(by_kind: Counter[str]) -> str:
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(by_kind.items())) or "none"


def _blocks_for(kind: str, tensor: Any, module: PackedLinear) -> BlockWeight | None:
    """The blocks of `tensor` (a `gguf.ReaderTensor` of GGUF type `kind`) reordered to hold
    `module`'s weight bit for bit, or None (a type the kernel does not read, another shape, other values)."""
    if kind not in KINDS:
        return None
    size, nbytes = BLOCK_BYTES[kind]
    raw = torch.from_numpy(tensor.data.copy()).view(torch.uint8)  # [out, bytes per row]
    if module.in_features % size or raw.numel() != module.out_features * module.in_features // size * nbytes:
        return None  # another shape than the layer's
    return match_rows(from_gguf_rows(kind, raw, module.out_features, module.in_features), module.weight)
