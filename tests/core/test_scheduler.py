"""Continuous batching: requests join the running batch mid-flight with their own settings and arms,
and each row's output is what it would be alone; cancellation, deadlines, back-pressure, shutdown.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch
from helpers import RandomRouter, hold_prefills_until, step_rows, tiny_llama

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.drafts import ModelDraft, PromptLookupDraft, SuffixCacheDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.handle import RequestCancelled
from flashspec_core.pieces import Pieces
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.fixed import FixedRouter
from flashspec_core.scheduler import EngineBusy, EngineClosed

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7], [8, 2, 8, 1, 8, 2, 8, 1, 8, 2], [6, 6, 6, 6, 1],
           [5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]]
ARMS = [Arm(NO_DRAFT, 0), Arm("prompt_lookup", 2), Arm("prompt_lookup", 4), Arm("suffix_cache", 3),
        Arm("model", 2), Arm("model", 4)]


@torch.no_grad()
def hf(loaded, prompt: list[int], max_new: int, penalty: float = 1.0) -> list[int]:
    """HF `generate(do_sample=False)` on one prompt (with HF's repetition penalty): the reference."""
    ids = torch.tensor([prompt])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                repetition_penalty=penalty, pad_token_id=loaded.tokenizer.pad_token_id)
    return out[0, len(prompt):].tolist()


def engine_over(loaded, router, draft_model=None, **kwargs) -> SpecEngine:
    drafts = [PromptLookupDraft(), SuffixCacheDraft()]
    if draft_model is not None:
        drafts.append(ModelDraft(draft_model, name="model", pad_token_id=loaded.tokenizer.pad_token_id))
    return SpecEngine(loaded, drafts, router=router, verify_backend="torch", **kwargs)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_llama(16, seed=1)


def test_rows_joining_mid_flight_with_their_own_settings_and_arms_equal_hf_generate(tiny_target, draft_model,
                                                                                   monkeypatch):
    """A stream starts alone; four requests with other budgets, stops and penalties join it after
    its first steps; the router picks every row's arm at random each step. Greedy, every row is
    HF's output for its prompt and settings."""
    engine = engine_over(tiny_target, RandomRouter(ARMS, seed=3), draft_model)
    settings = [dict(max_new_tokens=30), dict(max_new_tokens=12), dict(max_new_tokens=20, penalty=1.3),
                dict(max_new_tokens=25), dict(max_new_tokens=18, penalty=1.1)]
    expected = [hf(tiny_target, p, s["max_new_tokens"], s.get("penalty", 1.0)) for p, s in zip(PROMPTS, settings)]
    widths = step_rows(monkeypatch, engine)

    def sampling(s):
        return SamplingParams(repetition_penalty=s.get("penalty", 1.0))

    stream = engine.stream(PROMPTS[0], max_new_tokens=30)
    first = [t for _ in range(3) for t in next(stream).token_ids]
    gate = Gate(engine)  # the others join while the stream is running, however slowly they are submitted
    assert gate.entered.wait(10)
    handles = [engine.submit([p], max_new_tokens=s["max_new_tokens"], sampling=sampling(s))
               for p, s in zip(PROMPTS[1:], settings[1:])]
    gate.open.set()
    rest = [t for chunk in stream for t in chunk.token_ids]
    outputs = [first + rest] + [h.wait()[0].token_ids for h in handles]
    assert outputs == expected
    assert widths[0] == 1 and max(widths) >= 3, "the later requests joined the running batch"
    arms = {str(a) for h in handles for a in h.results[0].stats.arms}
    assert len(arms) >= 4, "rows used different arms"


def test_a_seeded_sampled_row_draws_the_same_tokens_whatever_runs_beside_it(tiny_target):
    sampling = SamplingParams(temperature=1.0, seed=7)
    alone = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 4)))
    expected = alone.generate(PROMPTS[2], max_new_tokens=24, sampling=sampling).token_ids
    crowded = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 4)))
    others = [crowded.submit([p], max_new_tokens=24, sampling=SamplingParams(temperature=0.7, seed=i))
              for i, p in enumerate(PROMPTS)]
    mine = crowded.submit([PROMPTS[2]], max_new_tokens=24, sampling=sampling)
    greedy = crowded.submit(PROMPTS[:3], max_new_tokens=16)
    assert mine.wait()[0].token_ids == expected
    assert all(len(h.wait()[0].token_ids) for h in others) and len(greedy.wait()) == 3
    # Row 0 of a seeded batch draws as a request of one prompt with that seed; row 1 its own stream.
    batch = crowded.generate([PROMPTS[2], PROMPTS[2]], max_new_tokens=24, sampling=sampling)
    assert batch[0].token_ids == expected and batch[1].token_ids != expected


