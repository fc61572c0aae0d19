"""Shared pieces of the LlamaIndex adapter tests: a tiny real engine and a scripted engine.

The tiny engine is the real `SpecEngine` over a random one-layer Llama and an in-memory
character-level tokenizer with a ChatML template, so every adapter path (chat template, encode,
stream, stop strings, statistics) runs for real in milliseconds. Its text is noise, so tests
compare methods with each other and with the engine, never with expected words.

The scripted engine has the engine's public surface (`generate`, `stream`, `tokenizer`,
`context_window`, `model_name`) and answers each call with the next canned text, so agent loops
can be tested deterministically; the domain it reports comes from the core's `resolve_domain`,
exactly as the real engine computes it.
"""
from __future__ import annotations

import functools
import string
from typing import Iterator, Sequence

from helpers import tiny_llama
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from flashspec_core import SpecEngine
from flashspec_core.models import LoadedModel
from flashspec_core.pool import default_drafts
from flashspec_core.results import GenerationResult, GenerationStats, StreamChunk
from flashspec_core.routing.domains import resolve_domain
from flashspec_core.types import Arm, StepRecord

CHATML = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
TINY_CONTEXT = 4096


@functools.lru_cache(maxsize=1)
def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, plus ChatML's two special tokens."""
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>",
        eos_token="<|im_end|>", pad_token="<|im_end|>",
    )
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    tok.chat_template = CHATML
    return tok


@functools.lru_cache(maxsize=1)
def tiny_engine() -> SpecEngine:
    """The real engine over a tiny random model (greedy output is deterministic)."""
    tok = char_tokenizer()
    model = tiny_llama(len(tok), seed=0, eos_id=tok.eos_token_id, max_positions=TINY_CONTEXT)
    return SpecEngine(LoadedModel(model, tok, "tiny-char"), default_drafts(), router="thompson")


class ScriptedEngine:
    """Answers call i with `script[i]`; records every call's prompt text and arguments."""

    def __init__(self, script: Sequence[str]):
        self.script = list(script)
        self.calls: list[dict] = []
        self.tokenizer = char_tokenizer()
        self.context_window = TINY_CONTEXT
        self.model_name = "scripted"

    def _answer(self, prompt, max_new_tokens, sampling, stop, domain, hint) -> tuple[str, GenerationStats, list[int]]:
        text_prompt = self.tokenizer.decode(prompt)
        self.calls.append({
            "prompt": text_prompt, "max_new_tokens": max_new_tokens, "sampling": sampling,
            "stop": list(stop or []), "domain": domain, "hint": hint,
        })
        if not self.script:
            raise AssertionError("the scripted engine ran out of answers: the agent made an extra call")
        text = self.script.pop(0)
        for s in stop or ():
            if s in text:
                text = text[: text.index(s)]
        ids = self.tokenizer(text, add_special_tokens=False).input_ids[:max_new_tokens]
        text = self.tokenizer.decode(ids)
        stats = GenerationStats(resolve_domain(domain, hint, text_prompt), prompt_tokens=len(prompt))
        stats.records.append(StepRecord(stats.domain, Arm("prompt_lookup", 4), 4, 3, len(ids), 0.0, 0.0))
        stats.drafted, stats.accepted = 4, 3
        return text, stats, ids

    def generate(self, prompt, max_new_tokens=128, sampling=None, stop=None, domain=None, hint=None):
        text, stats, ids = self._answer(prompt, max_new_tokens, sampling, stop, domain, hint)
        return GenerationResult(text, ids, "stop", stats, prompt_tokens=len(prompt))

    def stream(self, prompt, max_new_tokens=128, sampling=None, stop=None, domain=None, hint=None) -> Iterator[StreamChunk]:
        text, stats, ids = self._answer(prompt, max_new_tokens, sampling, stop, domain, hint)
        for i, tok in enumerate(ids[:-1]):
            yield StreamChunk(self.tokenizer.decode([tok]), [tok])
        last = ids[-1:]
        yield StreamChunk(self.tokenizer.decode(last), last, "stop", stats)
