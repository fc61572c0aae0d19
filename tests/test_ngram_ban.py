"""The n-gram ban: HF's processor over the output along each draft path; yields to the grammar;
greedy = HF generate with the same ban over the output."""
from __future__ import annotations

import pytest
import torch
from helpers import looping_engine
from transformers import LogitsProcessorList
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from flashspec_core.ngram_ban import ban_repeated_ngrams, json_punctuation_tokens
from flashspec_core.sampling import SamplingParams
from flashspec_core.types import NO_DRAFT, Arm

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.mark.parametrize("size", [1, 2, 3])
def test_each_position_gets_hf_ban_of_its_own_output_path(size):
    gen = torch.Generator().manual_seed(0)
    outputs = [[1, 2, 1, 2, 5], [7, 0, 7]]
    drafts = [[1, 2, 9], [0, 7, 0]]
    logits = torch.randn((2, 4, 12), generator=gen)  # [B, P, V]
    got = ban_repeated_ngrams(logits, outputs, drafts, size)
    hf = NoRepeatNGramLogitsProcessor(size)
    for b in range(2):
        for j in range(4):
            path = torch.tensor([outputs[b] + drafts[b][:j]])
            torch.testing.assert_close(got[b, j:j + 1], hf(path, logits[b, j:j + 1].clone()), rtol=0, atol=0)
    assert torch.isinf(got).any() and not torch.isinf(logits).any()


def test_size_zero_is_the_identity_and_the_input_is_left_alone():
    logits = torch.randn(1, 3, 8)
    assert ban_repeated_ngrams(logits, [[1, 2]], [[3, 4]], 0) is logits
    before = logits.clone()
    ban_repeated_ngrams(logits, [[1, 2, 1]], [[2, 4]], 2)
    assert torch.equal(logits, before)


def test_the_ban_yields_where_it_would_forbid_everything_the_grammar_allows():
    """Output [4, 5, 4]: size 2 bans 5 after 4. Where the grammar allows only 5 (a forced key),
    the position keeps the grammar's logits; where it also allows 6, 5 is banned."""
    forced = torch.full((1, 1, 8), float("-inf"))
    forced[0, 0, 5] = 0.0
    assert torch.equal(ban_repeated_ngrams(forced, [[4, 5, 4]], [[]], 2), forced)
    choice = forced.clone()
    choice[0, 0, 6] = -1.0
    banned = ban_repeated_ngrams(choice, [[4, 5, 4]], [[]], 2)
    assert torch.isinf(banned[0, 0, 5]) and banned[0, 0, 6] == -1.0


def test_sampling_params_reject_a_negative_size():
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        SamplingParams(no_repeat_ngram_size=-1)


class _OutputOnly:
    """HF's n-gram processor applied to the generated part only (what the engine bans)."""

    def __init__(self, size: int, prompt_len: int):
        self.inner, self.prompt_len = NoRepeatNGramLogitsProcessor(size), prompt_len

    def __call__(self, input_ids, scores):
        return self.inner(input_ids[:, self.prompt_len:], scores)


@pytest.mark.parametrize("arm", [Arm(NO_DRAFT, 0), Arm("prompt_lookup", 4), Arm("model", 3)], ids=str)
def test_greedy_with_the_ban_equals_hf_generate_with_it(arm):
    """A looping prompt, where the ban changes the output, in a batch of unequal rows."""
    loaded, engine, prompts = looping_engine(arm)
    pad = loaded.tokenizer.pad_token_id
    results = engine.generate(prompts, max_new_tokens=20, sampling=SamplingParams(no_repeat_ngram_size=2))
    changed = 0
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            ids = torch.tensor([prompt])
            kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, pad_token_id=pad)
            plain = loaded.model.generate(ids, **kw)[0, len(prompt):].tolist()
            ref = loaded.model.generate(ids, logits_processor=LogitsProcessorList([_OutputOnly(2, len(prompt))]),
                                        **kw)[0, len(prompt):].tolist()
            assert result.token_ids == ref
            changed += ref != plain
    assert changed, "the prompts should make the ban matter"


def test_exempt_tokens_are_never_banned_and_json_punctuation_is_found_by_text():
    """Output [4, 5, 4]: size 2 bans 5 after 4, unless 5 is exempt (a JSON quote, say)."""
    logits = torch.zeros(1, 1, 8)
    assert torch.isinf(ban_repeated_ngrams(logits, [[4, 5, 4]], [[]], 2)[0, 0, 5])
    exempt = torch.zeros(8, dtype=torch.bool)
    exempt[5] = True
    assert torch.equal(ban_repeated_ngrams(logits, [[4, 5, 4]], [[]], 2, exempt), logits)

    class Tok:
        texts = ["cat", '": "', " is", "},", "[", "a"]

        def __len__(self):
            return len(self.texts)

        def batch_decode(self, ids):
            return [self.texts[i[0]] for i in ids]

    assert json_punctuation_tokens(Tok(), 8).tolist() == [False, True, False, True, True, False, False, False]
