"""One decode step of the running rows, each with its own settings: draft, forward, processors, verify, commit, record.

Every row picks its own arm (the router's choice for its domain), so in one step a tool call may
copy its arguments from the prompt while a chat row beside it decodes plainly. Drafts propose for
the rows that chose them; the target scores every row's context and draft in one forward pass
(rows with shorter drafts re-feed a few context tokens, which changes no logit's law); each row's
logits go through its own processors (penalty, grammar mask, n-gram ban) and are verified with
its own sampling settings and its own random draws. So each row's output law is what it would be
alone, whatever else is in the batch and whichever arm it or its neighbours used.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.backends.base import TargetRunner
from flashspec_core.budget import TokenBudget
from flashspec_core.constrained.constraint import Constraint
from flashspec_core.drafts.base import DraftSource
from flashspec_core.handle import EngineFault
from flashspec_core.pieces import Pieces
from flashspec_core.processors.paths import PathProcessors
from flashspec_core.proposals import Drafted, cut_length
from flashspec_core.records import StepRecord
from flashspec_core.request import Row
from flashspec_core.routing.base import Router
from flashspec_core.verify import Backend
from flashspec_core.verify.rows import verify_rows

# The router is handed at most this many rows' records a step (in turn), and at most this many
# wait to be learned: its host work per row (copy drafts scored after the fact) would otherwise
# grow with the batch, and a few rows a step tell it as much about each domain's arms. At the
# CPU's default batch every row is learned from; on CUDA graphs learning fills the time the GPU
# computes (`Stepper.learn`), and what does not fit is dropped, oldest first.
LEARN_ROWS = 8


class Stepper:
    """Prefill and step rows on one target runner with a pool of drafts and a router."""

    def __init__(self, runner: TargetRunner, drafts: Mapping[str, DraftSource], router: Router, vocab: int,
                 device: torch.device, verify_backend: Backend,
                 json_tokens: Callable[[int, torch.device], torch.Tensor]) -> None:
        self.runner = runner
        self.drafts = drafts
        self.router = router
        self.vocab = vocab
        self.device = device
        self.verify_backend = verify_backend
        self._json_tokens = json_tokens  # [V] bool: what the n-gram ban spares under a schema
        # finished steps the router has not learned from, with their row's grammar state (a draft
        # that reads it is scored after the fact against that row's grammar) and their row
        self._unlearned: list[tuple[StepRecord, Constraint | None, Row]] = []
        self._turn = 0  # which rows the router learns from next
        # Learning that failed, by row: the step's tokens stand (they were final before the router
        # saw them), and the scheduler ends those rows' requests with the fault.
        self.faults: list[tuple[Row, EngineFault]] = []
        self.fed_seconds = 0.0  # the share of this step's forward that fed other rows' prompt pieces
        self.budget = TokenBudget()  # where a step pads its rows to one width (graphs), its cut
        # drafts never offered to a row without a grammar: they propose nothing there
        self._need_grammar = frozenset(name for name, d in drafts.items() if d.needs_constraint)

    # ------------------------------------------------------------------------------ prefill

    def prefill(self, rows: Sequence[Row], slots: int, chunk: int | None = None) -> None:
        """Feed the next piece of each row's prompt (at most `chunk` tokens; None: all of it; it starts
        at `row.prefilled`, which counts what its slot's cache held at admission) into its slot, all
        in one forward, the runner holding `slots` rows. A row whose whole prompt is fed keeps the
        logits after it for its first step (`row.first`, [1, V]) and gets its processors.

        The first token is scored from the prompt's own forward, as plain decoding scores it
        (HF `generate` and llama.cpp alike): some kernels round a long batch differently from a
        short one, so re-feeding the last prompt token with the first draft could break a
        near-tie the other way.
        """
        pieces = Pieces.of(rows, slots, chunk)
        start = time.perf_counter()
        logits = self.runner.score_rows(pieces.sequences, pieces.needs)
        self._prefilled(pieces, logits, time.perf_counter() - start)

    def _prefilled(self, pieces: Pieces, logits: Sequence[torch.Tensor | None], seconds: float) -> None:
        """Book a forward that fed `pieces` (`seconds` long); logits: per slot [1, V] or None."""
        for row in pieces.rows:
            row.stats.prefill_seconds += seconds
            row.stats.seconds += seconds
            if row.prefilled < len(row.prompt):
                continue
            row.first = logits[row.slot]
            assert row.first is not None  # the row fed a piece: the runner scored it
            vocab, device = row.first.shape[-1], row.first.device
            ban_under_schema = row.sampling.no_repeat_ngram_size and row.constraint is not None
            exempt = self._json_tokens(vocab, device) if ban_under_schema else None
            row.processors = PathProcessors(row.sampling, row.constraint, [row.prompt], vocab, device, exempt)

    # ------------------------------------------------------------------------------ a step

    def step(self, rows: Sequence[Row], slots: int, feeding: Pieces | None = None) -> list[list[int]]:
        """One decode step of `rows` (each prefilled, unfinished, in its own slot of the `slots`
        the runner holds). Returns each row's new tokens, in the order of `rows`.

        feeding: other rows' prompt pieces fed by the same forward (`prefill`'s work, done beside
        the step: on a runner without graphs one ragged pass reads the weights once for both);
        those rows take their first step at the next turn."""
        runner = self.runner
        if feeding is not None and runner.use_graphs:
            raise ValueError("feeding: a runner with graphs feeds prompt pieces apart (prefill)")
        warmed = runner.warmup_seconds
        t0 = time.perf_counter()
        arms = [self.router.select(row.domain, self._unavailable(row)) for row in rows]
        drafted = self._propose(rows, arms)
        if len(rows) > 1 or feeding is not None:  # a lone row's γ is its router's choice
            domains, names = [row.domain for row in rows], [arm.draft for arm in arms]
            greedy = [row.sampling.greedy for row in rows]
            if runner.use_graphs:
                drafted = self.budget.cut(domains, names, drafted, greedy, runner.step_seconds())
            elif runner.plan is not None:
                drafted = self.budget.cut_ragged(domains, names, drafted, greedy, runner.plan.width_seconds,
                                                 0 if feeding is None else feeding.tokens)
        t1 = time.perf_counter()
        self.fed_seconds = 0.0
        prefilled = [row.first is not None for row in rows]
        fused = None if feeding is not None else self._fused(rows, arms, drafted, slots)
        if fused is None and feeding is None:
            fused = self._mixed(rows, drafted, slots)
        n_acc, out = fused if fused is not None else self._forward_and_verify(rows, drafted, slots, feeding)
        t2 = time.perf_counter()
        fed = self.fed_seconds  # feeding's share of the forward: the prefill's time, not the step's
        new = []
        for row, n, tokens in zip(rows, n_acc, out):
            kept = row.output.append(tokens[: n + 1])
            context_len = len(row.seq)
            row.seq.extend(kept)
            assert row.processors is not None  # set up by the prefill
            row.processors.commit(0, kept)
            new.append((kept, context_len))
        verify_share = (t2 - t1 - fed) / len(rows)
        warmup_share = (runner.warmup_seconds - warmed) / len(rows)
        records = []
        for row, arm, d, n, (kept, context_len), first in zip(rows, arms, drafted, n_acc, new, prefilled):
            record = StepRecord(
                domain=row.domain, arm=arm, drafted=len(d.tokens), accepted=n, emitted=len(kept),
                draft_seconds=max(d.seconds, 1e-9), verify_seconds=verify_share, context_len=context_len,
                sequence=row.seq, rows=1, catchup_seconds=min(d.catchup, max(d.seconds, 1e-9)),
                warmup_seconds=warmup_share if warmup_share < verify_share else 0.0, draft_lengths=self._lengths(row),
                prefilled=first, unavailable=self._unavailable(row))
            records.append((record, row.constraint, row))
            self.budget.learn(row.domain, arm.draft, len(d.tokens), n)
            st = row.stats
            st.drafted += len(d.tokens)
            st.accepted += n
            st.seconds += t2 - t0 - fed
            st.step_rows += len(rows)
            st.records.append(record)
        self._queue_learning(records)
        if fused is None:
            self.learn()
        host = time.perf_counter() - t2
        for row in rows:
            row.stats.host_seconds += host
        return [kept for kept, _ in new]

    def learn(self, busy: Callable[[], bool] | None = None) -> None:
        """Hand the router the finished steps it has not learned from yet. busy: given while the
        device computes a step (`TargetRunner.score_step`'s while_waiting), it tells whether the
        device still does: then one step is learned, and more only while busy() holds, so
        learning fills the device's time and adds at most one update to the step's; the rest
        wait for the next step's (at most LEARN_ROWS wait)."""
        learned = 0
        while self._unlearned and (busy is None or not learned or busy()):
            record, constraint, row = self._unlearned.pop(0)
            fault = self._learn_one(record, constraint)
            if fault is not None:
                self.faults.append((row, fault))
            learned += 1

    def learn_row(self, row: Row) -> EngineFault | None:
        """Hand the router the steps of `row` not learned yet (it is leaving the batch: a caller
        reading the router's statistics after its answer finds them); the first that failed."""
        mine = [item for item in self._unlearned if item[2] is row]
        self._unlearned = [item for item in self._unlearned if item[2] is not row]
        faults = [self._learn_one(record, constraint) for record, constraint, _ in mine]
        return next((f for f in faults if f is not None), None)

    def _learn_one(self, record: StepRecord, constraint: Constraint | None) -> EngineFault | None:
        """Teach the router one finished step; what failed, named, instead of raising: learning
        runs after the step's tokens are final (and inside a graph replay's wait), so its failure
        must not pass for the step's."""
        for name, draft in self.drafts.items():
            try:
                draft.bind_constraint(constraint)
            except Exception as exc:  # see the docstring
                return EngineFault.of(f"draft {name!r} (bind_constraint, before the router learned a step)", exc)
        try:
            self.router.update(record)
        except Exception as exc:
            return EngineFault.of("the router (update, learning a finished step)", exc)
        return None

    def _queue_learning(self, records: list[tuple[StepRecord, Constraint | None, Row]]) -> None:
        """At most LEARN_ROWS of this step's records, taken in turn across steps; of what waits,
        the newest LEARN_ROWS are kept."""
        if len(records) <= LEARN_ROWS:
            self._unlearned.extend(records)
        else:
            start = self._turn % len(records)
            self._unlearned.extend((records + records)[start:start + LEARN_ROWS])
            self._turn += LEARN_ROWS
        del self._unlearned[:-LEARN_ROWS]

    # ------------------------------------------------------------------------------ drafting

    def _propose(self, rows: Sequence[Row], arms: Sequence[Arm]) -> list[Drafted]:
        """Each row's proposal. Rows that chose the same draft (and, for a model draft, share a
        sampling setting) are proposed for in one call, each row drawing from its own generator;
        a row under a grammar has a call of its own (its draft reads that row's grammar state)."""
        out = [Drafted([], None, 0.0, 0.0) for _ in rows]
        gammas = [min(arm.gamma, row.remaining - 1) for row, arm in zip(rows, arms)]
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, (row, arm) in enumerate(zip(rows, arms)):
            if arm.draft == NO_DRAFT or gammas[i] <= 0:
                continue
            draft = self.drafts[arm.draft]
            # A model draft's q comes from one setting per call; its rows draw from their own generators.
            shared = None if draft.deterministic else row.sampling.model_dump_json()
            groups[(arm.draft, id(row) if row.constraint is not None else shared)].append(i)
        for (name, _), members in groups.items():
            draft, lead = self.drafts[name], rows[members[0]]
            draft.bind_constraint(lead.constraint if len(members) == 1 else None)
            start = time.perf_counter()
            generators = None if lead.sampling.greedy else [g for i in members if (g := rows[i].generator)]
            proposal = draft.propose([rows[i].seq for i in members], max(gammas[i] for i in members),
                                     lead.sampling, generators)
            share = (time.perf_counter() - start) / len(members)
            for j, i in enumerate(members):
                tokens = list(proposal.tokens[j][:gammas[i]])
                tokens = tokens[:cut_length(len(tokens), self._lengths(rows[i]))]
                bad = sorted({t for t in tokens if not 0 <= t < self.vocab})
                if bad:  # caught here: the target's embedding would meet the id before verify does
                    raise ValueError(f"drafts: {name!r} proposed token ids {bad[:5]} outside the target's "
                                     f"vocabulary [0, {self.vocab}); a draft must share the target's tokenizer")
                probs = None if proposal.probs is None else proposal.probs[j, :len(tokens)].to(self.device)
                out[i] = Drafted(tokens, probs, share, proposal.catchup_seconds / len(members))
        return out

    def _graphable(self, row: Row) -> bool:
        """Whether `row`'s steps may run as one call of the runner (a CUDA-graph replay): no
        processor between forward and verification, and the verify backend the graph runs (torch
        ops for greedy steps, the Triton kernel for sampled ones) not pinned to another."""
        sampling = row.sampling
        pinned_ok = self.verify_backend == "auto" or (self.verify_backend == "triton" and not sampling.greedy)
        return (self.runner.use_graphs and pinned_ok and row.constraint is None
                and sampling.repetition_penalty == 1.0 and not sampling.no_repeat_ngram_size)

    def _unavailable(self, row: Row) -> frozenset[str]:
        """The drafts that cannot propose for `row`: those that need a grammar, when it has none."""
        return self._need_grammar if row.constraint is None else frozenset()

    def _lengths(self, row: Row) -> tuple[int, ...]:
        """The draft lengths `row`'s steps verify uncut, others being cut to the longest of them
        that fits: a sampled step on CUDA graphs replays a graph of its exact width, so its
        proposal is cut to a warmed one (proposals.cut_length); () when any length runs."""
        if row.sampling.greedy or not self._graphable(row):
            return ()
        return tuple(w - 1 for w in self.runner.widths)

    # ------------------------------------------------------------------------------ verifying

    def _fused(self, rows: Sequence[Row], arms: Sequence[Arm], drafted: list[Drafted],
               slots: int) -> tuple[list[int], list[list[int]]] | None:
        """The step as one call of the runner (a CUDA-graph replay), where it can take it: every
        slot's row stepping, no processor between forward and verification, one setting and one
        draft length for all, and the verify backend the graph runs not pinned to another."""
        runner, lead = self.runner, rows[0]
        sampling = lead.sampling
        if len(rows) != slots or any(r.first is not None or r.sampling != sampling for r in rows):
            return None
        if not self._graphable(lead):
            return None
        if not sampling.greedy and len(rows) > 1:  # each sampled row draws from its own generator
            return None
        lengths = {(len(d.tokens), d.probs is None) for d in drafted}
        if len(lengths) != 1:
            return None
        ordered = sorted(range(len(rows)), key=lambda i: rows[i].slot)
        tokens = [drafted[i].tokens for i in ordered]
        probs = None if drafted[0].probs is None else torch.stack([drafted[i].probs for i in ordered])  # type: ignore[misc]
        result = runner.verify_step([rows[i].seq for i in ordered], tokens, [True] * slots, sampling, probs,
                                    lead.generator, self.learn)
        if result is None:
            return None
        n_acc, out = [0] * len(rows), [[] for _ in rows]  # type: list[int], list[list[int]]
        for k, i in enumerate(ordered):
            n_acc[i], out[i] = result[0][k], result[1][k]
        return n_acc, out

    def _mixed(self, rows: Sequence[Row], drafted: list[Drafted],
               slots: int) -> tuple[list[int], list[list[int]]] | None:
        """The step as one graph replay when `_fused` cannot take it (rows of other draft lengths,
        settings or processors, free or prefilling slots beside them): plain greedy rows are
        verified in the graph, every other row from its logits of the same replay, through its
        processors and its own sampling (`verify.rows.verify_rows`). None without graphs, or when no warmed
        width holds the step."""
        if not self.runner.use_graphs:
            return None
        sequences: list[list[int]] = [[] for _ in range(slots)]
        needs, active = [0] * slots, [False] * slots
        drafts: list[list[int] | None] = [None] * slots
        for row, d in zip(rows, drafted):
            need = len(d.tokens) + (row.first is None)
            if need:  # else a first step without a draft: the prefill's logits score it
                sequences[row.slot], needs[row.slot], active[row.slot] = row.seq + d.tokens, need, True
                if row.first is None and row.sampling.greedy and self._graphable(row):
                    drafts[row.slot] = d.tokens
        if not any(active):
            return None
        result = self.runner.score_step(sequences, needs, drafts, active, self.learn)
        if result is None:
            return None
        verified, logits = result
        n_acc, out = [0] * len(rows), [[] for _ in rows]  # type: list[int], list[list[int]]
        rest = []
        for i, row in enumerate(rows):
            done = verified[row.slot] if active[row.slot] else None
            if done is None:
                rest.append(i)
            else:
                n_acc[i], out[i] = done[0], done[1:]
        if rest:
            scored = {rows[i].slot: t for i in rest if (t := logits[rows[i].slot]) is not None}
            accepted, tokens = verify_rows([rows[i] for i in rest], [drafted[i] for i in rest], scored, self.device,
                                           self.verify_backend)
            for k, i in enumerate(rest):
                n_acc[i], out[i] = accepted[k], tokens[k]
        return n_acc, out

    def _score(self, rows: Sequence[Row], drafted: list[Drafted], slots: int,
               feeding: Pieces | None = None) -> dict[int, torch.Tensor]:
        """Slot -> the target's logits [need, V] after each of the row's last `need` path tokens
        (need: the draft's length, plus one unless the prefill scored the first position), in as
        few forwards as the runner can (`TargetRunner.score_rows`), with `feeding`'s pieces."""
        paths: list[list[int] | None] = [None] * slots if feeding is None else list(feeding.sequences)
        needs = [0] * slots if feeding is None else list(feeding.needs)
        for row, d in zip(rows, drafted):
            paths[row.slot], needs[row.slot] = row.seq + d.tokens, len(d.tokens) + (row.first is None)
        start = time.perf_counter()
        scored = self.runner.score_rows(paths, needs)
        if feeding is not None:  # the pieces' share of the forward, by the tokens fed
            share = feeding.tokens / max(1, feeding.tokens + sum(needs[row.slot] for row in rows))
            self.fed_seconds = (time.perf_counter() - start) * share
            self._prefilled(feeding, scored, self.fed_seconds)
        return {row.slot: logits for row in rows if (logits := scored[row.slot]) is not None}

    def _forward_and_verify(self, rows: Sequence[Row], drafted: list[Drafted], slots: int,
                            feeding: Pieces | None = None) -> tuple[list[int], list[list[int]]]:
        """Score every row's context + draft in one target forward, process each row's logits
        along its path and verify rows of one setting together; host lists out: accepted per row,
        and per row the accepted draft tokens then the recovered or bonus token.

        On a row's first step the prefill's logits (`row.first`) score its first position and the
        forward scores only its draft (see `prefill`).
        """
        scored = self._score(rows, drafted, slots, feeding)
        return verify_rows(rows, drafted, scored, self.device, self.verify_backend)