def test_rows_of_one_penalty_are_penalized_together_each_as_alone(tiny_target, draft_model, monkeypatch):
    """Requests sharing a repetition penalty, beside rows without one: penalized in one batch,
    greedy rows are HF's output and a seeded sampled row draws what it draws alone. A model
    draft proposes tokens the rows have not seen, which only the penalty along the path marks."""
    from flashspec_core.verify import rows

    batches: list[int] = []
    real = rows.penalize_rows
    monkeypatch.setattr(rows, "penalize_rows", lambda logits, *a: (batches.append(len(logits)), real(logits, *a))[1])
    greedy, sampled = (SamplingParams(repetition_penalty=2.0),
                       SamplingParams(temperature=1.0, repetition_penalty=2.0, seed=5))
    arm = FixedRouter(Arm("model", 4))
    alone = engine_over(tiny_target, arm, draft_model).generate(PROMPTS[3], max_new_tokens=20,
                                                                sampling=sampled).token_ids
    engine = engine_over(tiny_target, arm, draft_model)
    hold_prefills_until(monkeypatch, engine, lambda: engine.running + engine.queued == 2 * len(PROMPTS) + 1)
    plain = []  # rows without a penalty between them: the penalized rows are not the batch's first
    handles = []
    for p in PROMPTS:
        plain.append(engine.submit([p], max_new_tokens=20))
        handles.append(engine.submit([p], max_new_tokens=20, sampling=greedy))
    handles.append(engine.submit([PROMPTS[3]], max_new_tokens=20, sampling=sampled))
    results = [h.wait()[0].token_ids for h in handles]
    assert results[:-1] == [hf(tiny_target, p, 20, 2.0) for p in PROMPTS]
    assert results[-1] == alone
    assert [h.wait()[0].token_ids for h in plain] == [hf(tiny_target, p, 20) for p in PROMPTS]
    assert max(batches) >= 4, "the rows were penalized together"


def test_a_batch_wider_than_max_batch_runs_in_turns_and_reuses_slots(tiny_target):
    engine = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 4)), max_batch=2)
    prompts = PROMPTS * 2
    results = engine.generate(prompts, max_new_tokens=10)
    assert [r.token_ids for r in results] == [hf(tiny_target, p, 10) for p in prompts]
    assert engine.running == 0 and len(engine._scheduler._slots) == 2


def test_concurrent_threads_and_coroutines_share_the_engine(tiny_target):
    engine = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 2)))
    expected = [hf(tiny_target, p, 16) for p in PROMPTS]
    out: dict[int, list[int]] = {}

    def run(i: int) -> None:
        out[i] = engine.generate(PROMPTS[i], max_new_tokens=16).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(PROMPTS))] == expected

    async def main():
        async def streamed(p):
            return [t async for c in engine.astream(p, max_new_tokens=16) for t in c.token_ids]
        return await asyncio.gather(*(engine.agenerate(p, max_new_tokens=16) for p in PROMPTS),
                                    *(streamed(p) for p in PROMPTS))

    results = asyncio.run(main())
    assert [r.token_ids for r in results[:len(PROMPTS)]] == expected and results[len(PROMPTS):] == expected


def test_cancelling_a_request_ends_its_rows_at_the_next_step_and_the_rest_go_on(tiny_target):
    engine = engine_over(tiny_target, FixedRouter(Arm(NO_DRAFT, 0)))
    long = engine.submit([PROMPTS[2]], max_new_tokens=200, stream=True)  # no EOS in its first 200 tokens
    other = engine.submit([PROMPTS[1]], max_new_tokens=40)
    next(iter(long))
    gate = Gate(engine)  # the cancel lands while the scheduler is inside a step, however slow this thread
    assert gate.entered.wait(10)
    long.cancel()
    gate.open.set()
    with pytest.raises(RequestCancelled):
        long.wait()
    assert other.wait()[0].token_ids == hf(tiny_target, PROMPTS[1], 40)
    stream = engine.stream(PROMPTS[3], max_new_tokens=200)  # closing a stream early cancels its request
    next(stream)
    stream.close()
    deadline = time.monotonic() + 5
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running == 0


