"""The CUDA-graph target on a GPU: replays compute what transformers computes, greedy steps verify
as `verify_torch` does, the cache grows, and concurrent callers of one engine stay exact.

Tiny random models in fp32, so every comparison is tight; the default model's greedy equality
with HF `generate` on CUDA is in test_gpu_default.py.
"""
from __future__ import annotations

import gc
import random
import threading
import time

import pytest
import torch
from helpers import RandomRouter, tiny_llama, tiny_loaded

from flashspec_core.arms import Arm
from flashspec_core.backends.cuda_graph import GraphedModel
from flashspec_core.drafts import ModelDraft, PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.models import LoadedModel
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing.fixed import FixedRouter
from flashspec_core.verify import verify_torch

pytestmark = pytest.mark.gpu
VOCAB = 32


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=3, layers=2, max_positions=1024).cuda()


@torch.no_grad()
def _fresh(model, seq, keep):
    return model(input_ids=torch.tensor([seq], device="cuda")).logits[0, -keep:]


def _random_walk(runner, model, rows: int, steps: int, seed: int, grow_to: int = 0):
    rng = random.Random(seed)
    runner.reset(rows)
    seqs = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(rows)]
    for step in range(steps):
        keep = rng.choice([1, 3, 5, 9])
        grow = 40 if grow_to and len(seqs[0]) < grow_to else 4
        seqs = [s[:max(1, len(s) - rng.randint(0, 3))] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, grow))]
                for s in seqs]
        seqs = [s + [1] * max(0, keep - len(s)) for s in seqs]
        if step % 2 and all(len(s) > keep for s in seqs):  # the decode shape: every row feeds `keep` tokens
            runner.forward_to([s[:-keep] for s in seqs], keep_logits=1)
        active = [rows == 1 or rng.random() < 0.8 for _ in range(rows)]
        active[0] = True
        out = runner.forward_to(seqs, active, keep_logits=keep)
        for b, s in enumerate(seqs):
            if active[b]:
                torch.testing.assert_close(out[b], _fresh(model, s, keep), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3])
def test_graph_replays_match_a_fresh_forward(model, rows):
    runner = GraphedModel(model, pad_token_id=0)
    _random_walk(runner, model, rows, steps=30, seed=rows)
    assert runner.captures > 0, "no step replayed a graph"


def test_the_cache_grows_and_graphs_are_captured_again(model):
    runner = GraphedModel(model, pad_token_id=0, max_len=64)
    _random_walk(runner, model, 1, steps=20, seed=7, grow_to=300)
    assert runner.static.max_len >= 300 + 32


def test_graphs_are_captured_again_after_growth_once_the_old_ones_are_collected(model):
    """Growth drops every graph; once the collector has released them, their memory pool cannot
    take a new capture (the allocator asserts), so the next graphs need a pool of their own."""
    runner = GraphedModel(model, pad_token_id=0, max_len=64)
    runner.warm([1, 3])
    rng = random.Random(5)
    seq = [rng.randrange(VOCAB) for _ in range(20)]
    runner.forward_to([seq], keep_logits=1)
    for _ in range(3):  # each round doubles the cache, drops every graph and captures anew
        seq = seq + [rng.randrange(VOCAB) for _ in range(runner.static.max_len)]
        runner.forward_to([seq[:-3]], keep_logits=1)  # eager; grows the cache
        gc.collect()
        out = runner.forward_to([seq], keep_logits=3)  # a width-3 replay, captured after the growth
        torch.testing.assert_close(out[0], _fresh(model, seq, 3), atol=1e-4, rtol=1e-4)
    assert runner.static.max_len >= len(seq) + 32


