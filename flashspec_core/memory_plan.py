"""How many rows decode together and how many tokens each row's cache may hold, from the memory there is.

The engine plans once, at construction: of the memory free then (after the weights are loaded:
`free_memory`) it may use `memory_fraction` (the rest is headroom for activations and workspaces);
each row costs its cache at the full context (`kv_bytes_per_token` times the context and the
runner's slack slots) and its steps' logits (`step_bytes`). The rows are the requested `max_batch`,
cut to what that budget holds; when not even one row holds the full context, one row runs with what
the budget gives it, and a request that needs more is refused when submitted, never mid-decode.
The plan never changes what a row computes. Why: docs/backends.md, "Memory".
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where memory is read, so the CLI reads MEMORY_FRACTION without it
    import torch
    from transformers import PreTrainedModel

    from flashspec_core.backends.base import TargetRunner

logger = logging.getLogger(__name__)

GIB = 1 << 30
MEMORY_FRACTION = 0.9  # of the memory free at construction, what the engine's rows may use by default


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one cached token costs in a model of `config` (an HF config): a key and a value of
    every key/value head in every layer, `dtype` each (a config that names no heads: a key and a
    value of `hidden_size` each). ValueError when it names neither layers nor a hidden size."""
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not layers or not hidden:
        raise ValueError(f"target: its config ({type(config).__name__}) names no num_hidden_layers and "
                         "hidden_size, so the memory its cache takes cannot be planned")
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return int(layers) * 2 * int(hidden) * dtype.itemsize
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return int(layers) * 2 * int(kv_heads) * int(head_dim) * dtype.itemsize


def step_bytes(widths: list[int], vocab: int, dtype: torch.dtype, graphs: bool) -> int:
    """Bytes of logits one row's steps keep: [width, V] for the widest feed, or, with CUDA graphs,
    one [width, V] output per captured width and per batch size the batch grows through (these
    sum to less than twice the rows, so 2x per row)."""
    if graphs:
        return 2 * sum(widths) * vocab * dtype.itemsize
    return max(widths) * vocab * max(dtype.itemsize, 4)  # verification works on fp32 probabilities


def free_memory(device: torch.device) -> int:
    """Bytes free now: on CUDA as the driver reports them, on the CPU the kernel's MemAvailable
    (what can be allocated without swapping; free pages where /proc/meminfo is missing)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine runs with: `rows` rows decoded together, each holding at most `row_tokens`
    tokens (prompt + new tokens) in its cache."""

    rows: int  # rows decoded together: max_batch, cut to what the budget holds
    row_tokens: int  # tokens one row may hold: the context, or less where memory is short
    requested_rows: int  # the max_batch asked for
    context: int  # the model's context window
    bytes_per_token: int  # cache bytes of one token of one row
    row_bytes: int  # a row's memory besides its cache (its steps' logits)
    slack: int  # cache slots a row needs past its tokens (padded feeds, scratch)
    budget: int  # bytes the plan may use: free x fraction
    free: int  # bytes free when the plan was made
    fraction: float  # memory_fraction
    source: str = ""  # what sets `context`, for messages ("": the model's context window)

    def row_cost(self, tokens: int) -> int:
        """Bytes one row holding `tokens` tokens costs."""
        return (tokens + self.slack) * self.bytes_per_token + self.row_bytes

    def limit(self) -> str:
        """What bounds a row, and how to raise the bound, for an error message."""
        if self.row_tokens >= self.context:
            return self.source or f"the model's context window of {self.context} tokens"
        return (f"the {self.row_tokens} tokens one row's cache may hold in memory_fraction={self.fraction} of the "
                f"{self.free / GIB:.2f} GiB free at start ({self.bytes_per_token} bytes a token; max_batch is "
                "already 1); raise memory_fraction or free memory")