def test_a_timeout_ends_the_request_with_timeout_error_even_inside_a_long_prefill(tiny_target, monkeypatch):
    engine = engine_over(tiny_target, FixedRouter(Arm(NO_DRAFT, 0)), prefill_chunk=4)
    real = engine._stepper.prefill

    def slow(rows, slots, chunk=None):
        time.sleep(0.05)
        return real(rows, slots, chunk)

    monkeypatch.setattr(engine._stepper, "prefill", slow)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout"):
        engine.generate(list(range(15)) * 8, max_new_tokens=20, timeout=0.1)  # a 120-token prompt: 30 pieces
    assert time.monotonic() - started < 1.0
    assert engine.generate(PROMPTS[1], max_new_tokens=8).token_ids == hf(tiny_target, PROMPTS[1], 8)


def test_without_graphs_the_earliest_requests_are_fed_first_within_the_turns_budget(tiny_target, monkeypatch):
    """On a CPU a turn feeds prefill_chunk prompt tokens in all, earliest request first: two long
    prompts of two requests are fed one after the other, the prompts of one batch call side by
    side, short prompts of several requests within the budget; outputs stay HF's."""
    engine = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 3)), prefill_chunk=8)
    fed: list[list[tuple[int, int]]] = []  # per turn's pieces: (request, tokens its row had left)
    real = Pieces.of.__func__  # the pieces of a turn, fed alone (prefill) or beside a step alike

    def spy(cls, rows, slots, chunk):
        fed.append([(id(row.request), len(row.prompt) - row.prefilled) for row in rows])
        return real(cls, rows, slots, chunk)

    monkeypatch.setattr(Pieces, "of", classmethod(spy))
    long = [PROMPTS[4] + PROMPTS[0], PROMPTS[0] + PROMPTS[4]]  # 27 tokens each: four pieces of 8
    handles = [engine.submit([p], max_new_tokens=6) for p in long]
    assert [h.wait()[0].token_ids for h in handles] == [hf(tiny_target, p, 6) for p in long]
    order = [request for call in fed for request, _ in call]
    assert all(len(call) == 1 for call in fed) and len(order) == 8
    assert order == sorted(order, key=order.index) and len(set(order)) == 2, "one request fed after the other"
    fed.clear()
    batch = [p[::-1] for p in long]  # no cached prefix to reuse
    results = engine.generate(batch, max_new_tokens=6)  # one batch call: its prompts side by side
    assert [r.token_ids for r in results] == [hf(tiny_target, p, 6) for p in batch]
    assert len(fed[0]) == 2 and len(fed) <= 4, "each turn feeds a piece of both"
    fed.clear()
    short = [PROMPTS[1], PROMPTS[3], PROMPTS[1][::-1], PROMPTS[3][::-1]]  # 2 and 5 tokens
    handles = [engine.submit([p], max_new_tokens=4) for p in short]
    assert [h.wait()[0].token_ids for h in handles] == [hf(tiny_target, p, 4) for p in short]
    assert all(sum(left for _, left in call) <= 8 or len(call) == 1 for call in fed)


def test_a_prompt_copies_the_prefix_another_row_holds_or_waits_a_turn_for_it(tiny_target, monkeypatch):
    """Prompts that share a long prefix (an agent's next step, questions over one document): sent
    together, the first is fed and the others wait, then copy it from its cache row; sent while
    the first decodes, they copy it at once. Only what differs is fed; outputs stay HF's."""
    system = (PROMPTS[4] + PROMPTS[0] + PROMPTS[2])[:32]
    prompts = [system + [7, 7, 2], system + [9, 4], system + [1, 2, 3, 4]]
    expected = [hf(tiny_target, p, 6) for p in prompts]
    engine = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 3)))
    fed: list[int] = []  # prompt tokens each turn feeds
    real = Pieces.of.__func__

    def spy(cls, rows, slots, chunk):
        pieces = real(cls, rows, slots, chunk)
        fed.append(pieces.tokens)
        return pieces

    monkeypatch.setattr(Pieces, "of", classmethod(spy))
    results = engine.generate(prompts, max_new_tokens=6)
    assert [r.token_ids for r in results] == expected
    assert [r.stats.cached_prompt_tokens for r in results] == [0, len(system), len(system)]
    assert fed == [len(prompts[0]), 2 + 4], "the first prompt alone, then only the others' own tokens"
    engine.runner.reset(len(engine.runner.held))  # nothing cached: the next prompts share only among themselves
    fed.clear()
    first = engine.submit([prompts[0]], max_new_tokens=40, stream=True)
    next(iter(first))  # decoding: its prompt is in its row
    later = engine.generate(prompts[1:], max_new_tokens=6)
    assert [r.token_ids for r in later] == expected[1:]
    assert [r.stats.cached_prompt_tokens for r in later] == [len(system)] * 2
    assert first.wait()[0].token_ids[:6] == expected[0]


