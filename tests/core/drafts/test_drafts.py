"""Properties of the draft sources (Hypothesis): each proposes what it claims, with the q it claims.

Prompt lookup copies what followed a real earlier occurrence of the context's tail; the suffix
cache copies what followed the tail in an earlier output, and forgets evicted outputs; a model
draft's q is a distribution, exactly the one its token was drawn from, even after its KV cache
was rolled back to a verified prefix.
"""
from __future__ import annotations

import pytest
import torch
from helpers import one_thread
from hypothesis import given, settings
from hypothesis import strategies as st

from flashspec_core.drafts import DraftSource, ModelDraft, PromptLookupDraft, SuffixCacheDraft
from flashspec_core.drafts.prompt_lookup import lookup_continuation
from flashspec_core.processors.sampling import SamplingParams, probs_from_logits

T1 = SamplingParams(temperature=1.0)
token_lists = st.lists(st.integers(0, 4), min_size=1, max_size=30)  # a small alphabet repeats often


def _occurrences(seq: list[int], gram: list[int], last_start: int) -> list[int]:
    """Start positions i <= last_start with seq[i:i+len(gram)] == gram."""
    n = len(gram)
    return [i for i in range(0, last_start + 1) if seq[i:i + n] == gram]


def test_every_source_implements_the_protocol():
    assert all(isinstance(d, DraftSource) for d in (PromptLookupDraft(), SuffixCacheDraft()))


@settings(max_examples=300, deadline=None)
@given(token_lists, st.integers(0, 8), st.integers(1, 4), st.integers(0, 3))
def test_prompt_lookup_copies_after_the_latest_occurrence_of_the_longest_tail(context, gamma, max_ngram, shorter):
    min_ngram = max(1, max_ngram - shorter)
    draft = PromptLookupDraft(max_ngram=max_ngram, min_ngram=min_ngram)
    proposal = draft.propose([context], gamma, T1)
    assert proposal.probs is None and draft.deterministic
    tokens = proposal.tokens[0]
    assert len(tokens) <= gamma
    if gamma == 0:
        assert tokens == []
        return
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        # An earlier occurrence must end before the last token, so something follows it.
        hits = _occurrences(context, context[-n:], len(context) - 1 - n)
        if hits:
            start = hits[-1] + n
            assert tokens == context[start:start + gamma]
            return
    assert tokens == [], "proposed tokens without an earlier occurrence of the tail"


def test_prompt_lookup_proposes_nothing_for_ids_no_code_point_holds():
    """The n-gram search runs on the ids as code points; no tokenizer has an id past 0x10FFFF."""
    for bad in (0x110000, -1, 2**40):
        assert PromptLookupDraft().propose([[1, 2, 3, bad, 1, 2]], 4, T1).tokens == [[]]
    assert PromptLookupDraft().propose([[1, 0x10FFFF, 3, 1, 0x10FFFF]], 4, T1).tokens == [[3, 1, 0x10FFFF]]


@settings(max_examples=50, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=5), st.integers(1, 6))
def test_prompt_lookup_rows_of_a_batch_are_independent(contexts, gamma):
    draft = PromptLookupDraft()
    batch = draft.propose(contexts, gamma, T1).tokens
    assert batch == [draft.propose([c], gamma, T1).tokens[0] for c in contexts]


# What happens to the row between two steps: it grows (a step's tokens, or an id past 16 bits,
# or one no code point can hold), is cut back (a rollback), has one token changed in place, is
# replaced (a new request, maybe as long as the old one), or is passed as a copy (the router's
# scoring), a tuple, or at another row index of a batch.
ROW_EDITS = ("extend", "extend", "wide", "invalid", "truncate", "edit", "new", "copy", "tuple", "batch")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(ROW_EDITS), token_lists, st.integers(0, 8)), min_size=1, max_size=30),
       st.integers(1, 4), st.integers(0, 3))
def test_prompt_lookup_reusing_its_copy_of_a_growing_row_proposes_what_the_plain_function_does(ops, max_ngram, shorter):
    """The draft keeps an int64 copy of each row and converts only what a longer context added;
    a context that does not extend the copy (a new request, a rollback, an edit in place, the
    same length with other tokens) must be looked up afresh, never from the stale copy."""
    min_ngram = max(1, max_ngram - shorter)
    draft = PromptLookupDraft(max_ngram=max_ngram, min_ngram=min_ngram)
    row: list[int] = []
    for op, tokens, k in ops:
        if op == "extend":
            row.extend(tokens)
        elif op == "wide":
            row += [0x10FFFF - k, tokens[0], 0x10FFFF - k]
        elif op == "invalid":
            row += [0x110000 + k, -1 - k][k % 2:]
        elif op == "truncate":
            del row[max(0, len(row) - k):]
        elif op == "edit" and row:
            row[k % len(row)] = (row[k % len(row)] + 1) % 5
        elif op == "new":
            row = (tokens * 8)[:len(row)] if k % 2 else list(tokens)  # half the time as long as the old row
        context = list(row) if op == "copy" else tuple(row) if op == "tuple" else row
        for gamma in (k, 8):  # twice per context, as a step and then the router's scoring ask
            expected = lookup_continuation(list(context), gamma, max_ngram, min_ngram)
            if op == "batch":
                assert draft.propose([tokens, context], gamma, T1).tokens == [
                    lookup_continuation(tokens, gamma, max_ngram, min_ngram), expected]
            else:
                assert draft.propose([context], gamma, T1).tokens[0] == expected


