"""Repetition penalty: HF's processor at every position of a draft path, from the seen tokens kept on
the device; greedy = HF generate."""
from __future__ import annotations

import pytest
import torch
from helpers import looping_engine
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.processors.penalty import SeenTokens, penalize_paths, penalize_rows
from flashspec_core.processors.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.mark.parametrize("penalty", [0.8, 1.3, 2.0])
def test_each_position_gets_hf_penalty_of_its_own_prefix(penalty):
    gen = torch.Generator().manual_seed(0)
    contexts = [[1, 2, 2, 5], [7, 0]]
    drafts = [[3, 1, 9], [4, 4, 8]]
    logits = torch.randn((2, 4, 12), generator=gen) * 3  # [B, P, V]: both signs
    got = penalize_paths(logits, SeenTokens(contexts, 12), torch.tensor(drafts), penalty)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for b in range(2):
        for j in range(4):
            prefix = torch.tensor([contexts[b] + drafts[b][:j]])
            expected = hf(prefix, logits[b, j:j + 1].clone())
            torch.testing.assert_close(got[b, j:j + 1], expected, rtol=0, atol=0)
    assert not torch.equal(got, logits)


@pytest.mark.parametrize("positions", [1, 2, 5, 9])
def test_hf_penalty_on_random_paths_with_commits_and_unequal_rows(positions):
    """Rows of different lengths, repeated draft ids, and tokens committed after the prompts (the
    engine's steps) count exactly as if they had been in the context from the start."""
    gen = torch.Generator().manual_seed(positions)
    vocab, hf = 10, RepetitionPenaltyLogitsProcessor(1.6)
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (1, 7, 3)]
    committed = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (4, 0, 2)]
    drafts = torch.randint(vocab, (3, positions - 1), generator=gen)  # [B, P - 1]: small vocab, repeats
    seen = SeenTokens(prompts, vocab)
    for row, tokens in enumerate(committed):
        seen.commit(row, tokens)
    logits = torch.randn((3, positions, vocab), generator=gen) * 3  # [B, P, V]
    got = penalize_paths(logits, seen, drafts, 1.6)
    for b in range(3):
        for j in range(positions):
            prefix = torch.tensor([prompts[b] + committed[b] + drafts[b, :j].tolist()])
            torch.testing.assert_close(got[b, j:j + 1], hf(prefix, logits[b, j:j + 1].clone()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_penalized_together_equal_each_alone(dtype):
    """Rows of other requests and path lengths (a row without a draft among them), penalized in
    one set of ops step after step, tokens committed between steps: bit for bit what each gives
    alone, the drafts' padding (-1) ignored; each request's own mask stays its own."""
    gen = torch.Generator().manual_seed(3)
    vocab, lengths = 12, [4, 1, 6, 2, 6]
    history = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (3, 5, 1, 8, 2)]
    seen = [SeenTokens([h], vocab) for h in history]
    for step in range(3):
        for i, h in enumerate(history):  # the step before committed a few tokens per row
            new = torch.randint(vocab, (step,), generator=gen).tolist()
            seen[i].commit(0, new)
            h += new
        drafts = torch.full((5, 7), -1)  # [n, widest draft + 1]: -1 past each row's draft
        for i, n in enumerate(lengths):
            drafts[i, :n - 1] = torch.randint(vocab, (n - 1,), generator=gen)
        logits = [(torch.randn((n, vocab), generator=gen) * 3).to(dtype) for n in lengths]  # [P_i, V]
        got = penalize_rows(logits, seen, drafts, 1.4)
        for i, n in enumerate(lengths):
            alone = penalize_paths(logits[i][None], SeenTokens([history[i]], vocab), drafts[i:i + 1, :n - 1], 1.4)[0]
            assert got[i].shape == (n, vocab) and got[i].dtype == torch.float32
            assert torch.equal(got[i], alone)
            assert torch.equal(seen[i].mask, SeenTokens([history[i]], vocab).mask)


def test_penalty_one_is_the_identity_and_the_input_is_left_alone():
    logits = torch.randn(1, 3, 8)
    seen, drafts = SeenTokens([[1, 2]], 8), torch.tensor([[3, 4]])
    assert penalize_paths(logits, seen, drafts, 1.0) is logits
    before = logits.clone()
    penalize_paths(logits, seen, drafts, 1.5)
    assert torch.equal(logits, before)


def test_seen_tokens_ignore_ids_outside_the_vocabulary():
    """As HF ignores them: a prompt may hold ids of a tokenizer larger than the model's output."""
    assert SeenTokens([[1, 9, -1, 3]], 4).mask.tolist() == [[False, True, False, True]]


def test_sampling_params_reject_a_non_positive_penalty():
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)


@pytest.mark.parametrize("arm", [Arm(NO_DRAFT, 0), Arm("prompt_lookup", 4), Arm("model", 3)], ids=str)
def test_greedy_with_penalty_equals_hf_generate(arm):
    """A looping prompt, where the penalty changes the output, in a batch of unequal rows."""
    loaded, engine, prompts = looping_engine(arm)
    pad = loaded.tokenizer.pad_token_id
    sampling = SamplingParams(repetition_penalty=1.8)
    results = engine.generate(prompts, max_new_tokens=20, sampling=sampling)
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            ids = torch.tensor([prompt])
            plain = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                                          pad_token_id=pad)[0, len(prompt):].tolist()
            ref = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                                        pad_token_id=pad, repetition_penalty=1.8)[0, len(prompt):].tolist()
            assert result.token_ids == ref
            assert ref != plain, "the prompt should make the penalty matter"
