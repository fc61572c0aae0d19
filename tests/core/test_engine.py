"""The decode loop on a tiny in-memory model: greedy equals HF generate, stopping, seeds, batches,
streams, and bad input.

The tiny tokenizer decodes token i as the word "t{i}" joined by spaces, so stop strings can start
and end in the middle of tokens and span several of them.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import greedy_ids, one_thread, tiny_llama, tiny_loaded

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.drafts import ModelDraft, PromptLookupDraft, SuffixCacheDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.options import RequestArgs, RequestOptions
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.routing import classify_prompt
from flashspec_core.routing.fixed import FixedRouter

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7], [8, 2, 8, 1, 8, 2, 8, 1, 8, 2], [6, 6, 6, 6, 1]]
ARMS = [Arm(NO_DRAFT, 0), Arm("prompt_lookup", 1), Arm("prompt_lookup", 4), Arm("suffix_cache", 3),
        Arm("model", 1), Arm("model", 4), Arm("model", 8)]


@torch.no_grad()
def hf_greedy(loaded, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`model.generate(do_sample=False)` on one unpadded prompt: the reference output."""
    ids = torch.tensor([prompt])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=loaded.tokenizer.pad_token_id)
    return out[0, len(prompt):].tolist()


def make_engine(loaded, arm: Arm, draft_model=None, primed: list[list[int]] = ()) -> SpecEngine:
    suffix = SuffixCacheDraft()
    for out in primed:
        suffix.add(out)
    drafts = [PromptLookupDraft(), suffix]
    if draft_model is not None:
        drafts.append(ModelDraft(draft_model, name="model", pad_token_id=loaded.tokenizer.pad_token_id))
    return SpecEngine(loaded, drafts, router=FixedRouter(arm), verify_backend="torch")


def _lengths_with_eos(refs: list[list[int]], eos: int) -> list[int]:
    return [ref.index(eos) + 1 if eos in ref else len(ref) for ref in refs]


@pytest.fixture(scope="module")
def refs(tiny_target):
    with one_thread():  # module fixtures set up before the per-test torch_one_thread
        return [hf_greedy(tiny_target, p, 24) for p in PROMPTS]


@pytest.fixture(scope="module")
def staggered(tiny_target):
    """A copy of the tiny target whose eos makes the batch's rows finish at different steps."""
    with one_thread():
        untruncated = [greedy_ids(tiny_target.model, p, 24) for p in PROMPTS]
    eos = max(range(16), key=lambda e: len(set(_lengths_with_eos(untruncated, e))))
    loaded = tiny_loaded(16, seed=0, eos_id=eos)
    torch.testing.assert_close(loaded.model.lm_head.weight, tiny_target.model.lm_head.weight)  # same weights
    return loaded


@pytest.mark.parametrize("arm", ARMS, ids=str)
def test_batched_greedy_rows_equal_hf_generate_with_per_row_finish(staggered, tiny_draft_model, arm):
    expected = [hf_greedy(staggered, p, 24) for p in PROMPTS]
    assert len({len(e) for e in expected}) >= 3, "rows should finish at different steps"
    primed = [e[:5] + [(t + 1) % 15 for t in e[5:9]] + e[9:] for e in expected]  # partly right
    engine = make_engine(staggered, arm, tiny_draft_model, primed)
    results = engine.generate(PROMPTS, max_new_tokens=24)
    assert [r.token_ids for r in results] == expected
    assert [r.finish_reason for r in results] == ["stop" if len(e) < 24 else "length" for e in expected]
    assert [engine.generate(p, max_new_tokens=24).token_ids for p in PROMPTS] == expected
    if arm.gamma:
        assert sum(r.stats.drafted for r in results) > 0, "the arm should have drafted"


def test_eos_ends_the_row_and_is_kept_in_the_ids_but_not_the_text(staggered):
    engine = make_engine(staggered, Arm("prompt_lookup", 3))
    eos = staggered.model.generation_config.eos_token_id
    row = next(p for p, e in zip(PROMPTS, [hf_greedy(staggered, p, 24) for p in PROMPTS]) if len(e) < 24)
    res = engine.generate(row, max_new_tokens=24)
    assert res.finish_reason == "stop" and res.token_ids[-1] == eos and eos not in res.token_ids[:-1]
    assert res.text == staggered.tokenizer.decode(res.token_ids[:-1]) and f"t{eos}" not in res.text.split()


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens_bounds_the_output(tiny_target, refs, n):
    prompt, ref = next((p, r) for p, r in zip(PROMPTS, refs) if 15 not in r[:7])
    res = make_engine(tiny_target, Arm("prompt_lookup", 8)).generate(prompt, max_new_tokens=n)
    assert res.token_ids == ref[:n] and res.finish_reason == "length"