@pytest.mark.parametrize("rows", [1, 3])
def test_chunks_wider_than_every_decode_width_replay_the_prefill_graph_piece_by_piece(model, rows):
    """After warm(), a chunk wider than the decode widths is fed prefill_width tokens a replay,
    the last piece padded: its logits are a fresh forward's for one piece, several, an exact
    multiple, after prefix reuse and across cache growth. Where the last piece is shorter than
    the logits asked for, the chunk runs eagerly, as exactly."""
    runner = GraphedModel(model, pad_token_id=0, max_len=128)
    runner.warm([1, 3], prefill_width=8)
    assert runner.prefill_width == 8 and runner.captures == 5  # greedy and sampled 1 and 3, prefill 8
    replays = []
    replay = runner._replay
    runner._replay = lambda chunks, width, *a, **k: replays.append(width) or replay(chunks, width, *a, **k)
    rng = random.Random(rows)
    runner.reset(rows)
    seqs = [[rng.randrange(VOCAB) for _ in range(2)] for _ in range(rows)]
    runner.forward_to(seqs)
    # (tokens each row feeds, logits kept, replays of width 8): one piece, three with a remainder,
    # an exact multiple, a decode width, eager (a last piece of 1 < 2 kept), growth past 128 slots
    for c, keep, pieces in ((6, 1, 1), (20, 3, 3), (16, 2, 2), (3, 3, 0), (17, 2, 0), (201, 1, 26)):
        # The last token rolled back and replaced by another: every row feeds exactly c tokens.
        seqs = [s[:-1] + [(s[-1] + 1) % VOCAB] + [rng.randrange(VOCAB) for _ in range(c - 1)] for s in seqs]
        del replays[:]
        out = runner.forward_to(seqs, keep_logits=keep)
        assert replays.count(8) == pieces
        for b in range(rows):
            torch.testing.assert_close(out[b], _fresh(model, seqs[b], keep), atol=1e-4, rtol=1e-4)
        assert [len(h) for h in runner.held] == [len(s) for s in seqs]
    assert runner.static.max_len >= len(seqs[0]) + 32


def test_a_few_rows_prefill_alone_by_index_and_leave_the_others_as_they_were(model):
    """Among 8 rows, one or two feeding a prompt replay the one-row indexed graph on their own
    cache rows (not the 8-row prefill graph): their logits are a fresh forward's, and every other
    row's cache still gives its own exact logits afterwards; three or more rows take the 8-row
    graph."""
    runner = GraphedModel(model, pad_token_id=0, max_len=256)
    runner.resize(8)
    runner.warm([1, 3], prefill_width=8)
    assert (0, 8, None) in runner._graphs
    rng = random.Random(9)
    seqs = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(8)]
    runner.forward_to(seqs)
    for fed, expect_indexed in (([5], True), ([0, 7], True), ([1, 2, 6], False)):
        replays = []
        graph = runner._graphs[(0, 8, None)]
        graph_replay = graph.replay
        graph.replay = lambda *a, **k: replays.append(k.get("slots")) or graph_replay(*a, **k)
        for b in fed:  # a new prompt past a reused prefix, several pieces long
            seqs[b] = seqs[b][:2] + [rng.randrange(VOCAB) for _ in range(rng.randint(9, 30))]
        out = runner.forward_to([s if b in fed else [] for b, s in enumerate(seqs)], [b in fed for b in range(8)])
        graph.replay = graph_replay
        assert bool(replays) == expect_indexed and all(r[0] in fed for r in replays)
        for b in fed:
            torch.testing.assert_close(out[b], _fresh(model, seqs[b], 1), atol=1e-4, rtol=1e-4)
        for b in range(8):  # every row, fed or not, decodes on from an intact cache
            seqs[b] = seqs[b] + [rng.randrange(VOCAB)]
        out = runner.forward_to(seqs)
        for b in range(8):
            torch.testing.assert_close(out[b], _fresh(model, seqs[b], 1), atol=1e-4, rtol=1e-4)


def test_batches_of_changing_size_reuse_their_graphs(model):
    """A server's batches change size from call to call: the cache keeps its largest row count, so
    a row count seen before replays the graphs it captured then, and results stay exact."""
    runner = GraphedModel(model, pad_token_id=0)
    runner.warm([1, 3])
    for rows, seed in ((3, 11), (1, 12), (2, 13)):
        _random_walk(runner, model, rows, steps=6, seed=seed)
    captured = runner.captures
    for rows, seed in ((1, 12), (3, 11), (2, 13), (1, 12)):  # the same shapes again, in another order
        _random_walk(runner, model, rows, steps=6, seed=seed)
    assert runner.captures == captured and runner.static.rows == 3


