"""A step's token budget: how many drafted tokens of each row are worth computing beside the others.

A graphed step feeds all its rows at one width, so one row drafting 16 tokens makes 63 rows beside
it compute 17 columns: `cut` picks the measured width with the most expected tokens (each row's
bonus or recovered token plus its expected accepted tokens at that cut, learned per domain and
draft) per second. A CPU step is one ragged forward costing its tokens: `cut_ragged` keeps each
row's drafted tokens most likely accepted first while the step's expected tokens per second rise.
Only greedy proposals are cut (exact: greedy tokens do not depend on a proposal's length); a
sampled row never is (its seeded draws follow its proposals' lengths), nor a lone row.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from flashspec_core.proposals import Drafted

LONGEST = 16  # the longest draft an arm proposes (γ <= 16)
WINDOW = 32  # the accepted counts' running mean weighs about this many recent steps


class Acceptance:
    """Per (domain, draft): the running mean of min(accepted, m) for each cut m of a proposal.

    A step that proposed k tokens and had n accepted tells what a cut to any m <= k would have
    kept (min(n, m)); it says nothing of longer cuts, which keep what they last learned."""

    def __init__(self) -> None:
        self._means: dict[tuple[str, str], list[float]] = {}  # m -> mean of min(accepted, m)
        self._counts: dict[tuple[str, str], list[int]] = {}

    def learn(self, domain: str, draft: str, proposed: int, accepted: int) -> None:
        """Record one step of `draft` in `domain` that proposed `proposed` tokens and had `accepted` accepted."""
        if proposed <= 0:
            return
        key = (domain, draft)
        means = self._means.setdefault(key, [0.0] * (LONGEST + 1))
        counts = self._counts.setdefault(key, [0] * (LONGEST + 1))
        for m in range(1, min(proposed, LONGEST) + 1):
            counts[m] += 1
            weight = 1.0 / min(counts[m], WINDOW)
            means[m] += weight * (min(accepted, m) - means[m])

    def expected(self, domain: str, draft: str, cut: int) -> float:
        """The accepted tokens a proposal of `draft` in `domain` cut to `cut` is expected to keep;
        `cut` itself (every token accepted) before any step of that length was seen: an unmeasured
        length is never cut for being unmeasured."""
        if cut <= 0:
            return 0.0
        counts = self._counts.get((domain, draft))
        m = min(cut, LONGEST)
        if counts is None or not counts[m]:
            return float(cut)
        return self._means[(domain, draft)][m]


def best_width(groups: Mapping[tuple[str, str, int], int], seconds: Mapping[int, float],
               acceptance: Acceptance, floor: int = 1) -> int | None:
    """The width (tokens a row feeds: its cut proposal plus one) of `seconds`, the runner's measured
    step time by width, at least `floor`, at which the step's rows are expected to emit the most
    tokens per second; None when none is measured. groups: (domain, draft, proposed length) -> rows."""
    best, best_rate = None, -1.0
    for width, cost in sorted(seconds.items()):
        if width < floor or cost <= 0:
            continue
        tokens = sum(count * (1.0 + acceptance.expected(domain, draft, min(k, width - 1)))
                     for (domain, draft, k), count in groups.items())
        if tokens / cost > best_rate:
            best, best_rate = width, tokens / cost
    return best


class TokenBudget:
    """Cuts a step's proposals to the width `best_width` picks, and learns acceptance from steps."""

    def __init__(self) -> None:
        self.acceptance = Acceptance()
        self.cuts = 0  # proposals cut so far (benchmarks and tests read it)

    def learn(self, domain: str, draft: str, proposed: int, accepted: int) -> None:
        self.acceptance.learn(domain, draft, proposed, accepted)

    def cut(self, domains: Sequence[str], drafts: Sequence[str], drafted: list[Drafted],
            greedy: Sequence[bool], seconds: Mapping[int, float]) -> list[Drafted]:
        """Each row's proposal (domain, draft name and whether it is greedy per row), greedy ones
        cut to the step's best width; unchanged for fewer than two rows, or when the runner
        measured no step times."""
        if len(drafted) < 2 or not seconds:
            return drafted
        longest = max((len(d.tokens) for d, g in zip(drafted, greedy) if g), default=0)
        floor = 1 + max((len(d.tokens) for d, g in zip(drafted, greedy) if not g), default=0)
        if longest < floor:
            return drafted
        groups: dict[tuple[str, str, int], int] = {}
        for domain, draft, d in zip(domains, drafts, drafted):
            key = (domain, draft, len(d.tokens))
            groups[key] = groups.get(key, 0) + 1
        width = best_width(groups, seconds, self.acceptance, floor)
        if width is None or width - 1 >= longest:
            return drafted
        keep = width - 1
        return self._shortened(drafted, [keep if g else len(d.tokens) for d, g in zip(drafted, greedy)])

    def cut_ragged(self, domains: Sequence[str], drafts: Sequence[str], drafted: list[Drafted],
                   greedy: Sequence[bool], seconds: Callable[[int], float], fed: int = 0) -> list[Drafted]:
        """Each row's proposal with greedy ones cut where one forward over every row's tokens (each
        row's proposal plus its bonus or recovered token, and `fed` prompt tokens of other rows)
        costs `seconds(tokens)`: the drafted tokens, most likely accepted first (a row's k-th token
        is worth the learned chance that k or more are accepted), are kept while the step's
        expected tokens per second rises. Unchanged for a lone row with nothing fed beside it."""
        if len(drafted) < 2 and not fed:
            return drafted
        tokens = fed + sum(1 + (0 if g else len(d.tokens)) for d, g in zip(drafted, greedy))
        expected = sum(1.0 + (0.0 if g else self.acceptance.expected(dom, name, len(d.tokens)))
                       for dom, name, d, g in zip(domains, drafts, drafted, greedy))
        gains: list[tuple[float, int, int]] = []  # (worth, position in its row, row)
        for i, (dom, name, d, g) in enumerate(zip(domains, drafts, drafted, greedy)):
            if not g:
                continue
            prev, cap = 0.0, 1.0
            for k in range(1, len(d.tokens) + 1):
                now = self.acceptance.expected(dom, name, k)
                cap = min(cap, max(0.0, now - prev))  # a later token is never worth more
                prev = now
                gains.append((cap, k, i))
        gains.sort(key=lambda t: (-t[0], t[1]))
        best, best_rate = 0, expected / seconds(tokens)
        for n, (worth, _, _) in enumerate(gains, 1):
            expected += worth
            rate = expected / seconds(tokens + n)
            if rate > best_rate:
                best, best_rate = n, rate
        keep = [len(d.tokens) if not g else 0 for d, g in zip(drafted, greedy)]
        for _, _, i in gains[:best]:
            keep[i] += 1
        return self._shortened(drafted, keep)

    def _shortened(self, drafted: list[Drafted], keep: Sequence[int]) -> list[Drafted]:
        """Each proposal cut to its `keep` tokens (and its q with it), counting the cuts."""
        out = []
        for d, k in zip(drafted, keep):
            if k < len(d.tokens):
                self.cuts += 1
                d = Drafted(d.tokens[:k], None if d.probs is None else d.probs[:k], d.seconds, d.catchup)
            out.append(d)
        return out
