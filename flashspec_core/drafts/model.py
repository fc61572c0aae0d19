"""A draft that is itself a causal LM sharing the target's tokenizer (smaller, NF4, or distilled).

It samples γ tokens autoregressively through the shared sampling function and returns the exact
distributions it drew them from, so the verifier's min(1, p/q) test keeps the output exact. Its KV
cache follows the verified sequence: whatever the verifier rejected is rolled back on the next call.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from flashspec_core.backends import model_runner
from flashspec_core.drafts.base import DraftSource
from flashspec_core.processors.sampling import SamplingParams, probs_from_logits, sample_from_probs
from flashspec_core.proposals import Generators, Proposal


class ModelDraft(DraftSource):
    """Autoregressive draft from an HF causal LM.

    A subclass may score only a subset of the vocabulary (`head_ids`, e.g. a distilled draft's
    reduced head): it samples over the subset and reports q over the full vocabulary, zero outside.

    max_context: the draft reads at most this many of a row's latest tokens when it starts on the
    row (None: all). Starting on a row costs a prefill of what it reads, paid every time the
    router tries the draft in a request, and after a long retrieved document that prefill costs
    many plain steps of the target. The window then grows with the
    row up to twice this, and moves to the latest `max_context` tokens (another prefill) past
    that. Any draft keeps the output exact; the window changes only what it proposes.
    """

    deterministic = False

    def __init__(self, model: PreTrainedModel, name: str = "model", pad_token_id: int = 0,
                 max_context: int | None = None):
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context < 1):
            raise ValueError(f"max_context must be an int >= 1 or None (every token); got {max_context!r}")
        self.name = name
        self.model = model
        self.max_context = max_context
        self.starts: list[int] = []  # per row of the request: where the draft's window begins
        self._runner = model_runner(model, pad_token_id)
        # CUDA graphs: a draft step feeds one token, or two after the target's step; it verifies nothing
        self._runner.warm([1, 2], sampled=False)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]  # of the q it reports

    @property
    def head_ids(self) -> torch.Tensor | None:
        """[K] sorted token ids the logits columns stand for; None: the whole vocabulary."""
        return None

    def _full_q(self, q_head: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """q_head: [B, K] over `head` -> [B, V] over the full vocabulary, zero outside the head."""
        q = torch.zeros((q_head.shape[0], self.vocab_size), dtype=q_head.dtype, device=q_head.device)
        return q.index_copy_(1, head, q_head)

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        gamma: int,
        sampling: SamplingParams,
        generator: Generators = None,
    ) -> Proposal:
        if gamma <= 0:
            return Proposal([[] for _ in contexts])
        rows = [list(c[start:]) for c, start in zip(contexts, self._window(contexts))]
        self._runner.resize(len(rows))  # row b of every call is row b of the runner
        head = self.head_ids
        tokens, probs = [], []
        catchup = 0.0
        try:
            # A draft that ran the step before has at most that step's last draft token and the
            # target's token to feed; more (the prompt, or steps other drafts took) is fed first,
            # timed apart, so the router can tell the price of switching from that of drafting.
            behind = [len(r) - self._runner.prefix_len(b, r) > 2 for b, r in enumerate(rows)]
            if any(behind):
                start = time.perf_counter()
                self._runner.forward_to([r[:-1] for r in rows], behind, keep_logits=1)
                catchup = time.perf_counter() - start
            warmed = self._runner.warmup_seconds  # a GPU runner's graph captures
            # On CUDA graphs each drafted token goes back to the device runner as a tensor: the
            # loop queues its γ forwards and the host waits once, for the γ tokens at the end.
            on_device = self._runner.use_graphs
            logits = self._runner.forward_to(rows, keep_logits=1)[:, -1]  # [B, V] or [B, K]
            token: torch.Tensor | None = None  # [B] the token drafted last
            for i in range(gamma):
                if i:
                    assert token is not None  # drafted at i - 1
                    logits = (self._runner.feed_tokens(token) if on_device
                              else self._runner.forward_to(rows, keep_logits=1))[:, -1]
                q = probs_from_logits(logits, sampling)  # same shape
                if sampling.greedy:
                    pick = q.argmax(-1)
                else:
                    pick = _sample(q, generator)
                token = pick if head is None else head[pick]  # [B]
                tokens.append(token)
                probs.append(q if head is None else self._full_q(q, head))
                if not on_device:
                    for row, t in zip(rows, token.tolist()):
                        row.append(t)
        except BaseException:  # the cache may hold half a forward: start the next call afresh
            self._runner.reset(len(rows))
            raise
        drafted = torch.stack(tokens, dim=1).tolist()  # [B, γ]: the call's one sync on a GPU
        if on_device:
            self._runner.settle([row[:-1] for row in drafted])  # the last token was never fed
        # A graph captured in this call is, like catch-up, paid once and not by the draft's steps.
        catchup += self._runner.warmup_seconds - warmed
        return Proposal(drafted, torch.stack(probs, dim=1), catchup)  # probs: [B, γ, V]

    def _window(self, contexts: Sequence[Sequence[int]]) -> list[int]:
        """Where each row's window begins: kept while the row grows, moved once it is past twice
        `max_context` (each start is a new prefix for the runner: a catch-up of the window)."""
        if self.max_context is None:
            return [0] * len(contexts)
        while len(self.starts) < len(contexts):
            self.starts.append(-1)  # not started on this row yet
        for b, c in enumerate(contexts):
            start = self.starts[b]
            if start < 0 or start > len(c) or len(c) - start > 2 * self.max_context:
                self.starts[b] = max(0, len(c) - self.max_context)
        return self.starts[:len(contexts)]

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Rows start: their windows are set at their first proposal; the runner's rows keep their
        caches, reused where a later call's rows share their prefix."""
        self.starts = []

    def end(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """The cache stays for the next request's common prefix (CachedModel.begin)."""


def _sample(q: torch.Tensor, generator: Generators) -> torch.Tensor:
    """One token per row of q [B, K]: with one generator per row, each row's from its own draw
    (inverse CDF), so a row's tokens do not depend on the rows beside it. Returns [B] long."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(q, 1, generator=generator).squeeze(-1)
    uniforms = torch.stack([torch.rand((), generator=g, device=g.device) for g in generator]).to(q.device)
    return sample_from_probs(q, uniforms)