def test_greedy_step_in_the_graph_verifies_as_the_reference(model):
    runner = GraphedModel(model, pad_token_id=0)
    rng = random.Random(0)
    for _ in range(20):
        ctx = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 30))]
        # Drafts that agree with the target for a random prefix, then not.
        target = _fresh(model, ctx, 1).argmax(-1).tolist()
        draft = ([target[0] if rng.random() < 0.5 else (target[0] + 1) % VOCAB]
                 + [rng.randrange(VOCAB) for _ in range(3)])
        runner.reset(1)
        runner.forward_to([ctx[:-1]])  # the prefill: the step then feeds the last token + draft
        fused = runner.verify_step([ctx], [draft], [True], SamplingParams())
        logits = _fresh(model, ctx + draft, len(draft) + 1)[None]
        n_ref, out_ref = verify_torch(logits, torch.tensor([draft], device="cuda"), None, SamplingParams())
        assert fused is not None
        assert fused[0] == n_ref.tolist() and fused[1] == out_ref.tolist()


def test_padded_steps_verify_as_the_reference_and_capture_nothing_new(model):
    """After warm(), a draft of any length 0-8 replays one of the warmed graphs (padded): same
    accepted count and tokens as verify_torch on the unpadded path, and no capture mid-request."""
    runner = GraphedModel(model, pad_token_id=0)
    runner.warm([1, 3, 5, 9])
    captured, warmup = runner.captures, runner.warmup_seconds
    assert captured == 9 and warmup > 0  # greedy and sampled per width, and the prefill graph
    rng = random.Random(4)
    for _ in range(40):
        ctx = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 60))]
        k = rng.randint(0, 8)
        greedy = _fresh(model, ctx, 1).argmax(-1).tolist()
        draft = ([greedy[0]] if rng.random() < 0.6 else []) + [rng.randrange(VOCAB) for _ in range(k)]
        draft = draft[:k]
        runner.reset(1)
        runner.forward_to([ctx[:-1]])
        fused = runner.verify_step([ctx], [draft], [True], SamplingParams())
        logits = _fresh(model, ctx + draft, len(draft) + 1)[None]
        n_ref, out_ref = verify_torch(logits, torch.tensor([draft], device="cuda").view(1, k), None, SamplingParams())
        assert fused is not None
        assert fused[0] == n_ref.tolist()
        assert fused[1][0][: n_ref.item() + 1] == out_ref[0, : n_ref.item() + 1].tolist()
        assert runner.held[0] == ctx + draft, "the cache must hold the real tokens only"
    assert runner.captures == captured and runner.warmup_seconds == warmup


def test_one_replay_verifies_rows_of_different_draft_lengths_and_scores_the_rest(model):
    """score_step: rows with drafts of lengths 0-8 side by side (padded to one warmed width) get
    what verify_torch gives each alone; rows verified elsewhere get the logits of a fresh
    forward; an idle row is left as it was; no capture."""
    runner = GraphedModel(model, pad_token_id=0)
    runner.resize(4)
    runner.warm([1, 3, 5, 9])
    captured = runner.captures
    rng = random.Random(5)
    for _ in range(12):
        ctxs = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 50))] for _ in range(4)]
        runner.reset(4)
        runner.forward_to([c[:-1] for c in ctxs])  # the prefill: a step feeds the last token + draft
        drafts, sequences, needs = [], [], []
        for c in ctxs:
            greedy = _fresh(model, c, 1).argmax(-1).tolist()
            k = rng.randint(0, 8)
            drafts.append(([greedy[0]] if rng.random() < 0.6 else []) + [rng.randrange(VOCAB) for _ in range(k)])
            drafts[-1] = drafts[-1][:k]
            sequences.append(c + drafts[-1])
            needs.append(k + 1)
        in_graph = [True, False, True, True]  # row 1: scored only, as a row with a processor is
        active = [True, True, True, rng.random() < 0.5]
        held3 = list(runner.held[3])
        verified, logits = runner.score_step(sequences, needs, [d if g else None for d, g in zip(drafts, in_graph)],
                                             active)
        for b in range(4):
            fresh = _fresh(model, sequences[b], needs[b])
            if not active[b]:
                assert verified[b] is None and logits[b] is None and runner.held[b] == held3
            elif in_graph[b]:
                n_ref, out_ref = verify_torch(fresh[None], torch.tensor([drafts[b]], device="cuda").view(1, -1),
                                              None, SamplingParams())
                n = n_ref.item()
                assert logits[b] is None and verified[b][0] == n
                assert verified[b][1:n + 2] == out_ref[0, :n + 1].tolist()
            else:
                assert verified[b] is None
                torch.testing.assert_close(logits[b], fresh, atol=1e-4, rtol=1e-4)
            if active[b]:
                assert runner.held[b] == sequences[b]
    assert runner.captures == captured