def plan_memory(bytes_per_token: int, free_bytes: int, fraction: float, max_batch: int, context: int,
                slack: int = 0, row_bytes: int = 0, source: str = "") -> MemoryPlan:
    """The rows and row length that `fraction` of `free_bytes` holds (see the module doc).

    bytes_per_token: `kv_bytes_per_token` of the model (and of any model draft, whose caches grow
    with the same rows). context: the model's context window (prompt + new tokens). slack: cache
    slots a row needs past its tokens. row_bytes: a row's memory besides its cache (`step_bytes`).
    source: what sets `context`, for messages (default: the model's context window).
    ValueError naming memory_fraction when not even one row of one token fits.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction must be a number in (0, 1]; got {fraction!r}")
    if max_batch < 1 or context < 1 or bytes_per_token < 1 or slack < 0 or row_bytes < 0:
        raise ValueError(f"max_batch, context and bytes_per_token must be >= 1, slack and row_bytes >= 0; "
                         f"got {max_batch}, {context}, {bytes_per_token}, {slack}, {row_bytes}")
    budget = int(max(0, free_bytes) * fraction)
    full_row = (context + slack) * bytes_per_token + row_bytes
    rows = min(max_batch, budget // full_row)
    row_tokens = context
    if rows < 1:
        rows, row_tokens = 1, (budget - row_bytes) // bytes_per_token - slack
        if row_tokens < 1:
            raise ValueError(
                f"memory_fraction: {fraction} of the {free_bytes / GIB:.2f} GiB free holds no row "
                f"({full_row} bytes a row at the full context, {bytes_per_token} bytes a cached token); "
                "raise memory_fraction or free memory")
    return MemoryPlan(rows, row_tokens, max_batch, context, bytes_per_token, row_bytes, slack, budget,
                      free_bytes, fraction, source)


def log_plan(plan: MemoryPlan) -> None:
    """One line when the plan cut the rows or a row's length below what was asked for."""
    if plan.rows < plan.requested_rows or plan.row_tokens < plan.context:
        logger.warning(
            "max_batch %d -> %d rows of at most %d tokens: %d rows x %d tokens x %d bytes a token (+ %d bytes "
            "of logits a row) need %.2f GiB; memory_fraction=%s of the %.2f GiB free gives %.2f GiB",
            plan.requested_rows, plan.rows, plan.row_tokens, plan.requested_rows, plan.context + plan.slack,
            plan.bytes_per_token, plan.row_bytes, plan.requested_rows * plan.row_cost(plan.context) / GIB,
            plan.fraction, plan.free / GIB, plan.budget / GIB)


def context_limit(config: Any, max_context: int | None) -> tuple[int, str]:
    """(tokens one request may hold, what sets them for messages): the model's context window
    (`max_position_embeddings`; none: no bound), or `max_context` below it. ValueError naming
    max_context for anything but an int >= 2 or None."""
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                    or max_context < 2):
        raise ValueError(f"max_context must be an int >= 2 (prompt + new tokens of one request) or None; "
                         f"got {max_context!r}")
    window = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
    if max_context is None or max_context >= window:
        return window, ""
    return max_context, f"max_context={max_context} tokens (the model's context window is {window}: raise max_context)"


def plan_engine(models: list[PreTrainedModel], llama_cpp: bool, runner: TargetRunner, max_batch: int,
                fraction: float, context: int, widths: list[int], source: str = "") -> MemoryPlan:
    """The plan of an engine whose rows hold a cache of each of `models` (the target, then the
    model drafts, whose caches grow with the same rows) at the dtype its runner keeps (llama.cpp:
    fp16 for the target), and the target's logits of a step `widths` wide, from the memory free
    now on the target's device; logged when it cuts what was asked."""
    head = models[0].get_output_embeddings().weight  # [V, hidden]
    dtypes = [m.get_output_embeddings().weight.dtype for m in models]
    if llama_cpp:
        import torch

        dtypes[0] = torch.float16
    per_token = sum(kv_bytes_per_token(m.config, d) for m, d in zip(models, dtypes))
    plan = plan_memory(per_token, free_memory(head.device), fraction, max_batch, context, runner.cache_slack,
                       step_bytes(widths, head.shape[0], dtypes[0], runner.use_graphs), source)
    log_plan(plan)
    return plan
