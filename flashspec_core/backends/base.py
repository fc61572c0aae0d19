"""The one Protocol every target runner implements: the engine and model drafts never know which one runs.

A runner holds the KV cache of a batch of rows and keeps it in step with each row's token
sequence: the caller says which tokens each row should hold (`forward_to`), and the runner works
out what its cache already holds (the longest common prefix), rolls back what a rejected draft
left and feeds the rest, so a rejected draft is undone and a new request reuses the previous
one's prefix. The members with bodies are defaults for abilities only some runners have (graph
replays, measured kernels): a runner subclasses `TargetRunner` and overrides what it does, so the
decode loop calls every member without asking first.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from flashspec_core.processors.sampling import SamplingParams

if TYPE_CHECKING:
    from flashspec_core.backends.calibration import Calibration

# Host work a runner runs between a step's launch and its result, while the device computes. It is
# passed `busy`: whether the device still computes (the work may stop once it does not).
WhileWaiting = Callable[[Callable[[], bool]], None]


class TargetRunner(Protocol):
    """Runs a causal LM's forward over a batch of rows whose caches it keeps."""

    device: torch.device
    # The calibration measured for this runner on this machine (width -> kernel), set by the engine.
    plan: Calibration | None = None
    # Whether steps replay captured CUDA graphs (the engine then overlaps the router's learning
    # with the GPU's work).
    use_graphs: bool = False
    # The widths (draft length + 1) a graphed runner was warmed for: greedy steps are padded up to
    # one of them and sampled proposals cut to one (proposals.cut_length); () when any width runs.
    widths: tuple[int, ...] = ()
    # Seconds of one-time work (capturing a graph, growing the cache) spent so far: whichever step
    # paid it is not charged for it (StepRecord.warmup_seconds).
    warmup_seconds: float = 0.0
    # Cache slots a row may need past its own tokens (a feed padded to a graph's width, scratch
    # slots): the memory plan (memory_plan.py) counts them in every row's cost.
    cache_slack: int = 0

    def begin(self, batch_size: int) -> None:
        """A request of `batch_size` rows starts. A single prompt keeps what the previous
        single-prompt request left, so `forward_to` reuses their common prefix; a batch starts afresh."""
        ...

    def reset(self, batch_size: int) -> None:
        """Drop every row's cache and hold `batch_size` empty rows (also after a failed forward,
        whose cache may hold half a step)."""
        ...

    def resize(self, rows: int) -> None:
        """Hold `rows` rows from now on: the first min(rows, now) keep their caches (a running row
        keeps its slot), added rows start empty. The scheduler sizes the batch to the rows it runs."""
        ...

    def limit_cache(self, row_tokens: int) -> None:
        """Hold at most `row_tokens` tokens (plus `cache_slack` slots) a row from now on: the
        memory plan's bound, which requests are checked against when they are submitted. A cache
        that grows stops growing there. Nothing to do by default (a cache sized by what it holds)."""
        return None

    def prefix_len(self, row: int, sequence: Sequence[int]) -> int:
        """How many leading tokens of `sequence` row `row` already holds (reusable as they are)."""
        ...

    def share_prefix(self, row: int, sequence: Sequence[int]) -> int:
        """Make row `row` hold the longest prefix of `sequence` that any row holds (an agent's next
        step beside its previous one, questions over one document), copying that row's cache over
        its own where it holds more, and return the prefix's length. By default nothing is copied:
        what the row itself holds."""
        return self.prefix_len(row, sequence)

    def forward_to(self, sequences: Sequence[Sequence[int]], active: Sequence[bool] | None = None,
                   keep_logits: int = 1) -> torch.Tensor:
        """Make each active row hold `sequences[b]` and return the logits after each of its last
        `keep_logits` tokens: [B, keep_logits, V] (inactive rows' logits are meaningless). Each
        active row feeds at least `keep_logits` tokens; a row already holding its whole sequence
        re-feeds its tail."""
        ...

    def score_rows(self, sequences: Sequence[Sequence[int] | None], needs: Sequence[int]) -> list[torch.Tensor | None]:
        """Make each row b with a sequence (and needs[b] > 0) hold sequences[b] and return the logits
        after its last needs[b] tokens, [needs[b], V] (None for the other rows), in as few forwards
        as this runner can. By default: rows of one need share a `forward_to` (with graphs, a row
        whose path is long enough joins a larger need's forward and keeps its tail); a runner that
        feeds rows of any lengths in one forward overrides it."""
        pending = [b for b, (s, n) in enumerate(zip(sequences, needs)) if s is not None and n > 0]
        out: list[torch.Tensor | None] = [None] * len(sequences)
        while pending:
            keep = max(needs[b] for b in pending)  # the row needing most has a path at least that long
            fits = {b for b in pending if len(sequences[b] or ()) >= keep and (self.use_graphs or needs[b] == keep)}
            logits = self.forward_to([(sequences[b] or []) if b in fits else [] for b in range(len(sequences))],
                                     [b in fits for b in range(len(sequences))], keep_logits=keep)  # [B, keep, V]
            for b in fits:
                out[b] = logits[b, keep - needs[b]:]
            pending = [b for b in pending if b not in fits]
        return out

    def warm(self, widths: Sequence[int], sampled: bool = True) -> None:
        """Do now the one-time work of forwards `widths` wide (capture their graphs), so that no
        request pays it; sampled: and of the sampled steps `verify_step` runs at those widths (a
        model draft's runner, which never verifies, passes False). Nothing to do by default."""
        return None

    def step_seconds(self) -> Mapping[int, float]:
        """A step's seconds by width (the tokens every row feeds) at the rows held now, measured when
        warmed, for a runner that pads each step's rows to one width (graphs): the token budget
        (budget.py) weighs them. {} by default: rows of other widths cost only their own tokens."""
        return {}

    def verify_step(self, contexts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]],
                    active: Sequence[bool], sampling: SamplingParams, draft_probs: torch.Tensor | None = None,
                    generator: torch.Generator | None = None,
                    while_waiting: WhileWaiting | None = None) -> tuple[list[int], list[list[int]]] | None:
        """Forward and verify one step in one call (a graph replay): (accepted per row, tokens per
        row), or None when this runner or this step cannot, and the engine runs `forward_to` and
        `verify` instead. draft_probs: [B, γ, V] or None (one-hot). None by default."""
        return None

    def score_step(self, sequences: Sequence[Sequence[int]], needs: Sequence[int],
                   drafts: Sequence[Sequence[int] | None], active: Sequence[bool],
                   while_waiting: WhileWaiting | None = None
                   ) -> tuple[list[list[int] | None], list[torch.Tensor | None]] | None:
        """One forward (a graph replay) for rows of different draft lengths and settings: each
        active row b comes to hold sequences[b]. Where drafts[b] is None the row gets the logits
        after its last needs[b] tokens ([needs[b], V], logits[b]); where drafts[b] is its draft
        (the last len(drafts[b]) tokens of its sequence, needs[b] = len(drafts[b]) + 1) the
        greedy verification of that draft, done with the forward: [n_accepted, then the accepted
        tokens and the recovered or bonus token, ...] (verified[b]; where it could not be done
        there, verified[b] is None and the row gets its logits instead). None when this runner
        cannot (the default); while_waiting: host work to run while the device computes."""
        return None

    def feed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token to every row, fed from the device without the host reading it, and
        return the logits after it: [B, 1, V]. tokens: [B] long on the device. Only graphed runners
        (`use_graphs`) can; a model draft's loop uses it there."""
        message = "feed_tokens: only a runner with use_graphs feeds tokens from the device"
        raise NotImplementedError(message)

    def settle(self, tokens: Sequence[Sequence[int]]) -> None:
        """Write the tokens `feed_tokens` fed (B lists, oldest first) into the rows' host records."""
        message = "settle: only a runner with use_graphs feeds tokens from the device"
        raise NotImplementedError(message)

    def kernels(self) -> tuple[str, ...]:
        """The kernels a forward can run with, for the calibration to time on this machine; () for
        a runner whose costs are not calibrated (the router learns them as it runs)."""
        return ()

    def use_kernel(self, name: str) -> None:
        """Run the next forwards with kernel `name` (one of `kernels()`)."""
        raise ValueError(f"kernel: this runner has no kernels to choose from; got {name!r}")