def _stop_inside(text: str, ids: list[int], tokenizer) -> tuple[str, int, int]:
    """A stop string starting mid-token and spanning three tokens, at its first occurrence.

    Returns (stop, cut, n_tokens): the text is cut at `cut`; the ids end at the token completing it.
    """
    starts = [len(tokenizer.decode(ids[:k])) + 1 for k in range(1, len(ids) - 3)]  # char 1 of a word
    for start in starts[2:]:
        stop = text[start + 1: start + 9]  # e.g. "5 t12 t3": ends mid-token three tokens later
        if text.find(stop) == start + 1 and stop.count(" ") >= 2:
            done = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
            return stop, start + 1, done
    raise AssertionError("no usable stop string in the reference output")


@pytest.mark.parametrize("arm", [Arm(NO_DRAFT, 0), Arm("prompt_lookup", 8), Arm("suffix_cache", 8)], ids=str)
def test_stop_string_spanning_tokens_cuts_exactly_and_never_streams_a_part(tiny_target, refs, arm):
    tok = tiny_target.tokenizer
    prompt, ref = next((p, r) for p, r in zip(PROMPTS, refs) if 15 not in r[:20])
    full = tok.decode(ref[:20])
    stop, cut, n_tokens = _stop_inside(full, ref[:20], tok)
    engine = make_engine(tiny_target, arm, primed=[prompt[-2:] + ref])
    res = engine.generate(prompt, max_new_tokens=20, stop=["never there", stop])
    assert (res.text, res.finish_reason, res.token_ids) == (full[:cut], "stop", ref[:n_tokens])
    chunks = list(engine.stream(prompt, max_new_tokens=20, stop=stop))
    assert "".join(c.text for c in chunks) == full[:cut]
    assert [t for c in chunks for t in c.token_ids] == ref[:n_tokens]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stats is not None


def test_streaming_releases_held_back_text_when_the_stop_string_does_not_complete(tiny_target, refs):
    prompt, ref = next((p, r) for p, r in zip(PROMPTS, refs) if 15 not in r[:12])
    full = tiny_target.tokenizer.decode(ref[:12])
    stop = full[-3:] + "t99"  # the output ends with the start of the stop string, never the rest
    chunks = list(make_engine(tiny_target, Arm("prompt_lookup", 2)).stream(prompt, max_new_tokens=12, stop=stop))
    assert "".join(c.text for c in chunks) == full and chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("arm", [Arm(NO_DRAFT, 0), Arm("model", 3), Arm("prompt_lookup", 3)], ids=str)
def test_same_seed_same_output_and_different_seeds_differ(tiny_target, tiny_draft_model, arm):
    engine = make_engine(tiny_target, arm, tiny_draft_model)
    runs = {seed: [engine.generate(PROMPTS[0], max_new_tokens=30,
                                   sampling=SamplingParams(temperature=1.5, seed=seed)).token_ids
                   for _ in range(2)] for seed in (7, 8)}
    assert runs[7][0] == runs[7][1] and runs[8][0] == runs[8][1]
    assert runs[7][0] != runs[8][0]


def test_suffix_cache_drafts_a_repeated_request(tiny_target):
    engine = make_engine(tiny_target, Arm("suffix_cache", 4))
    first = engine.generate(PROMPTS[0], max_new_tokens=20)
    second = engine.generate(PROMPTS[0], max_new_tokens=20)
    assert second.token_ids == first.token_ids
    assert second.stats.accepted > first.stats.accepted and second.stats.steps < first.stats.steps