def test_prompt_lookup_keeps_a_rows_copy_wherever_the_row_stands_in_the_call(monkeypatch):
    """Between steps rows join, leave and change arms, so a row is at another index of the next
    call: its copy is still extended by the new tokens only, not converted whole again."""
    from flashspec_core.drafts import prompt_lookup

    converted: list[int] = []  # lengths of the token lists converted to text
    real = prompt_lookup._as_text
    monkeypatch.setattr(prompt_lookup, "_as_text", lambda tokens: converted.append(len(tokens)) or real(tokens))
    draft = PromptLookupDraft()
    rows = [[i % 7 for i in range(300 + r)] for r in range(4)]
    draft.propose(rows, 4, T1)
    assert sorted(converted) == [300, 301, 302, 303]
    for step, order in enumerate(([2, 0, 3], [3, 1], [1, 2, 0, 3])):  # reordered, some rows absent
        for row in rows:
            row.append(step)
        expected = [lookup_continuation(rows[i], 4, 3, 1) for i in order]
        converted.clear()
        assert draft.propose([rows[i] for i in order], 4, T1).tokens == expected
        assert max(converted) <= step + 1, f"a row was converted whole again: {converted}"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), max_size=15), min_size=1, max_size=6), token_lists, st.integers(0, 8))
def test_suffix_cache_copies_the_stored_continuation_of_the_most_recent_match(outputs, context, gamma):
    draft = SuffixCacheDraft(max_ngram=3, min_ngram=2)
    draft.begin([[0]])
    draft.end([[0]] * len(outputs), outputs)
    kept = [o for o in outputs if len(o) >= draft.min_ngram + 1]  # too short to hold an n-gram and a next token
    assert len(draft) == len(kept)
    tokens = draft.propose([context], gamma, T1).tokens[0]
    assert len(tokens) <= gamma
    if gamma == 0:
        assert tokens == []
        return
    for n in range(min(3, len(context)), 1, -1):
        tail = context[-n:]
        hits = [(o, i + n) for o in kept for i in _occurrences(o, tail, len(o) - 1 - n)]
        if hits:
            out, end = hits[-1]  # the latest output wins, and within it the latest occurrence
            assert tokens == out[end:end + gamma]
            return
    assert tokens == [], "proposed tokens that follow no stored occurrence of the tail"


def test_suffix_cache_spans_requests_and_begin_does_not_clear_it():
    draft = SuffixCacheDraft()
    draft.end([[1, 2]], [[10, 11, 12, 13, 14, 15]])
    draft.begin([[7, 7]])
    assert draft.propose([[9, 10, 11], [3, 4]], 3, T1).tokens == [[12, 13, 14], []]


def test_suffix_cache_evicts_the_oldest_outputs_beyond_its_bound():
    draft = SuffixCacheDraft(max_outputs=3)
    outputs = [[100 * i + j for j in range(6)] for i in range(1, 8)]  # disjoint alphabets
    for out in outputs:
        draft.end([[0]], [out])
        assert len(draft) <= 3
    assert len(draft) == 3
    for i, out in enumerate(outputs):
        proposed = draft.propose([out[:2]], 4, T1).tokens[0]
        assert proposed == (out[2:6] if i >= len(outputs) - 3 else []), f"output {i}"


@st.composite
def model_draft_calls(draw):
    """A first batch of contexts, then follow-up steps: each keeps a prefix of the last proposal
    (the verified part) plus a corrected token, as the engine does after verification, and at
    times one more token (a context that moved on further than the draft saw)."""
    bsz = draw(st.integers(1, 3))
    contexts = [draw(st.lists(st.integers(0, 15), min_size=1, max_size=8)) for _ in range(bsz)]
    new_tokens = st.lists(st.integers(0, 15), min_size=1, max_size=2)
    steps = [(draw(st.integers(0, 4)), [draw(new_tokens) for _ in range(bsz)]) for _ in range(3)]
    sampling = draw(st.one_of(st.just(SamplingParams()), st.just(T1),
                              st.just(SamplingParams(temperature=0.7, top_k=5, top_p=0.9))))
    return contexts, draw(st.integers(1, 4)), steps, sampling, draw(st.integers(0, 1000))


