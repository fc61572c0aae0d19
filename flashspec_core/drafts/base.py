"""The one Protocol every draft source implements.

A draft proposes up to γ tokens per row and says which distribution q it drew them from; the
verifier then accepts a prefix with the rule that keeps the output exactly the target's. q must be
honest: a model draft returns the probabilities it sampled from (through the shared sampling
function), a deterministic draft returns `probs=None`, meaning one-hot q at each proposed token.

The members with bodies are defaults for what only some drafts use; a draft subclasses
`DraftSource` to get them, so the engine calls every member without asking first.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.proposals import Generators, Proposal

if TYPE_CHECKING:
    from flashspec_core.constrained.constraint import Constraint


@runtime_checkable
class DraftSource(Protocol):
    name: str
    # True when q is one-hot, proposing has no side effects and a γ proposal is the head of the
    # proposal for any larger γ: the router may then score this draft after the fact on every
    # step, whichever arm ran, from one call at its largest γ (full-information updates).
    deterministic: bool
    # γ -> draft tokens accepted per step, measured off-line (a trained draft's card); empty when
    # unknown. The router's prior for an arm it has not run yet (routing/priors.py).
    accepted_lengths: Mapping[int, float] = MappingProxyType({})
    # True when the draft proposes only under a request's grammar (the grammar-forced draft): for a
    # row decoding without a Constraint its arms would be plain decoding under another name, so the
    # step never offers them to such a row and the router never scores them on it.
    needs_constraint: bool = False

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        gamma: int,
        sampling: SamplingParams,
        generator: Generators = None,
    ) -> Proposal:
        """Up to `gamma` tokens continuing each row of `contexts` (prompt + verified output).
        generator: one per row, one for all rows, or None (see `proposals.Generators`)."""
        ...

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """A new request starts: drop per-request state (a KV cache, say). Nothing by default."""
        return None

    def end(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """The request finished with these outputs (a cross-request cache indexes them). Nothing by default."""
        return None

    def bind_constraint(self, constraint: Constraint | None) -> None:
        """The grammar state of the request now decoding (None: unconstrained), for a draft that
        proposes what the grammar forces (constrained/forced_draft.py). Ignored by default."""
        return None


def check_draft(draft: object, where: str = "drafts") -> DraftSource:
    """`draft` if it is a DraftSource, else a ValueError naming `where` and the fix."""
    if not isinstance(draft, DraftSource):
        raise ValueError(f"{where}: {draft!r} is not a DraftSource; a draft of your own subclasses "
                         "flashspec_core.drafts.DraftSource, which supplies the members it may leave out "
                         "(accepted_lengths, needs_constraint, begin, end, bind_constraint)")
    return draft