def test_rows_of_other_arms_and_settings_step_in_one_replay_and_stay_exact():
    """Rows joining mid-flight with their own budgets, penalties and arms (the router picks each
    row's arm at random every step) run their steps as one replay of a warmed graph, and each row
    is HF `generate`'s output for its prompt and settings."""
    loaded = tiny_loaded(VOCAB, seed=0, max_positions=1024)
    target = LoadedModel(loaded.model.cuda(), loaded.tokenizer, loaded.name)
    arms = [Arm("none", 0), Arm("prompt_lookup", 2), Arm("prompt_lookup", 4), Arm("model", 2)]
    drafts = [PromptLookupDraft(), ModelDraft(tiny_llama(VOCAB, seed=1, max_positions=1024).cuda(), name="model")]
    engine = SpecEngine(target, drafts, router=RandomRouter(arms, seed=4), backend="cuda-graph", gammas=(2, 4),
                        max_batch=8)
    captured = engine.runner.captures
    calls = []
    real = engine.runner.score_step
    engine.runner.score_step = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    rng = random.Random(6)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    settings = [(30, 1.0), (12, 1.0), (20, 1.3), (25, 1.0), (18, 1.1), (22, 1.0)]
    handles = []
    for prompt, (n, penalty) in zip(prompts, settings):
        handles.append(engine.submit([prompt], max_new_tokens=n, sampling=SamplingParams(repetition_penalty=penalty)))
        time.sleep(0.005)
    for h, prompt, (n, penalty) in zip(handles, prompts, settings):
        ids = torch.tensor([prompt], device="cuda")
        ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                    repetition_penalty=penalty, pad_token_id=VOCAB - 1)[0, len(prompt):].tolist()
        got = h.wait()[0].token_ids
        assert got == ref[:len(got)] and (len(got) == len(ref) or got[-1] == VOCAB - 1)
    assert calls, "steps of rows with other arms and settings ran as one replay"
    assert engine.runner.captures == captured


def test_greedy_rows_cut_by_the_token_budget_equal_hf_generate():
    """Rows stepping together where wide replays cost 4x: the budget cuts their proposals, and each
    row is still HF `generate`'s output (fp32)."""
    loaded = tiny_loaded(VOCAB, seed=0, max_positions=1024)
    target = LoadedModel(loaded.model.cuda(), loaded.tokenizer, loaded.name)
    engine = SpecEngine(target, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 8)),
                        backend="cuda-graph", gammas=(2, 8), max_batch=4)
    engine.runner.step_seconds = lambda: {1: 1.0, 3: 1.0, 9: 4.0}
    rng = random.Random(9)
    prompts = [[rng.randrange(4) for _ in range(rng.randint(8, 30))] for _ in range(4)]  # repetitive: copies
    results = engine.generate(prompts, max_new_tokens=32)
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([prompt], device="cuda")
        ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                    pad_token_id=VOCAB - 1)[0, len(prompt):].tolist()
        got = result.token_ids
        assert got == ref[:len(got)] and (len(got) == len(ref) or got[-1] == VOCAB - 1)
    assert engine._stepper.budget.cuts > 0