@settings(max_examples=20, deadline=None)
@given(model_draft_calls())
def test_model_draft_q_is_the_distribution_each_token_was_drawn_from(tiny_draft_model, case):
    with one_thread():
        _check_model_draft(tiny_draft_model, *case)


@settings(max_examples=15, deadline=None)
@given(model_draft_calls(), st.integers(2, 6))
def test_a_windowed_model_draft_q_is_the_distribution_over_its_window(tiny_draft_model, case, max_context):
    """With `max_context` the draft reads a window of each row's latest tokens: q must be a fresh
    forward's distribution over exactly that window (a window the cache disagrees with would
    break this), and the window never spans more than twice `max_context` tokens."""
    with one_thread():
        _check_model_draft(tiny_draft_model, *case, max_context=max_context)


def _check_model_draft(tiny_draft_model, contexts, gamma, steps, sampling, seed, max_context=None):
    draft = ModelDraft(tiny_draft_model, name="tiny", pad_token_id=15, max_context=max_context)
    draft.begin(contexts)
    gen = torch.Generator().manual_seed(seed)
    tokens: list[list[int]] = []  # the previous step's proposal
    for keep, corrections in [(None, None)] + steps:
        if keep is not None:  # the engine's next step: verified prefix of the proposal + a new token
            contexts = [c + t[:keep] + fix for c, t, fix in zip(contexts, tokens, corrections)]
        proposal = draft.propose(contexts, gamma, sampling, gen)
        tokens, q = proposal.tokens, proposal.probs
        assert q.shape == (len(contexts), gamma, 16) and [len(t) for t in tokens] == [gamma] * len(contexts)
        assert (q >= 0).all() and torch.allclose(q.sum(-1), torch.ones(q.shape[:2]), atol=1e-5)
        for b, ctx in enumerate(contexts):
            if max_context is not None:
                ctx = ctx[draft.starts[b]:]
                assert 1 <= len(ctx) <= 2 * max_context
            with torch.no_grad():  # one fresh forward: logits after ctx, ctx + t0, ..., ctx + t0..t(γ-2)
                logits = tiny_draft_model(input_ids=torch.tensor([ctx + tokens[b][:-1]])).logits[0, len(ctx) - 1:]
            expected = probs_from_logits(logits, sampling)  # [γ, V]
            assert torch.allclose(q[b], expected, atol=1e-5), "q differs from a fresh forward (stale KV?)"
            assert all(q[b, j, t] > 0 for j, t in enumerate(tokens[b]))
            if sampling.greedy:
                assert tokens[b] == q[b].argmax(-1).tolist()


def test_model_draft_times_catching_up_apart_from_drafting(tiny_draft_model):
    """Feeding context the draft has not seen (the prompt; steps other drafts took) is reported
    as catch-up (the price of trying the draft, which the router charges to its arm); a step
    after its own is not."""
    draft = ModelDraft(tiny_draft_model, name="tiny", pad_token_id=15)
    context = [1, 2, 3, 4, 5, 6, 7, 8]
    draft.begin([context])
    first = draft.propose([context], 3, SamplingParams())
    assert first.catchup_seconds > 0
    # The engine's next step: two of the three accepted plus the target's token.
    context = context + first.tokens[0][:2] + [9]
    assert draft.propose([context], 3, SamplingParams()).catchup_seconds == 0.0
    # Another arm ran for a few steps: five tokens the draft never saw.
    context = context + [10, 11, 12, 13, 14]
    assert draft.propose([context], 3, SamplingParams()).catchup_seconds > 0


def test_a_windowed_model_draft_reads_only_its_window(tiny_draft_model):
    draft = ModelDraft(tiny_draft_model, name="tiny", pad_token_id=15, max_context=8)
    context = list(range(1, 15)) * 3  # 42 tokens
    draft.begin([context])
    draft.propose([context], 2, SamplingParams())
    assert draft.starts == [34]
    assert draft._runner.prefix_len(0, context[34:]) == 8 and draft._runner.prefix_len(0, context) == 0
    grown = context + [3] * 7  # 15 tokens past the start: still inside twice the window
    draft.propose([grown], 2, SamplingParams())
    assert draft.starts == [34]
    longer = grown + [4] * 2  # 17 past it: the window moves to the latest 8
    draft.propose([longer], 2, SamplingParams())
    assert draft.starts == [len(longer) - 8]
    draft.begin([context])
    assert draft.starts == []  # a new request starts again


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_a_bad_max_context_names_the_argument(tiny_draft_model, bad):
    with pytest.raises(ValueError, match="max_context"):
        ModelDraft(tiny_draft_model, name="tiny", pad_token_id=15, max_context=bad)