def test_a_prefix_is_copied_from_a_cache_grown_inside_a_forward(tiny_target):
    """Prompts past the cache's first size: it grows inside a forward (as inference tensors), and
    the copy into another row still works and is exact."""
    gen = random.Random(5)
    system = [gen.randrange(1, 16) for _ in range(180)]
    prompts = [system + [7, 7, 2], system + [9, 4]]
    engine = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 3)))
    engine.runner.static.resize(64)  # smaller than the prompts: the first feed grows it
    results = engine.generate(prompts, max_new_tokens=4)
    assert [r.token_ids for r in results] == [hf(tiny_target, p, 4) for p in prompts]
    assert [r.stats.cached_prompt_tokens for r in results] == [0, len(system)]


def test_without_graphs_a_prompt_is_fed_beside_the_running_steps_in_small_pieces(tiny_target, monkeypatch):
    """While rows decode on a CPU, a newcomer's prompt goes through the steps' own forwards (no
    prefill forward of its own between two steps) in pieces of prefill_chunk; both outputs stay
    HF's."""
    engine = engine_over(tiny_target, FixedRouter(Arm(NO_DRAFT, 0)), prefill_chunk=16)
    beside: list[tuple[object, int | None]] = []  # (handle, chunk) of each row fed beside a step
    alone: list[object] = []  # handles of rows fed by a forward of their own
    real_of, real_prefill = Pieces.of.__func__, engine._stepper.prefill

    def spy_of(cls, rows, slots, chunk):
        beside.extend((row.request.handle, chunk) for row in rows)
        return real_of(cls, rows, slots, chunk)

    def spy_prefill(rows, slots, chunk=None):
        alone.extend(row.request.handle for row in rows)
        beside[len(beside) - len(rows):] = []  # prefill builds its pieces with Pieces.of too
        return real_prefill(rows, slots, chunk)

    monkeypatch.setattr(Pieces, "of", classmethod(spy_of))
    monkeypatch.setattr(engine._stepper, "prefill", spy_prefill)
    running = engine.submit([PROMPTS[2]], max_new_tokens=200, stream=True)  # no EOS within 200
    chunks = iter(running)  # one iterator: a dropped one would take the chunks it had read with it
    first = next(chunks)  # prefilled alone (nothing decoded yet), then stepping
    gate = Gate(engine)  # the newcomer arrives while the stream is a step or two in, however slow this thread
    assert gate.entered.wait(10)
    long = (PROMPTS[4] + PROMPTS[0]) * 5  # 135 tokens
    late = engine.submit([long], max_new_tokens=5)
    gate.open.set()
    assert late.wait()[0].token_ids == hf(tiny_target, long, 5)
    assert not running.done, "the stream should still be decoding"
    running.cancel()
    assert late not in alone, "the newcomer's prompt was fed by a forward of its own"
    mine = [chunk for handle, chunk in beside if handle is late]
    assert set(mine) == {16} and len(mine) >= len(long) // 16
    got = list(first.token_ids)
    with pytest.raises(RequestCancelled):
        for chunk in chunks:  # what it emitted before the cancel, then the cancel
            got += chunk.token_ids
    assert len(got) > len(long) // 16 and got == hf(tiny_target, PROMPTS[2], 200)[:len(got)]


def test_a_full_queue_refuses_at_once_and_a_closed_engine_refuses_everything(tiny_target):
    engine = engine_over(tiny_target, FixedRouter(Arm(NO_DRAFT, 0)), max_batch=1, max_queue=2)
    running = engine.submit([PROMPTS[2]], max_new_tokens=200, stream=True)  # no EOS within 200
    next(iter(running))  # admitted and decoding
    gate = Gate(engine)  # its slot stays taken while the queue fills, however slow this thread
    assert gate.entered.wait(10)
    waiting = [engine.submit([p], max_new_tokens=4) for p in PROMPTS[1:3]]
    with pytest.raises(EngineBusy, match="max_queue"):
        engine.submit([PROMPTS[3]], max_new_tokens=4)
    gate.open.set()
    engine.close()
    for handle in [running, *waiting]:
        with pytest.raises(EngineClosed):
            handle.wait(timeout=5)
    with pytest.raises(EngineClosed, match="closed"):
        engine.generate(PROMPTS[0], max_new_tokens=4)


