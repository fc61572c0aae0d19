"""The n-gram ban: HF's processor over the output along each draft path; yields to the grammar;
greedy = HF generate with the same ban over the output."""
from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from helpers import looping_engine
from transformers import LogitsProcessorList
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from flashspec_core.arms import NO_DRAFT, Arm
from flashspec_core.processors.ngram_ban import OutputTokens, ban_repeated_ngrams, json_punctuation_tokens
from flashspec_core.processors.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def ban(logits, outputs: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], size: int, exempt=None):
    """The ban from host lists, as a test writes them (the engine keeps both on the device)."""
    draft_tokens = torch.tensor(drafts, dtype=torch.long).view(len(drafts), -1)  # [B, P - 1]
    return ban_repeated_ngrams(logits, OutputTokens(outputs), draft_tokens, size, exempt)


def hf_ban(logits, outputs: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], size: int, exempt=None,
           emptied: list | None = None):
    """The oracle: HF's processor applied position by position to output + draft[:j], then the two
    rules of the module docstring (exempt tokens, a position the ban would empty keeps its logits).
    emptied: collects the (b, j) where the second rule applied."""
    processor, out = NoRepeatNGramLogitsProcessor(size), logits.float().clone()
    for b in range(logits.shape[0]):
        for j in range(logits.shape[1]):
            path = torch.tensor([list(outputs[b]) + list(drafts[b][:j])], dtype=torch.long)  # [1, L + j]
            banned = processor(path, logits[b, j:j + 1].float().clone())[0]  # [V]
            if exempt is not None:
                banned = torch.where(exempt, logits[b, j].float(), banned)
            if torch.isfinite(banned).any():
                out[b, j] = banned
            elif emptied is not None and torch.isfinite(logits[b, j]).any():
                emptied.append((b, j))
    return out


@pytest.mark.parametrize("size", [1, 2, 3])
def test_each_position_gets_hf_ban_of_its_own_output_path(size):
    gen = torch.Generator().manual_seed(0)
    outputs = [[1, 2, 1, 2, 5], [7, 0, 7]]
    drafts = [[1, 2, 9], [0, 7, 0]]
    logits = torch.randn((2, 4, 12), generator=gen)  # [B, P, V]
    got = ban(logits, outputs, drafts, size)
    hf = NoRepeatNGramLogitsProcessor(size)
    for b in range(2):
        for j in range(4):
            path = torch.tensor([outputs[b] + drafts[b][:j]])
            torch.testing.assert_close(got[b, j:j + 1], hf(path, logits[b, j:j + 1].clone()), rtol=0, atol=0)
    assert torch.isinf(got).any() and not torch.isinf(logits).any()


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("positions", [1, 3, 9])
def test_hf_ban_on_random_outputs_and_drafts(size, positions):
    """Batches of rows whose outputs differ in length (empty, shorter than `size`, long), a small
    vocabulary so that n-grams repeat, random exempt tokens, and grammar-like -inf masks that the
    ban sometimes empties: equal to HF's processor position by position, bit for bit."""
    gen = torch.Generator().manual_seed(100 * size + positions)
    vocab, banned, emptied = 4, 0, []
    for trial in range(40):
        bsz = int(torch.randint(1, 5, (), generator=gen))
        lengths = torch.randint(0, 8 * size + 8, (bsz,), generator=gen).tolist()
        lengths[0] = trial % (size + 1)  # outputs shorter than size, and exactly size
        outputs = [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]
        drafts = torch.randint(vocab, (bsz, positions - 1), generator=gen).tolist()
        logits = torch.randn((bsz, positions, vocab), generator=gen)  # [B, P, V]
        allowed = torch.rand(logits.shape, generator=gen).argsort(-1) < torch.randint(1, vocab + 1, (bsz, positions, 1),
                                                                                   generator=gen)
        logits[~allowed] = float("-inf")  # a grammar's mask: 1 to V tokens allowed per position
        exempt = torch.rand(vocab, generator=gen) < 0.2 if trial % 2 else None  # [V] bool
        got = ban(logits, outputs, drafts, size, exempt)
        expected = hf_ban(logits, outputs, drafts, size, exempt, emptied)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        banned += int((torch.isinf(got) & ~torch.isinf(logits)).sum())
    assert banned > 0, "the random cases should ban tokens"
    assert emptied, "the random cases should reach a position the ban would empty"


def test_outputs_committed_step_by_step_equal_the_whole_output():
    """The engine commits a few tokens per step; the buffer grows past its capacity."""
    gen = torch.Generator().manual_seed(3)
    whole = [torch.randint(5, (n,), generator=gen).tolist() for n in (70, 0, 33)]
    outputs = OutputTokens([[], [], []], capacity=4)
    for start in range(0, 70, 3):
        for row, tokens in enumerate(whole):
            outputs.commit(row, tokens[start:start + 3])
    assert outputs.lengths == [70, 0, 33]
    assert [outputs.tokens[b, :n].tolist() for b, n in enumerate(outputs.lengths)] == whole
    logits, drafts = torch.randn(3, 4, 5, generator=gen), torch.randint(5, (3, 3), generator=gen)
    torch.testing.assert_close(ban_repeated_ngrams(logits, outputs, drafts, 2),
                               hf_ban(logits, whole, drafts.tolist(), 2), rtol=0, atol=0)


def test_size_zero_is_the_identity_and_the_input_is_left_alone():
    logits = torch.randn(1, 3, 8)
    assert ban(logits, [[1, 2]], [[3, 4]], 0) is logits
    before = logits.clone()
    ban(logits, [[1, 2, 1]], [[2, 4]], 2)
    assert torch.equal(logits, before)


def test_the_ban_yields_where_it_would_forbid_everything_the_grammar_allows():
    """Output [4, 5, 4]: size 2 bans 5 after 4. Where the grammar allows only 5 (a forced key),
    the position keeps the grammar's logits; where it also allows 6, 5 is banned."""
    forced = torch.full((1, 1, 8), float("-inf"))
    forced[0, 0, 5] = 0.0
    assert torch.equal(ban(forced, [[4, 5, 4]], [[]], 2), forced)
    choice = forced.clone()
    choice[0, 0, 6] = -1.0
    banned = ban(choice, [[4, 5, 4]], [[]], 2)
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
    assert torch.isinf(ban(logits, [[4, 5, 4]], [[]], 2)[0, 0, 5])
    exempt = torch.zeros(8, dtype=torch.bool)
    exempt[5] = True
    assert torch.equal(ban(logits, [[4, 5, 4]], [[]], 2, exempt), logits)

    class Tok:
        texts = ["cat", '": "', " is", "},", "[", "a"]

        def __len__(self):
            return len(self.texts)

        def batch_decode(self, ids):
            return [self.texts[i[0]] for i in ids]

    assert json_punctuation_tokens(Tok(), 8).tolist() == [False, True, False, True, True, False, False, False]