@pytest.mark.parametrize("one_hot", [True, False])
def test_sampled_step_in_the_graph_is_the_eager_kernels_step(model, one_hot):
    """A sampled step replayed from a graph (Triton verify inside) returns what the eager path
    returns (a forward, then `verify` on the Triton kernel) for the same generator state, for
    copy drafts (one-hot) and model drafts (q), at several widths and two temperatures; without
    `warm`, each width and kind of q captures once, whatever the temperature."""
    from flashspec_core.verify import verify

    graphed = GraphedModel(model, pad_token_id=0)
    rng = random.Random(5)
    kinds = set()  # (width, one-hot) of the steps taken
    for step in range(24):
        sampling = SamplingParams(temperature=rng.choice([0.7, 1.0]))
        ctx = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 40))]
        k = rng.randint(0, 5)
        draft = [rng.randrange(VOCAB) for _ in range(k)]
        q = None if one_hot or not k else torch.rand((1, k, VOCAB), device="cuda").softmax(-1)
        kinds.add((k + 1, q is None))
        graphed.reset(1)
        graphed.forward_to([ctx[:-1]])
        got = graphed.verify_step([ctx], [draft], [True], sampling, q, torch.Generator("cuda").manual_seed(step))
        logits = _fresh(model, ctx + draft, k + 1)[None]
        n_ref, out_ref = verify(logits, torch.tensor([draft], dtype=torch.long, device="cuda").view(1, k), q, sampling,
                                backend="triton", generator=torch.Generator("cuda").manual_seed(step))
        assert got is not None and got[0] == n_ref.tolist()
        assert got[1][0][: n_ref.item() + 1] == out_ref[0, : n_ref.item() + 1].tolist()
        assert graphed.held[0] == ctx + draft
    assert sorted(key[1:] for key in graphed._graphs if key[2] is not None) == sorted(kinds)
    captured = graphed.captures  # the last step once more, at another temperature
    graphed.reset(1)
    graphed.forward_to([ctx[:-1]])
    other = SamplingParams(temperature=1.3)  # a temperature no step used
    assert graphed.verify_step([ctx], [draft], [True], other, q, torch.Generator("cuda")) is not None
    assert graphed.captures == captured, "a (width, kind of q) seen before replays its graph"
    top_k = SamplingParams(temperature=0.7, top_k=3)
    assert graphed.verify_step([[1, 2, 3, 4]], [[5]], [True], top_k, None, torch.Generator("cuda")) is None


def test_after_warm_sampled_steps_at_any_temperature_capture_nothing_and_equal_the_eager_path(model):
    """`warm` captures the sampled one-hot graph of each warmed width: sampled steps of a copy
    draft (and without a draft) at two temperatures and every warmed width replay those graphs (no
    capture, no warm-up seconds) and return what the eager path returns for the same seed (an fp32
    forward, then `verify` on the Triton kernel at the request's temperature)."""
    from flashspec_core.verify import verify

    runner = GraphedModel(model, pad_token_id=0)
    runner.warm([1, 3, 5])
    captured, warmup = runner.captures, runner.warmup_seconds
    assert captured == 3 + 3 + 1  # greedy and sampled one-hot per width, and the prefill graph
    rng = random.Random(8)
    for step in range(18):  # every (temperature, width) pair three times
        sampling = SamplingParams(temperature=(0.7, 1.08)[step % 2])  # 1.08: log2(e)/T rounds apart in fp32/fp64
        k = (0, 2, 4)[step % 3]
        ctx = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 40))]
        greedy = _fresh(model, ctx, 1).argmax(-1).tolist()  # a first token the target often keeps
        draft = (greedy + [rng.randrange(VOCAB) for _ in range(k)])[:k]
        runner.reset(1)
        runner.forward_to([ctx[:-1]])
        got = runner.verify_step([ctx], [draft], [True], sampling, None, torch.Generator("cuda").manual_seed(step))
        logits = _fresh(model, ctx + draft, k + 1)[None]
        n_ref, out_ref = verify(logits, torch.tensor([draft], dtype=torch.long, device="cuda").view(1, k), None,
                                sampling, backend="triton", generator=torch.Generator("cuda").manual_seed(step))
        assert got is not None and got[0] == n_ref.tolist()
        assert got[1][0][: n_ref.item() + 1] == out_ref[0, : n_ref.item() + 1].tolist()
        assert runner.held[0] == ctx + draft
    assert runner.captures == captured and runner.warmup_seconds == warmup


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8)])
def test_model_draft_syncs_with_the_host_once_per_call_whatever_gamma(sampling):
    """On graphs the draft feeds each drafted token back from the device (feed_tokens): drafting
    six tokens waits on the GPU as often as drafting two, and proposes what a CPU copy of the
    same draft proposes greedily."""
    import warnings

    draft = ModelDraft(tiny_llama(VOCAB, seed=1, max_positions=1024).cuda(), name="model")
    ctx = [(7 * i) % VOCAB for i in range(1, 30)]

    def syncs(gamma: int) -> tuple[int, list[int]]:
        draft._runner.reset(1)
        draft.propose([ctx[:-1]], 1, sampling, torch.Generator("cuda"))  # the catch-up, outside the count
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                tokens = draft.propose([ctx], gamma, sampling, torch.Generator("cuda").manual_seed(0)).tokens[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in seen), tokens

    (short, _), (long, drafted) = syncs(2), syncs(6)
    assert short == long, f"{long - short} more host syncs for 4 more drafted tokens"
    if sampling.greedy:
        cpu = ModelDraft(tiny_llama(VOCAB, seed=1, max_positions=1024), name="model")
        assert drafted == cpu.propose([ctx], 6, sampling).tokens[0]


