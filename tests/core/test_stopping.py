"""A row's text kept up to date step by step is the full decode of its tokens, whatever the steps."""
from __future__ import annotations

import random

import pytest

from flashspec_core.stopping import RowOutput, decodes_by_concatenation
from tests.fakes import byte_tokenizer
from tests.helpers import tiny_tokenizer

TEXTS = ["plain ascii words", "naïve café — déjà vu", "日本語のテキスト", "emoji 🤖🛠️ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", '{"k": "ü"}\n\n']


def stepped(tokenizer, ids: list[int], rng: random.Random, stop: tuple[str, ...] = (), whole: bool = False):
    """Append `ids` in random steps of 1-5 tokens; yield the output after each step.
    whole: decode everything each step (the reference)."""
    out = RowOutput(tokenizer, frozenset(), stop, max_new_tokens=10_000,
                    concatenates=not whole and decodes_by_concatenation(tokenizer))
    i = 0
    while i < len(ids) and not out.finished:
        n = rng.randint(1, 5)
        out.append(ids[i:i + n])
        i += n
        yield out


def test_which_tokenizers_decode_by_concatenation(default_target):
    assert decodes_by_concatenation(byte_tokenizer())  # byte-level BPE: one byte a token here
    assert decodes_by_concatenation(default_target.tokenizer)
    assert not decodes_by_concatenation(tiny_tokenizer(16))  # WordLevel: joins tokens with spaces
    cleaning = byte_tokenizer()
    cleaning.clean_up_tokenization_spaces = True  # transformers skips the clean-up for BPE unless forced
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert cleaning.decode(cleaning.encode("a .")) == "a."
    assert not decodes_by_concatenation(cleaning)
    flagged = byte_tokenizer()
    flagged.clean_up_tokenization_spaces = True  # the flag alone: whatever this transformers does with it
    assert decodes_by_concatenation(flagged) == (flagged.decode(flagged.encode("a .")) == "a .")


@pytest.mark.parametrize("seed", range(6))
def test_text_is_the_full_decode_after_every_step_bytes_split_inside_characters(seed):
    tok = byte_tokenizer()
    rng = random.Random(seed)
    ids = [t for text in rng.sample(TEXTS, 3) for t in tok.encode(text, add_special_tokens=False)]
    ids[rng.randrange(len(ids)):rng.randrange(len(ids))] = [tok.convert_tokens_to_ids("Ã")] * 2  # stray lead bytes
    ids.insert(rng.randrange(len(ids)), tok.eos_token_id)  # a special token, skipped by decode
    for out in stepped(tok, ids, rng):
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(4))
def test_text_is_the_full_decode_after_every_step_default_tokenizer(default_target, seed):
    tok = default_target.tokenizer
    rng = random.Random(seed)
    ids = [t for text in rng.sample(TEXTS, 4) for t in tok.encode(text, add_special_tokens=False)]
    ids += [rng.randrange(len(tok)) for _ in range(40)]  # any token, special ones and byte pieces too
    rng.shuffle(ids)
    for out in stepped(tok, ids, rng):
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_cut_where_a_full_decode_cuts(seed):
    tok = byte_tokenizer()
    rng = random.Random(seed)
    text = " ".join(rng.sample(TEXTS, 4))
    ids = tok.encode(text, add_special_tokens=False)
    start = rng.randrange(len(text) - 3)
    stop = (text[start:start + rng.randint(1, 3)], "never there")
    fast = list(stepped(tok, ids, random.Random(seed), stop))[-1]
    whole = list(stepped(tok, ids, random.Random(seed), stop, whole=True))[-1]
    assert fast.finish_reason == whole.finish_reason == "stop"
    assert (fast.text, fast.token_ids) == (whole.text, whole.token_ids)
    assert fast.text == text[:text.find(stop[0])]


def test_text_is_decoded_only_when_read_unless_stop_strings_need_it():
    tok = byte_tokenizer()
    calls = []
    real = tok.decode
    tok.decode = lambda ids, **kw: (calls.append(len(ids)), real(ids, **kw))[1]
    ids = tok.encode("no stop strings here, " * 4, add_special_tokens=False)
    plain = RowOutput(tok, frozenset(), (), max_new_tokens=10_000, concatenates=True)
    for i in range(0, len(ids), 3):
        plain.append(ids[i:i + 3])
    assert calls == [] and plain.text == real(ids) and len(calls) == 1
    calls.clear()
    stopping = RowOutput(tok, frozenset(), ("never",), max_new_tokens=10_000, concatenates=True)
    for i in range(0, len(ids), 3):
        stopping.append(ids[i:i + 3])
    assert len(calls) == len(range(0, len(ids), 3))  # one short decode a step: what followed the last whole character
    assert max(calls) <= 3
