"""Test doubles for the LangChain adapter tests, and the checks that keep them honest.

- `byte_tokenizer()`: a real byte-level BPE tokenizer built in memory (no merges, so every byte is
  a token and any text round-trips) with the default model's ChatML template.
- `tiny_engine()`: a real `SpecEngine` over a tiny random Llama on that tokenizer: the adapter's
  whole path through the real engine (stop strings, streaming, batching, stats) in milliseconds.
- `ScriptedEngine`: replies from a script, for tests that need a model to say something specific
  (a tool call, a JSON object); it records the `domain`/`hint` of every call and resolves them
  with the engine's own `resolve_domain`, so a test sees the label the router would get.
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterator, Sequence

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from flashspec_core import SpecEngine
from flashspec_core.drafts import PromptLookupDraft, SuffixCacheDraft
from flashspec_core.models import LoadedModel
from flashspec_core.results import GenerationResult, GenerationStats, StreamChunk
from flashspec_core.routing.domains import resolve_domain

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|im_end|>"})
    tok.chat_template = CHATML
    return tok


def tiny_engine(seed: int = 0) -> SpecEngine:
    """A real engine over a tiny random Llama (vocab = the byte tokenizer's 258 tokens)."""
    tok = byte_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    # Only lower-case letters, spaces and EOS may come out, so outputs are readable text whose
    # every character is one token (random bytes would decode to replacement characters).
    allowed = [tok.convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyzĠ"] + [tok.eos_token_id]
    head = torch.nn.Linear(32, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(len(tok), 32) * 2.0)
        head.bias.fill_(-1e4)
        head.bias[allowed] = 0.0
        head.bias[tok.eos_token_id] = -4.0  # rare, so outputs are usually several tokens long
    model.lm_head = head
    return SpecEngine(LoadedModel(model, tok, "tiny"), [PromptLookupDraft(), SuffixCacheDraft()], router="thompson")


class ScriptedEngine:
    """An engine stand-in whose replies come from `script` (a list, used in turn, or a function of
    the rendered prompt). Records every call in `calls`: prompt text, domain, hint, the resolved
    router label, and the remaining keyword arguments."""

    def __init__(self, script: Sequence[str] | Callable[[str], str]):
        self.tokenizer = byte_tokenizer()
        self.model_name = "scripted"
        self.script = script
        self.calls: list[dict] = []

    def _reply(self, text: str) -> str:
        if callable(self.script):
            return self.script(text)
        return self.script[min(len(self.calls) - 1, len(self.script) - 1)]

    def stream(self, prompt, max_new_tokens=128, sampling=None, stop=None, domain=None, hint=None) -> Iterator[StreamChunk]:
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        label = resolve_domain(domain, hint, text)
        self.calls.append({"prompt": text, "domain": domain, "hint": hint, "label": label, "stop": stop})
        reply, finish = self._reply(text), "stop"
        cuts = [reply.find(s) for s in ([stop] if isinstance(stop, str) else stop or []) if s in reply]
        if cuts:
            reply = reply[: min(cuts)]
        ids = self.tokenizer(reply, add_special_tokens=False).input_ids
        if len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
            reply = self.tokenizer.decode(ids)
        stats = GenerationStats(label, prompt_tokens=len(prompt), drafted=len(ids), accepted=len(ids) // 2, seconds=0.01)
        pieces = [reply[i : i + 3] for i in range(0, len(reply), 3)] or [""]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield StreamChunk(piece, ids if last else [], finish if last else None, stats if last else None)

    def generate(self, prompt, max_new_tokens=128, sampling=None, stop=None, domain=None, hint=None):
        batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str))
        outs = []
        for p in prompt if batch else [prompt]:
            chunks = list(self.stream(p, max_new_tokens, sampling, stop, domain, hint))
            text = "".join(c.text for c in chunks)
            ids = [t for c in chunks for t in c.token_ids]
            outs.append(GenerationResult(text, ids, chunks[-1].finish_reason, chunks[-1].stats, len(p)))
        return outs if batch else outs[0]


@pytest.mark.parametrize("method", ["stream", "generate"])
def test_scripted_engine_keeps_the_real_engine_signature(method):
    """The adapter is tested against the double; it must not drift from the engine it stands for."""
    real = list(inspect.signature(getattr(SpecEngine, method)).parameters)[1:]
    fake = list(inspect.signature(getattr(ScriptedEngine, method)).parameters)[1:]
    assert fake == real[: len(fake)]
    assert set(real) - set(fake) <= {"json_schema"}


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = 'é <tool_call>\n{"a": 1}\n</tool_call> 名字'
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