def test_a_request_inside_an_open_stream_runs_beside_it_and_closing_early_leaves_the_engine_usable(
        tiny_target, tiny_draft_model, refs):
    engine = make_engine(tiny_target, Arm("model", 3), tiny_draft_model)
    stream = engine.stream(PROMPTS[0], max_new_tokens=24)
    next(stream)
    # Same thread, stream still open: the request joins the running batch (no lock to deadlock on).
    assert engine.generate(PROMPTS[1], max_new_tokens=24).token_ids == refs[1]
    stream.close()
    assert engine.generate(PROMPTS[0], max_new_tokens=24).token_ids == refs[0]
    assert [t for c in engine.stream(PROMPTS[1], max_new_tokens=24) for t in c.token_ids] == refs[1]


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, name", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[3, 99]), "prompt"),
    (dict(prompt=list(range(15)) * 20), "prompt"),  # 300 tokens, context window 256
    (dict(prompt=list(range(15)) * 16, max_new_tokens=40), "max_new_tokens"),  # 240 + 40 > 256
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(sampling={"temperature": -0.5}), "temperature"),
    (dict(sampling={"temperature": 1.0, "top_p": 0.0}), "top_p"),
    (dict(sampling={"temperature": 1.0, "top_p": 1.2}), "top_p"),
    (dict(sampling={"temperature": 1.0, "top_k": -1}), "top_k"),
    (dict(stop=""), "stop"),
])
def test_bad_generate_input_is_a_value_error_naming_the_argument(tiny_target, kwargs, name):
    engine = make_engine(tiny_target, Arm("prompt_lookup", 2))
    args = dict(prompt=PROMPTS[0], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=name):
        engine.generate(**args)
    with pytest.raises(ValueError, match=name):
        list(engine.stream(**args))
    prompt = args.pop("prompt")
    with pytest.raises(ValueError, match=name):  # the same checks where the settings come as options
        engine.generate(prompt, RequestOptions(**args))
    assert engine.generate(PROMPTS[0], max_new_tokens=2).token_ids  # still usable


def test_options_and_keywords_make_the_same_request(tiny_target):
    """One `RequestOptions` or its fields as keywords: the same output; keywords override options."""
    engine = make_engine(tiny_target, Arm("prompt_lookup", 2))
    sampling = SamplingParams(temperature=1.0, seed=7)
    by_keywords = engine.generate(PROMPTS[0], max_new_tokens=12, sampling=sampling, stop="t9").token_ids
    options = RequestOptions(max_new_tokens=12, sampling=sampling, stop="t9")
    assert engine.generate(PROMPTS[0], options).token_ids == by_keywords
    assert [t for c in engine.stream(PROMPTS[0], options) for t in c.token_ids] == by_keywords
    assert engine.submit([PROMPTS[0]], options).wait()[0].token_ids == by_keywords
    longer = RequestOptions(max_new_tokens=30, sampling=sampling, stop="t9")
    assert engine.generate(PROMPTS[0], longer, max_new_tokens=12).token_ids == by_keywords
    with pytest.raises(TypeError, match="keyword"):
        engine.generate(PROMPTS[0], 12)  # the settings after the prompt are keywords


def test_request_options_check_their_fields_and_keep_the_keywords_names():
    assert set(RequestArgs.__annotations__) == {f.name for f in dataclasses.fields(RequestOptions)}
    options = RequestOptions(sampling={"temperature": 0.5}, stop="x")
    assert options.sampling == SamplingParams(temperature=0.5) and options.stop == ("x",)
    with pytest.raises(ValueError, match="timeout"):
        RequestOptions(timeout=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        RequestOptions().replace(max_new_tokens=0)


def test_stream_takes_one_prompt(tiny_target):
    with pytest.raises(ValueError, match="prompt"):
        list(make_engine(tiny_target, Arm(NO_DRAFT, 0)).stream(PROMPTS[:2]))


def test_unknown_router_name_and_backend_are_value_errors(tiny_target):
    with pytest.raises(ValueError, match="router"):
        SpecEngine(tiny_target, [PromptLookupDraft()], router="no-such-router")
    with pytest.raises(ValueError, match="verify_backend"):
        SpecEngine(tiny_target, [], router=FixedRouter(Arm(NO_DRAFT, 0)), verify_backend="fast")


def test_vocabulary_mismatch_names_both_sizes(tiny_target, tmp_path):
    from flashspec_core.loading import build_drafts
    from flashspec_core.models import check_vocab

    with pytest.raises(ValueError, match=r"32.*16|16.*32"):
        check_vocab(tiny_target.model, tiny_llama(32, seed=2), "other")
    other = tiny_loaded(32, seed=2)
    other.model.save_pretrained(tmp_path)
    other.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"drafts.*32.*16"):
        build_drafts([str(tmp_path)], tiny_target, None)