@pytest.mark.parametrize("kwargs, name", [(dict(timeout=0), "timeout"), (dict(timeout="1"), "timeout"),
                                          (dict(max_batch=0), "max_batch"), (dict(prefill_chunk=0), "prefill_chunk")])
def test_bad_settings_are_refused_naming_them(tiny_target, kwargs, name):
    with pytest.raises(ValueError, match=name):
        if "timeout" in kwargs:
            engine_over(tiny_target, FixedRouter(Arm(NO_DRAFT, 0))).generate(PROMPTS[0], max_new_tokens=4, **kwargs)
        else:
            engine_over(tiny_target, FixedRouter(Arm(NO_DRAFT, 0)), **kwargs)


def test_a_failing_row_ends_its_own_request_only(tiny_target):
    class Poisoned(PromptLookupDraft):
        """Proposes an id outside the vocabulary for one prompt only (a broken draft)."""

        def propose(self, contexts, gamma, sampling, generator=None):
            proposal = super().propose(contexts, gamma, sampling, generator)
            proposal.tokens = [[99] * gamma if c[:2] == [2, 7] else t for c, t in zip(contexts, proposal.tokens)]
            return proposal

    engine = SpecEngine(tiny_target, [Poisoned(name="poisoned")], router=FixedRouter(Arm("poisoned", 2)),
                        verify_backend="torch")
    handles = [engine.submit([p], max_new_tokens=12) for p in PROMPTS]
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        handles[1].wait()
    for i in (0, 2, 3, 4):
        assert handles[i].wait()[0].token_ids == hf(tiny_target, PROMPTS[i], 12)


def test_many_requests_of_random_settings_each_equal_their_solo_run(tiny_target):
    """Property-style: random budgets, stop strings and penalties, submitted in random order while
    others run; greedy, each equals the same request run alone on a fresh engine."""
    rng = random.Random(0)
    requests = [(rng.choice(PROMPTS), rng.randint(3, 20), rng.choice([1.0, 1.2]),
                 rng.choice([None, ["t5"], ["t3 t"]])) for _ in range(12)]
    solo = []
    for prompt, n, penalty, stop in requests:
        fresh = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 3)))
        solo.append(fresh.generate(prompt, max_new_tokens=n, sampling=SamplingParams(repetition_penalty=penalty),
                                   stop=stop).text)
    engine = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 3)), max_batch=4)
    handles = []
    for prompt, n, penalty, stop in requests:
        handles.append(engine.submit([prompt], max_new_tokens=n, sampling=SamplingParams(repetition_penalty=penalty),
                                     stop=stop))
        time.sleep(rng.random() * 0.01)
    assert [h.wait()[0].text for h in handles] == solo


# ---------------------------------------------------------------------------------- the queue

class Gate:
    """Holds the scheduler's thread inside its next step until opened: a slot stays taken."""

    def __init__(self, engine):
        self.entered, self.open = threading.Event(), threading.Event()
        real = engine._stepper.step

        def step(rows, slots, *feeding):
            self.entered.set()
            assert self.open.wait(30), "the gate was never opened"
            return real(rows, slots, *feeding)

        engine._stepper.step = step


@pytest.mark.timeout(60)
def test_a_queued_request_cancelled_ends_at_once_and_frees_its_place(tiny_target):
    """Cancelled while the only slot is busy and the loop is inside a step: it ends now, not when a
    slot frees, and a new request takes its place in the queue."""
    engine = engine_over(tiny_target, FixedRouter(Arm(NO_DRAFT, 0)), max_batch=1, max_queue=1)
    gate = Gate(engine)
    running = engine.submit([PROMPTS[0]], max_new_tokens=8)
    assert gate.entered.wait(10)
    queued = engine.submit([PROMPTS[1]], max_new_tokens=8)
    with pytest.raises(EngineBusy):
        engine.submit([PROMPTS[2]], max_new_tokens=8)
    queued.cancel()
    with pytest.raises(RequestCancelled):
        queued.wait(timeout=2)
    later = engine.submit([PROMPTS[2]], max_new_tokens=8)  # the cancelled request's place
    gate.open.set()
    assert running.wait(timeout=20)[0].token_ids == hf(tiny_target, PROMPTS[0], 8)
    assert later.wait(timeout=20)[0].token_ids == hf(tiny_target, PROMPTS[2], 8)


