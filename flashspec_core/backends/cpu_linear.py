"""A CPU linear layer whose cost barely grows with the number of rows, so verifying γ+1 tokens pays.

fp32 `F.linear` on a few rows streams the weight once per row; reordered once into oneDNN's blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`) it is read once per call and split over the
cores: the same dot products, results moved by float rounding only. The swap only installs the
choice; the kernel a forward of a given width runs is measured per machine (`calibration.py`) and
read by every swapped layer from one shared `KernelChoice`. The packed copy is rebuilt when the
weight is replaced or modified in place; autograd, or a module cast or moved off the CPU, takes
`F.linear`. Only plain fp32 CPU `nn.Linear`s are swapped, where this torch build has oneDNN.
"""
from __future__ import annotations

from typing import Literal, TypeGuard, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from flashspec_core.backends.blockq import BlockWeight, block_linear


def packing_available() -> bool:
    """Whether this torch build can pack linear weights for oneDNN (x86 and ARM CPU builds can)."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight") and hasattr(
        ops, "_linear_pointwise")


STOCK, PACKED, BLOCKS = "stock", "packed", "gguf-blocks"


class KernelChoice:
    """The kernel every swapped layer of one model runs now: `name` is STOCK (`F.linear`), PACKED
    (oneDNN's packed weight) or BLOCKS (the GGUF blocks the weight came from, `backends/blockq.py`;
    layers without blocks run stock then). The runner sets it before each forward from the
    calibrated choice for its width.
    """

    def __init__(self, name: str = PACKED) -> None:
        self.name = name


class PackedLinear(nn.Module):
    """`nn.Linear` computed by oneDNN from a weight copy packed once into its blocked layout.

    Shares the original module's parameters (tied embeddings stay tied; `state_dict` is unchanged).
    `choice.name` STOCK runs stock `F.linear` on the same weight; BLOCKS runs the block kernel on
    the blocks `use_blocks` attached (checked to hold this very weight), while the weight is unchanged.
    """

    def __init__(self, linear: nn.Linear, choice: KernelChoice | None = None) -> None:
        super().__init__()
        self.choice = choice or KernelChoice()
        self.weight = linear.weight  # [out, in]
        self.bias = linear.bias  # [out] or None
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # (weight packed from, its version, the opaque oneDNN tensor): a held reference, not an id,
        # tells a replaced weight.
        self._packed: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._blocks: tuple[torch.Tensor, int, BlockWeight] | None = None  # (weight, its version, blocks)

    def use_blocks(self, blocks: BlockWeight) -> None:
        """Compute from `blocks` under the BLOCKS kernel; the caller checked they hold this weight."""
        self._blocks = (self.weight, self._version(self.weight), blocks)

    # Shadows nn.Module._version, the int format version that state_dict() records per module (so a
    # PackedLinear's state_dict metadata holds this function): hence the override mypy reports.
    @staticmethod
    def _version(w: torch.Tensor) -> int:  # type: ignore[override]
        return -1 if w.is_inference() else w._version  # inference tensors keep no version

    def blocks(self) -> BlockWeight | None:
        """The attached blocks while the weight is the one they hold (not replaced, not edited)."""
        if self._blocks is None or self._blocks[0] is not self.weight or self._blocks[1] != self._version(self.weight):
            return None
        return self._blocks[2]

    def _packed_weight(self) -> torch.Tensor:
        """The packed copy of the current weight, re-packed when it was replaced or edited."""
        w = self.weight
        version = self._version(w)
        if self._packed is None or self._packed[0] is not w or self._packed[1] != version:
            self._packed = (w, version, torch.ops.mkldnn._reorder_linear_weight(w.detach()))
        return self._packed[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]."""
        w = self.weight
        fp32_cpu = w.device.type == "cpu" and w.dtype == x.dtype == torch.float32
        kernel = self.choice.name
        if kernel == STOCK or not fp32_cpu or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return F.linear(x, w, self.bias)  # moved, cast or training since the swap: the stock kernel
        if kernel == BLOCKS:
            blocks = self.blocks()
            return F.linear(x, w, self.bias) if blocks is None else block_linear(x, blocks, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed_weight(), bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _swappable(module: nn.Module) -> TypeGuard[nn.Linear]:
    """A plain fp32 CPU `nn.Linear` (subclasses such as bitsandbytes' Linear4bit have their own kernel)."""
    if type(module) is not nn.Linear:
        return False
    w = module.weight
    return w.device.type == "cpu" and w.dtype == torch.float32


def use_packed_linear(model: nn.Module) -> KernelChoice | None:
    """Swap every eligible `nn.Linear` of `model` for a PackedLinear in place.

    Returns the model's `KernelChoice` (shared by all its packed layers, also those swapped by an
    earlier call), or None when nothing is swappable or this build cannot pack.
    """
    if not packing_available():
        return None
    existing = next((m.choice for m in model.modules() if isinstance(m, PackedLinear)), None)
    choice = existing or KernelChoice()
    swaps = [(parent, name, PackedLinear(child, choice)) for parent in model.modules()
             for name, child in parent.named_children() if _swappable(child)]
    for parent, name, packed in swaps:
        setattr(parent, name, packed)
    return choice if (swaps or existing) else None


@overload
def project(x: torch.Tensor, layers: tuple[nn.Module, ...], stacked: Literal[False] = False) -> list[torch.Tensor]: ...


@overload
def project(x: torch.Tensor, layers: tuple[nn.Module, ...], stacked: Literal[True]) -> torch.Tensor: ...


@overload
def project(x: torch.Tensor, layers: tuple[nn.Module, ...], stacked: bool) -> torch.Tensor | list[torch.Tensor]: ...


def project(x: torch.Tensor, layers: tuple[nn.Module, ...],
            stacked: bool = False) -> torch.Tensor | list[torch.Tensor]:
    """[layer(x) for layer in layers] (`stacked`: concatenated along the last dim), in one block-kernel
    call when all of them run from GGUF blocks.

    Why: a decode step of the default model makes 211 linear calls, and each call of the block
    kernel costs a fixed overhead beyond its arithmetic (the OpenMP fork and join, the ctypes call); q,
    k and v (and gate and up) read the same input, so their blocks are stacked into one weight once
    and computed in one call. Each output row is still its own dot product, summed in the same order
    as in a call of its own, so the results are identical. x: [..., in].
    """
    weight = _stacked_blocks(layers) if not torch.is_grad_enabled() and x.dtype == torch.float32 else None
    if weight is None:
        outs = [layer(x) for layer in layers]
        return torch.cat(outs, dim=-1) if stacked else outs
    out = block_linear(x, weight[1])
    return out if stacked else list(out.split([b.out_features for b in weight[0]], dim=-1))


def _stacked_blocks(layers: tuple[nn.Module, ...]) -> tuple[list[BlockWeight], BlockWeight] | None:
    """The layers' blocks and one BlockWeight of them stacked (cached on the first layer), or None
    unless every layer runs from blocks of one layout now (BLOCKS kernel, no bias, unchanged weight)."""
    first = layers[0]
    if not isinstance(first, PackedLinear) or first.choice.name != BLOCKS:
        return None
    blocks = [layer.blocks() if isinstance(layer, PackedLinear) and layer.bias is None else None for layer in layers]
    if any(b is None for b in blocks):
        return None
    present = cast("list[BlockWeight]", blocks)  # none is None (checked above)
    cached = first.__dict__.get("_stacked")
    if cached is None or len(cached[0]) != len(blocks) or any(a is not b for a, b in zip(cached[0], blocks)):
        if len({b.layout for b in present}) != 1:
            return None
        weight = BlockWeight(present[0].kind, torch.cat([b.qs for b in present]),
                             torch.cat([b.scales for b in present]), sum(b.out_features for b in present),
                             present[0].in_features)
        cached = first.__dict__["_stacked"] = (present, weight)
    return cached
