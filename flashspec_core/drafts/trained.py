"""Drafts trained by `flashspec-agents distill`, served as draft sources.

A trained draft is a few decoder layers that borrow the target's embeddings and score the target's
head on a token subset (see flashspec_core/distill/model.py). It samples through the shared
sampling function over that subset and reports q over the target's full vocabulary, zero outside
the subset, so the verifier's min(1, p/q) test keeps the output exactly the target's. Each request
widens the subset with the prompt's own tokens (identifiers in code, names in a RAG chunk), which
costs one row gather per request and lets the draft copy what the trained subset lacks.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from flashspec_core.distill.model import DraftNetwork, IncompatibleDraft, load_draft
from flashspec_core.drafts.model import ModelDraft
from flashspec_core.models import LoadedModel
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.proposals import Generators, Proposal

WEIGHTS_DIR = Path(__file__).with_name("weights")


# A distilled draft reads at most this many of a row's latest tokens (ModelDraft.max_context): its
# training rows were at most 384 prompt + 160 answer tokens (docs/distill.md), so it has never
# seen more, and reading a 1.3k-token retrieval prompt cost each try of it 0.1-0.3 s on a CPU.
TRAINED_CONTEXT = 512


class TrainedDraft(ModelDraft):
    """Autoregressive draft from a distilled network, with its own KV cache."""

    def __init__(self, network: DraftNetwork, name: str, pad_token_id: int = 0, prompt_vocab: bool = True,
                 domain: str = "all", accepted_lengths: dict[int, float] | None = None,
                 max_context: int | None = TRAINED_CONTEXT):
        super().__init__(network.lm, name=name, pad_token_id=pad_token_id, max_context=max_context)
        self.domain = domain
        self.accepted_lengths = dict(accepted_lengths or {})
        self.network = network
        self.prompt_vocab = prompt_vocab
        self.vocab_size = network.target_vocab
        self._head_tokens: list[int] | None = None  # the prompts' tokens to widen the head with (begin)
        self._head_pending = False  # begin noted a head that no proposal has set yet

    @property
    def head_ids(self) -> torch.Tensor:
        """[K'] sorted token ids the draft can propose (the trained subset plus the prompt's tokens)."""
        return self.network.head_ids

    @classmethod
    def from_file(cls, path: str | Path, target: PreTrainedModel, pad_token_id: int = 0, name: str | None = None,
                  prompt_vocab: bool = True) -> TrainedDraft:
        """Load weights written by `distill`; ValueError if they were trained for another target."""
        network, meta = load_draft(path, target)
        return cls(network, name or meta.get("name") or Path(path).stem, pad_token_id, prompt_vocab,
                   meta.get("domain", "all"), card_accepted_lengths(Path(path).with_suffix(".md")))

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Note the head for this request: the trained subset plus the prompts' tokens, except on
        CUDA graphs, where the head stays the trained subset: a head of another size is another
        forward, and recapturing the draft's graphs per request would cost more than the prompt's
        tokens win. It is built at the request's first proposal: selecting its rows of the
        target's head costs milliseconds after a long prompt, which every request would otherwise
        pay even where the router never runs the draft."""
        widen = self.prompt_vocab and not self._runner.use_graphs
        self._head_tokens = [t for p in prompts for t in p] if widen else None
        self._head_pending = True
        super().begin(prompts)

    def propose(self, contexts: Sequence[Sequence[int]], gamma: int, sampling: SamplingParams,
                generator: Generators = None) -> Proposal:
        """ModelDraft.propose, once this request's head is set (see `begin`)."""
        if self._head_pending:
            net = self.network
            head = net.vocab_ids if self._head_tokens is None else net.head_with(self._head_tokens)
            if not torch.equal(head, net.head_ids):
                net.set_head(head)
            self._head_pending = False
        return super().propose(contexts, gamma, sampling, generator)


def card_accepted_lengths(card: Path) -> dict[int, float]:
    """γ -> draft tokens accepted per step on the held-back prompts of all domains, from the JSON
    block `distill` writes into a draft's card; {} when there is no card or it has no such block."""
    try:
        text = card.read_text()
        block = text.split("```json", 1)[1].split("```", 1)[0]
        evaluation = json.loads(block)["evaluation"]["all"]
    except (OSError, IndexError, KeyError, TypeError, ValueError):
        return {}
    return {int(k.split("@")[1]): float(v) for k, v in evaluation.items() if k.startswith("accept_len@")}


def shipped_drafts(target: LoadedModel, folder: str | Path = WEIGHTS_DIR) -> list[TrainedDraft]:
    """The trained drafts in `folder` that were made for this target (others are skipped: they cannot help it)."""
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    drafts = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            drafts.append(TrainedDraft.from_file(path, target.model, pad))
        except IncompatibleDraft:
            continue
    return drafts
