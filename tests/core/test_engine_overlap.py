"""On CUDA graphs the router learns from a step while the GPU runs the next one: every step is
learned exactly once, in order, one step late, and all of them by the end of the request.

The runner here is the CPU one behind the interface of a graphed runner (`use_graphs`, and a
`verify_step` that calls `while_waiting` between its forward and its result), so the engine's
bookkeeping is tested without a GPU; tests/gpu runs the real graphs through the same code.
"""
from __future__ import annotations

import pytest
import torch

from flashspec_core.arms import Arm
from flashspec_core.drafts import PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.records import StepRecord
from flashspec_core.routing.base import Router
from flashspec_core.step import LEARN_ROWS
from flashspec_core.verify import verify

pytestmark = pytest.mark.usefixtures("torch_one_thread")

ARM = Arm("prompt_lookup", 1)
PROMPT = [8, 2, 8, 1, 8, 2, 8, 1, 8, 2]


class Recording(Router):
    """A router that always picks ARM and keeps what it was told, in order."""

    arms = (ARM,)

    def __init__(self) -> None:
        self.learned: list[StepRecord] = []

    def select(self, domain: str, unavailable: frozenset[str] = frozenset()) -> Arm:
        return ARM

    def update(self, record: StepRecord) -> None:
        self.learned.append(record)


class GraphLike:
    """The engine's CPU runner seen through a graphed runner's interface."""

    use_graphs = True

    def __init__(self, inner, router: Recording) -> None:
        self.inner, self.router = inner, router
        self.at_launch: list[int] = []  # steps the router had learned when each step started
        self.after_wait: list[int] = []
        self.busy = lambda: True  # the device still computing, whatever the host does meanwhile

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify_step(self, contexts, drafts, active, sampling, draft_probs=None, generator=None, while_waiting=None):
        self.at_launch.append(len(self.router.learned))
        g = len(drafts[0])
        logits = self.inner.forward_to([list(c) + list(d) for c, d in zip(contexts, drafts)], active, keep_logits=g + 1)
        n_acc, out = verify(logits, torch.tensor(drafts, dtype=torch.long).view(len(contexts), g), draft_probs,
                            sampling, backend="torch", generator=generator)
        if while_waiting is not None:  # the GPU would still be computing here
            while_waiting(self.busy)
        self.after_wait.append(len(self.router.learned))
        return n_acc.tolist(), out.tolist()


def engine_with(tiny_target, router) -> SpecEngine:
    return SpecEngine(tiny_target, [PromptLookupDraft()], router=router, calibrate=False)


def test_the_router_learns_each_step_once_in_order_one_step_late(tiny_target):
    plain_router = Recording()
    expected = engine_with(tiny_target, plain_router).generate(PROMPT, max_new_tokens=20)
    router = Recording()
    engine = engine_with(tiny_target, router)
    runner = engine.runner = GraphLike(engine.runner, router)
    result = engine.generate(PROMPT, max_new_tokens=20)

    assert result.token_ids == expected.token_ids
    assert router.learned == result.stats.records  # each step once, in order, all by the end
    assert len(plain_router.learned) == len(expected.stats.records)
    # Step 0 scores the prefill's logits (no graph) and is learned at once; step k >= 2 replays
    # while the router learns step k - 1: it had learned k - 1 steps at launch (step 1: 1) and k
    # once the GPU was waited on.
    steps = len(result.stats.records)
    assert steps > 3
    assert runner.at_launch == [1] + list(range(1, steps - 1))
    assert runner.after_wait == list(range(1, steps))


def test_without_graphs_the_router_learns_each_step_before_the_next(tiny_target):
    router = Recording()
    engine = engine_with(tiny_target, router)
    seen: list[int] = []
    real_select = router.select
    router.select = lambda domain, unavailable=frozenset(): (seen.append(len(router.learned)), real_select(domain))[1]
    result = engine.generate(PROMPT, max_new_tokens=20)
    assert seen == list(range(len(result.stats.records)))
    assert router.learned == result.stats.records


def test_a_failing_step_still_hands_the_router_the_steps_before_it(tiny_target, monkeypatch):
    router = Recording()
    engine = engine_with(tiny_target, router)
    runner = engine.runner = GraphLike(engine.runner, router)
    real = GraphLike.verify_step

    def failing(self, *args, **kwargs):  # from the fourth replay on: the row fails alone too
        if len(self.at_launch) >= 3:
            raise RuntimeError("simulated failure in a replay")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GraphLike, "verify_step", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(PROMPT, max_new_tokens=20)
    assert len(router.learned) == 4  # step 0 and the three replayed steps, none twice
    assert runner.after_wait == [1, 2, 3]


def test_sampled_steps_on_graphs_cut_proposals_to_warmed_widths(tiny_target):
    """A sampled step replays a graph of its exact width: proposals are cut to γ + 1 in the
    runner's warmed widths, so no width outside them is ever fed (no capture mid-request)."""
    router = Recording()
    router.arms = (Arm("prompt_lookup", 4),)
    router.select = lambda domain, unavailable=frozenset(): Arm("prompt_lookup", 4)
    engine = engine_with(tiny_target, router)
    runner = engine.runner = GraphLike(engine.runner, router)
    runner.widths = (1, 3, 5)
    fed = []
    real = runner.verify_step
    runner.verify_step = lambda contexts, drafts, *a, **k: (fed.append(len(drafts[0])),
                                                            real(contexts, drafts, *a, **k))[1]
    for seed in range(6):
        result = engine.generate([6, 6, 6, 6, 1], max_new_tokens=24,
                                 sampling=SamplingParams(temperature=1.0, seed=seed))
        assert {r.drafted for r in result.stats.records} <= {0, 2, 4}
        assert {r.draft_lengths for r in result.stats.records} == {(0, 2, 4)}  # the router scores copies so
    assert set(fed) <= {0, 2, 4} and 4 in fed and 2 in fed
    greedy = engine.generate([6, 6, 6, 6, 1], max_new_tokens=24)  # greedy steps pad instead: uncut
    assert {r.drafted for r in greedy.stats.records} - {0, 2, 4}
    assert {r.draft_lengths for r in greedy.stats.records} == {()}


@pytest.mark.parametrize("busy", [True, False])
def test_learning_fills_the_devices_time_and_never_piles_up(tiny_target, busy):
    """Many rows: each step hands the router LEARN_ROWS records. While the device computes
    (busy), the window learns all of them; once it is done, one record a step (learning never
    holds the next step back by more) and the rest waits, at most LEARN_ROWS of it, newest kept;
    a row leaving the batch has its waiting records learned."""
    rows = LEARN_ROWS + 4
    router = Recording()
    engine = SpecEngine(tiny_target, [PromptLookupDraft()], router=router, calibrate=False, max_batch=rows)
    runner = engine.runner = GraphLike(engine.runner, router)
    runner.busy = lambda: busy
    results = engine.generate([PROMPT] * rows, max_new_tokens=20)  # identical rows: every step fuses
    records = [r for res in results for r in res.stats.records]
    window = [b - a for a, b in zip(runner.at_launch, runner.after_wait)]
    steps = len(runner.at_launch)
    assert steps > 3 and all(r.rows == 1 for r in records)
    assert window == ([0] + [LEARN_ROWS] * (steps - 1) if busy else [0] + [1] * (steps - 1))
    assert all(any(r is s for s in records) for r in router.learned)  # only real steps, each once
    assert len({id(r) for r in router.learned}) == len(router.learned)
    # all learned: the first step's, every window's, and what waited when the rows left
    assert len(router.learned) == LEARN_ROWS + sum(window) + LEARN_ROWS
