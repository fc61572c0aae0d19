"""One CUDA graph of the target: a captured forward plus verification at a fixed batch and width.

`GraphedModel` (cuda_graph.py) keeps one per (rows, width[, q kind]) and replays it each step: the
host copies ids, positions and drafts (and for a sampled step a seed and the rows' temperatures)
into its input buffers and reads back one small tensor per row.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from flashspec_core.backends.static_llama import StaticLlama
from flashspec_core.models import vocab_size
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.verify.reference import PAD

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

# What a sampled step's verification takes from `sampling`: the kernel's sampled path without top-k
# or top-p. The temperature is not baked in: the kernel reads each row's from `GraphStep.temperature`.
SAMPLED = SamplingParams(temperature=1.0)


class GraphStep:
    """One captured forward plus verification at a fixed batch and width.

    sampled False: greedy, verified with torch ops in the graph (padded columns allowed, see
    `GraphedModel.warm`). True: a sampled step, verified by the Triton kernel in the graph from
    the draft's q (`one_hot`: a copy draft, no q), a seed and a temperature per row, all copied in
    before each replay, so one graph serves every temperature; its width is exactly γ + 1 (a padded
    draft slot would be a token to test).
    indexed: the rows fed are the cache rows in `slots` (set at each replay), not the first
    `batch`: a scheduler feeds one new prompt without computing the rows beside it.
    """

    def __init__(self, static: StaticLlama, batch: int, width: int, pool: _POOL_HANDLE | None, start: int,
                 sampled: bool = False, one_hot: bool = True, indexed: bool = False) -> None:
        """pool: the memory pool the capture goes into (`torch.cuda.graph_pool_handle()`);
        start: the first slot that warm-up and capture write to (they run the forward for
        real): no row may hold a token from there to start + width."""
        dev = static.device
        self.sampled = sampled
        self.ids = torch.zeros((batch, width), dtype=torch.long, device=dev)
        self.positions = torch.full((batch, width), start, dtype=torch.long, device=dev)
        self.positions += torch.arange(width, device=dev)
        self.drafts = torch.zeros((batch, max(width - 1, 0)), dtype=torch.long, device=dev)
        self.q: torch.Tensor | None = None  # [B, W - 1, V] float32: a model draft's q (sampled steps only)
        if sampled and not one_hot and width > 1:
            self.q = torch.zeros((batch, width - 1, vocab_size(static.model)), dtype=torch.float32, device=dev)
        self.seed = torch.zeros(1, dtype=torch.long, device=dev)  # the kernel's Philox seed
        self.temperature: torch.Tensor | None = None  # [B] float32: each row's T (sampled steps only)
        if sampled:
            self.temperature = torch.ones(batch, dtype=torch.float32, device=dev)
        self.slots = torch.arange(batch, device=dev) if indexed else None  # [B] the cache rows fed
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: cuBLAS handles, SDPA's kernel choice, the allocator, Triton
                self._body(static)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of the process (a caller's own GPU work, another engine)
        # may launch kernels while this one captures; in the default global mode its launch
        # would invalidate the capture and fail the step.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.logits, self.result = self._body(static)

    def time_replay(self, repeats: int = 3) -> float:
        """Seconds of one replay as captured (the fastest of `repeats`): its inputs still point at
        the scratch slots the capture wrote, so this writes no row's cache. Only right after capture."""
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(self.ids.device)
            start = time.perf_counter()
            self.graph.replay()
            torch.cuda.synchronize(self.ids.device)
            best = min(best, time.perf_counter() - start)
        return best

    def _body(self, static: StaticLlama) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, W, V] and result [B, 1 + W]: n_accepted (-1 for NaN/+inf logits), then the
        accepted tokens and the recovered or bonus token, PAD after."""
        logits = static(self.ids, self.positions, slots=self.slots)
        if self.temperature is not None:
            from flashspec_core.verify.triton import verify_triton

            n_acc, tokens = verify_triton(logits, self.drafts, self.q, SAMPLED, seed=self.seed,
                                          temperature=self.temperature,
                                          check_finite=False)  # poisoned rows: n_acc = -1
            return logits, torch.cat([n_acc[:, None], tokens], dim=1)
        target = logits.argmax(-1)  # [B, W]
        width = target.shape[1]
        n_acc = (self.drafts == target[:, :-1]).long().cumprod(-1).sum(-1)  # [B]
        bad = (logits.isnan() | (logits == float("inf"))).flatten(1).any(-1)  # [B]
        steps = torch.arange(width, device=target.device)
        tokens = target.masked_fill(steps[None, :] > n_acc[:, None], PAD)
        return logits, torch.cat([torch.where(bad, -1, n_acc)[:, None], tokens], dim=1)

    def replay(self, host: torch.Tensor, q: torch.Tensor | None = None, seed: torch.Tensor | None = None,
               first: torch.Tensor | None = None, slots: Sequence[int] | None = None,
               temperatures: Sequence[float] | None = None) -> None:
        """host: [3, B, W] pinned long: ids, positions, drafts (padded to W). q: [B, W - 1, V] on
        the device (a sampled model draft's); seed: [1] int64 on the device (sampled steps);
        first: [B] long on the device, the ids of column 0 (a draft's own last token, unread);
        slots: the cache rows fed (an `indexed` graph's); temperatures: B floats, each row's T
        (sampled steps)."""
        width = self.ids.shape[1]
        self.ids.copy_(host[0], non_blocking=True)
        if first is not None:
            self.ids[:, 0].copy_(first)
        self.positions.copy_(host[1], non_blocking=True)
        self.drafts.copy_(host[2, :, : width - 1], non_blocking=True)
        if self.q is not None:
            assert q is not None  # a step captured for a model draft's q is replayed with one
            self.q.copy_(q)
        if seed is not None:
            self.seed.copy_(seed)
        if temperatures is not None:
            assert self.temperature is not None  # a sampled step's graph
            host_t = torch.tensor(temperatures, dtype=torch.float32, pin_memory=True)  # [B]
            self.temperature.copy_(host_t, non_blocking=True)
        if slots is not None:
            assert self.slots is not None  # an indexed graph
            for b, slot in enumerate(slots):
                self.slots[b].fill_(slot)
        self.graph.replay()