def test_unknown_draft_name_lists_the_valid_ones(tiny_target):
    from flashspec_core.loading import DRAFT_NAMES, build_drafts

    with pytest.raises(ValueError, match="drafts") as err:
        build_drafts(["no_such_draft"], tiny_target, None)
    assert all(name in str(err.value) for name in DRAFT_NAMES)
    with pytest.raises(ValueError, match="drafts"):
        build_drafts([42], tiny_target, None)

    class OnlyPropose:  # the members a draft must define, none of those DraftSource supplies
        name, deterministic = "mine", True

        def propose(self, contexts, gamma, sampling, generator=None):
            return None

    with pytest.raises(ValueError, match="drafts.*subclasses flashspec_core.drafts.DraftSource"):
        build_drafts([OnlyPropose()], tiny_target, None)
    with pytest.raises(ValueError, match="drafts.*subclasses flashspec_core.drafts.DraftSource"):
        SpecEngine(tiny_target, [OnlyPropose()])


def test_a_single_prompt_reuses_the_previous_requests_prefix(tiny_target, tiny_draft_model):
    """Agent steps resend their system prompt: the second request feeds only what is new, and its
    output is still HF's."""
    system = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    first, second = system + [2, 7], system + [8, 2, 8]
    engine = make_engine(tiny_target, Arm("model", 3), tiny_draft_model)
    a = engine.generate(first, max_new_tokens=12)
    b = engine.generate(second, max_new_tokens=12)
    assert a.stats.cached_prompt_tokens == 0
    assert b.stats.cached_prompt_tokens == len(system)
    assert b.token_ids == hf_greedy(tiny_target, second, 12)
    again = engine.generate(second, max_new_tokens=12)
    assert again.stats.cached_prompt_tokens == len(second) - 1
    assert again.token_ids == b.token_ids
    batch = engine.generate([second, first], max_new_tokens=12)
    # Each row takes the free slot whose cache shares most with its prompt; the second gets a new one.
    assert [r.stats.cached_prompt_tokens for r in batch] == [len(second) - 1, 0]
    assert [r.token_ids for r in batch] == [b.token_ids, a.token_ids]
    again = engine.generate([first, second], max_new_tokens=12)
    assert [r.stats.cached_prompt_tokens for r in again] == [len(first) - 1, len(second) - 1]
    assert [r.token_ids for r in again] == [a.token_ids, b.token_ids]


def test_a_request_that_fails_mid_forward_leaves_no_cache_behind(tiny_target, monkeypatch):
    engine = make_engine(tiny_target, Arm("prompt_lookup", 4))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = engine.generate(prompt, max_new_tokens=10).token_ids
    # The last layer's MLP output projection: every runner calls it (transformers' forward, the
    # static cache's), after the attention has written this forward's keys and values.
    mlp = tiny_target.model.model.layers[-1].mlp.down_proj
    real_forward = mlp.forward
    calls = {"n": 0}

    def failing_forward(*args, **kwargs):  # the prefill runs; every step's forward fails
        calls["n"] += 1
        if calls["n"] >= 2:
            raise RuntimeError("simulated failure inside the target forward")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(mlp, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate(prompt + [7], max_new_tokens=10)
    monkeypatch.setattr(mlp, "forward", real_forward)
    after = engine.generate(prompt, max_new_tokens=10)
    assert after.stats.cached_prompt_tokens == 0
    assert after.token_ids == expected


@pytest.mark.parametrize("domain, hint, decoded", [("Code", None, 0), (None, "tool", 0), (None, None, 1)])
def test_the_prompt_is_decoded_for_the_classifier_only_when_no_domain_or_hint_decides(domain, hint, decoded):
    loaded = tiny_loaded(16, seed=0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 4
    seen: list[list[int]] = []
    decode = loaded.tokenizer.decode
    loaded.tokenizer.decode = lambda ids, **kw: seen.append(list(ids)) or decode(ids, **kw)
    out = make_engine(loaded, Arm(NO_DRAFT, 0)).generate(prompt, max_new_tokens=2, domain=domain, hint=hint)
    assert sum(ids == prompt for ids in seen) == decoded
    assert out.stats.domain == (domain or hint or classify_prompt(decode(prompt))).lower()