@pytest.mark.timeout(60)
def test_a_queued_request_past_its_deadline_ends_without_a_slot_and_frees_its_place(tiny_target):
    engine = engine_over(tiny_target, FixedRouter(Arm(NO_DRAFT, 0)), max_batch=1, max_queue=1)
    real = engine._stepper.step

    def slow(rows, slots, *feeding):
        time.sleep(0.02)
        return real(rows, slots, *feeding)

    engine._stepper.step = slow
    # 150 steps of 20 ms (no EOS on the way): the only slot stays taken for 3 s
    running = engine.submit([PROMPTS[2]], max_new_tokens=150, stream=True)
    next(iter(running))  # admitted and decoding
    deadline = time.monotonic() + 0.2
    queued = engine.submit([PROMPTS[1]], max_new_tokens=8, timeout=0.2)
    with pytest.raises(TimeoutError, match="ran past its timeout"):
        queued.wait(timeout=1.5)
    assert time.monotonic() < deadline + 1.0
    later = engine.submit([PROMPTS[3]], max_new_tokens=8)  # the expired request's place
    assert not running.done
    running.cancel()
    assert later.wait(timeout=20)[0].token_ids == hf(tiny_target, PROMPTS[3], 8)


@pytest.mark.timeout(60)
def test_expired_entries_hold_no_place_in_a_full_queue(tiny_target):
    engine = engine_over(tiny_target, FixedRouter(Arm(NO_DRAFT, 0)), max_batch=1, max_queue=2)
    gate = Gate(engine)
    running = engine.submit([PROMPTS[0]], max_new_tokens=8)
    assert gate.entered.wait(10)
    dead = [engine.submit([p], max_new_tokens=8, timeout=0.05) for p in PROMPTS[1:3]]  # the loop is held: nobody purges
    time.sleep(0.1)
    alive = [engine.submit([p], max_new_tokens=8) for p in PROMPTS[3:5]]  # the dead entries gave their places
    gate.open.set()
    for handle in dead:
        with pytest.raises(TimeoutError, match="ran past its timeout"):
            handle.wait(timeout=20)
    assert [h.wait(timeout=20)[0].token_ids for h in [running, *alive]] == [hf(tiny_target, p, 8) for p in
                                                                          (PROMPTS[0], *PROMPTS[3:5])]


# ---------------------------------------------------------------------------------- slots

@pytest.mark.timeout(60)
def test_slots_shrink_when_the_batch_drains_so_a_lone_request_after_a_burst_steps_alone(tiny_target):
    engine = engine_over(tiny_target, FixedRouter(Arm("prompt_lookup", 2)), max_batch=8)
    burst = [engine.submit([p[::-1] + [i]], max_new_tokens=10) for i, p in enumerate(PROMPTS * 2)]
    assert all(h.wait(timeout=20) for h in burst)
    assert len(engine._scheduler._slots) == 8, "the burst grew the batch"
    sizes: list[int] = []
    real = engine._stepper.step
    engine._stepper.step = lambda rows, slots, *feeding: (sizes.append(slots), real(rows, slots, *feeding))[1]
    assert engine.generate(PROMPTS[3], max_new_tokens=10).token_ids == hf(tiny_target, PROMPTS[3], 10)
    assert sizes and set(sizes) == {1}, "a lone request after the burst steps a batch of one"
    assert len(engine._scheduler._slots) == 1


def test_each_request_reports_how_many_rows_its_steps_decoded_together(tiny_target):
    """`GenerationStats.mean_rows`: a lone request decodes alone; two of one call decode every step
    side by side (neither hits EOS within the budget)."""
    engine = SpecEngine(tiny_target, [], router=FixedRouter(Arm(NO_DRAFT, 0)), calibrate=False, max_batch=4)
    alone = engine.generate(PROMPTS[2], max_new_tokens=12)
    assert alone.stats.steps > 0 and alone.stats.mean_rows == 1.0
    first, second = engine.generate([PROMPTS[2], PROMPTS[3]], max_new_tokens=12)
    assert first.stats.step_rows == 2 * first.stats.steps > 0
    assert first.stats.mean_rows == second.stats.mean_rows == 2.0
