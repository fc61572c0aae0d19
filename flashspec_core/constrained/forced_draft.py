"""The grammar-forced draft: propose the tokens the grammar forces from the row's current state.

It proposes xgrammar's jump-forward tokens, then any token that is the only one the grammar allows
(`{"name": "`, the tool name, property keys, separators, closing brackets, the final EOS) and,
where the grammar leaves a choice (a string value, a number), optionally a prompt-lookup copy
filtered by the grammar. It is deterministic (one-hot q, no side effects), so the router can also
score it after the fact. It needs the request's Constraint, handed over by the engine through
`bind_constraint`; with none bound it proposes nothing and the step is plain decoding. Exactness
never depends on it: the target's logits are masked and verified as for any other draft.
"""
from __future__ import annotations

from collections.abc import Sequence

from flashspec_core.constrained.constraint import Constraint, GrammarCursor
from flashspec_core.drafts.base import DraftSource
from flashspec_core.drafts.prompt_lookup import lookup_continuation
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.proposals import Generators, Proposal


class GrammarForcedDraft(DraftSource):
    """Forced tokens from the grammar, then (optionally) grammar-filtered prompt-lookup copies.

    lookup_ngram: longest n-gram matched when copying free text from the context; 0 disables
    copying, so only forced tokens are proposed.
    """

    deterministic = True
    needs_constraint = True

    def __init__(self, name: str = "grammar", lookup_ngram: int = 3):
        if not isinstance(lookup_ngram, int) or lookup_ngram < 0:
            raise ValueError(f"lookup_ngram must be an int >= 0 (0 disables copying); got {lookup_ngram!r}")
        self.name = name
        self.lookup_ngram = lookup_ngram
        self._constraint: Constraint | None = None

    def bind_constraint(self, constraint: Constraint | None) -> None:
        """The engine's per-request hook: the constraint of the request now decoding (or None)."""
        if constraint is not None and not isinstance(constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint or None; got {type(constraint).__name__}")
        self._constraint = constraint

    def propose(
        self,
        contexts: Sequence[Sequence[int]],
        gamma: int,
        sampling: SamplingParams,
        generator: Generators = None,
    ) -> Proposal:
        constraint = self._constraint
        if constraint is None or gamma <= 0:
            return Proposal([[] for _ in contexts])
        aligned = len(contexts) == constraint.batch_size
        tokens = []
        for b, context in enumerate(contexts):
            with constraint.cursor(context, row=b if aligned else None) as cursor:
                tokens.append([] if cursor is None else self._walk(cursor, list(context), gamma))
        return Proposal(tokens)

    def _walk(self, cursor: GrammarCursor, context: list[int], gamma: int) -> list[int]:
        """Up to `gamma` tokens: forced ones first, copies where the grammar leaves a choice."""
        out: list[int] = []
        while len(out) < gamma and not cursor.terminated:
            step = cursor.jump_forward()
            if not step:
                sole = cursor.sole_token()
                step = [sole] if sole is not None else self._copy(context + out, gamma - len(out))
            taken = 0
            for tok in step[: gamma - len(out)]:
                if not cursor.accept(tok):
                    break
                out.append(tok)
                taken += 1
            if taken == 0:
                break
        return out

    def _copy(self, context: list[int], gamma: int) -> list[int]:
        if self.lookup_ngram == 0:
            return []
        return lookup_continuation(context, gamma, self.lookup_ngram, 1)

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """Per-request state lives in the bound Constraint."""

    def end(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        self._constraint = None