def test_engine_warms_its_widths_at_construction():
    loaded = tiny_loaded(VOCAB, seed=0, max_positions=1024)
    target = LoadedModel(loaded.model.cuda(), loaded.tokenizer, loaded.name)
    engine = SpecEngine(target, [PromptLookupDraft()], router=FixedRouter(Arm("prompt_lookup", 4)),
                        backend="cuda-graph", gammas=(2, 4), max_batch=4)
    runner = engine.runner
    # widths 1, 3, 5 and the prefill graph, for each batch size the scheduler grows through (1, 2, 4),
    # the one-row indexed prefill graph, and at one row the sampled one-hot graphs of 1, 3, 5
    assert runner.widths == (1, 3, 5) and runner.prefill_width > 5 and runner.captures == 4 * 3 + 1 + 3
    for rows in (1, 2, 4):  # each decode graph's replay timed at its capture, for the token budget
        runner.resize(rows)
        assert set(runner.step_seconds()) == {1, 3, 5} and min(runner.step_seconds().values()) > 0
    runner.resize(1)
    res = engine.generate([1, 2, 3, 4, 5, 1, 2, 3] * 40, max_new_tokens=30)  # a prompt of two pieces
    assert all(r.warmup_seconds == 0 for r in res.stats.records) and runner.captures == 16
    batch = engine.generate([[1, 2, 3, 4, 5] * 3, [6, 7, 8] * 5, [9, 1] * 4], max_new_tokens=20)  # 3 rows: 4 slots
    assert all(r.warmup_seconds == 0 for b in batch for r in b.stats.records) and runner.captures == 16
    for temperature in (0.7, 1.08):  # sampled steps replay the warmed graphs, whatever the temperature
        res = engine.generate([1, 2, 3, 4, 5, 1, 2, 3] * 5, max_new_tokens=30,
                              sampling=SamplingParams(temperature=temperature, seed=3))
        assert all(r.warmup_seconds == 0 for r in res.stats.records) and runner.captures == 16


def _engine(target: LoadedModel, drafts, arm) -> SpecEngine:
    return SpecEngine(target, drafts, router=FixedRouter(arm), backend="cuda-graph", max_batch=8)


@pytest.mark.parametrize("arm", [Arm("none", 0), Arm("prompt_lookup", 4), Arm("model", 3)])
def test_engine_greedy_equals_hf_generate(arm):
    loaded = tiny_loaded(VOCAB, seed=0, max_positions=1024)
    target = LoadedModel(loaded.model.cuda(), loaded.tokenizer, loaded.name)
    drafts = [PromptLookupDraft(), ModelDraft(tiny_llama(VOCAB, seed=1, max_positions=1024).cuda(), name="model")]
    engine = _engine(target, drafts, arm)
    rng = random.Random(1)
    for _ in range(6):
        prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(5, 40))]
        got = engine.generate(prompt, max_new_tokens=40).token_ids
        ids = torch.tensor([prompt], device="cuda")
        ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                                    pad_token_id=VOCAB - 1)[0, len(prompt):].tolist()
        assert got == ref[:len(got)] and (len(got) == len(ref) or got[-1] == VOCAB - 1)


def test_concurrent_callers_get_what_sequential_calls_get():
    loaded = tiny_loaded(VOCAB, seed=0, max_positions=1024)
    target = LoadedModel(loaded.model.cuda(), loaded.tokenizer, loaded.name)
    engine = _engine(target, [PromptLookupDraft()], Arm("prompt_lookup", 4))
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(5, 30))] for _ in range(8)]
    sampling = SamplingParams(temperature=0.8, seed=5)
    expected = [engine.generate(p, max_new_tokens=24, sampling=sampling).token_ids for p in prompts]
    got: dict[int, list[int]] = {}

    def call(i: int) -> None:
        got[i] = engine.generate(prompts[i], max_new_tokens=24, sampling=sampling).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got[i] for i in range(len(prompts))] == expected
