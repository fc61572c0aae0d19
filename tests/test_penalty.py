"""Repetition penalty: HF's processor at every position of a draft path; greedy = HF generate."""
from __future__ import annotations

import pytest
import torch
from helpers import looping_engine
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from flashspec_core.penalty import penalize_paths
from flashspec_core.sampling import SamplingParams
from flashspec_core.types import NO_DRAFT, Arm

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.mark.parametrize("penalty", [0.8, 1.3, 2.0])
def test_each_position_gets_hf_penalty_of_its_own_prefix(penalty):
    gen = torch.Generator().manual_seed(0)
    contexts = [[1, 2, 2, 5], [7, 0]]
    drafts = [[3, 1, 9], [4, 4, 8]]
    logits = torch.randn((2, 4, 12), generator=gen) * 3  # [B, P, V]: both signs
    got = penalize_paths(logits, contexts, drafts, penalty)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for b in range(2):
        for j in range(4):
            prefix = torch.tensor([contexts[b] + drafts[b][:j]])
            expected = hf(prefix, logits[b, j:j + 1].clone())
            torch.testing.assert_close(got[b, j:j + 1], expected, rtol=0, atol=0)
    assert not torch.equal(got, logits)


def test_penalty_one_is_the_identity_and_the_input_is_left_alone():
    logits = torch.randn(1, 3, 8)
    assert penalize_paths(logits, [[1, 2]], [[3, 4]], 1.0) is logits
    before = logits.clone()
    penalize_paths(logits, [[1, 2]], [[3, 4]], 1.5)
    assert torch.equal(logits, before)


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
