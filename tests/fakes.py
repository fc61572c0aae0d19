"""Test doubles for both adapters' tests (one set), and the checks that keep them honest.

- `byte_tokenizer()`: a real byte-level BPE tokenizer built in memory (no merges, so every byte is
  a token and any text round-trips) with the default model's ChatML template.
- `tiny_engine()`: a real `SpecEngine` over a tiny random Llama on that tokenizer: an adapter's
  whole path through the real engine (template, stop strings, streaming, batching, stats) in
  milliseconds. Its text is noise, so tests compare paths with each other and with the engine.
- `ScriptedEngine`: replies from a script, for tests that need a model to say something specific
  (a tool call, a JSON object); it has the engine's surface (`submit`, `generate` for one prompt or
  a batch, `stream`, each with a `RequestOptions` or its keywords; `tokenizer`, `context_window`,
  `model_name`),
  records every call (prompt text, domain, hint, the label the router would get from the engine's
  own `resolve_domain`, stops, sampling, schema, rows of its request), and replies regardless of
  the schema.
- `UnconstrainedEngine`: a ScriptedEngine that refuses a `json_schema`, as a custom engine may.
"""
from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from flashspec_core import SpecEngine
from flashspec_core.arms import Arm
from flashspec_core.drafts import PromptLookupDraft, SuffixCacheDraft
from flashspec_core.handle import RequestHandle
from flashspec_core.models import LoadedModel
from flashspec_core.options import RequestOptions, request_options
from flashspec_core.records import StepRecord
from flashspec_core.results import GenerationResult, GenerationStats, StreamChunk
from flashspec_core.routing.domains import resolve_domain

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONTEXT = 4096


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


@functools.cache
def tiny_engine(seed: int = 0) -> SpecEngine:
    """A real engine over a tiny random Llama (vocab = the byte tokenizer's 258 tokens), one per seed."""
    tok = byte_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, eos_token_id=tok.eos_token_id,
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
    """An engine stand-in whose replies come from `script`: a list used in turn (its last reply
    repeated) or a function of the rendered prompt."""

    constrains = True  # takes json_schema= (and records it)

    def __init__(self, script: Sequence[str] | Callable[[str], str], model_name: str = "scripted"):
        self.tokenizer = byte_tokenizer()
        self.model_name = model_name
        self.context_window = CONTEXT
        self.script = script
        self.calls: list[dict] = []
        self.batches: list[int] = []
        self.delay = 0.0  # seconds a request takes: past its `timeout` it fails as the engine's would

    def _reply(self, text: str) -> str:
        if callable(self.script):
            return self.script(text)
        return self.script[min(len(self.calls) - 1, len(self.script) - 1)]

    def _answer(self, prompt, options: RequestOptions, batch):
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        label = resolve_domain(options.domain, options.hint, text)
        stops, max_new_tokens = list(options.stops), options.max_new_tokens
        self.calls.append({"prompt": text, "domain": options.domain, "hint": options.hint, "label": label,
                           "stop": stops, "sampling": options.sampling, "max_new_tokens": max_new_tokens,
                           "json_schema": options.json_schema, "batch": batch})
        reply, finish = self._reply(text), "stop"
        cuts = [reply.find(s) for s in stops if s in reply]
        if cuts:
            reply = reply[: min(cuts)]
        ids = self.tokenizer(reply, add_special_tokens=False).input_ids
        if len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
            reply = self.tokenizer.decode(ids)
        n_prompt = len(prompt) if isinstance(prompt, list) else len(self.tokenizer(prompt).input_ids)
        stats = GenerationStats(label, prompt_tokens=n_prompt, drafted=4, accepted=3, seconds=0.01)
        stats.records.append(StepRecord(label, Arm("prompt_lookup", 4), 4, 3, len(ids), 0.0, 0.0))
        return reply, ids, finish, stats

    def submit(self, prompts, options=None, *, stream=False, **args) -> RequestHandle:
        """A request answered at once (after `delay`): its handle is finished when returned."""
        options = request_options(options, args)
        self.batches.append(len(prompts))
        handle = RequestHandle(len(prompts), stream)
        timeout = options.timeout
        if self.delay:
            time.sleep(self.delay if timeout is None else min(self.delay, timeout))
        if timeout is not None and self.delay > timeout:
            for p in prompts:
                self._answer(p, options, len(prompts))
            handle.fail(TimeoutError("the request ran past its timeout; raise timeout or lower max_new_tokens"))
            return handle
        for i, p in enumerate(prompts):
            reply, ids, finish, stats = self._answer(p, options, len(prompts))
            handle.finish(i, GenerationResult(reply, ids, finish, stats, stats.prompt_tokens))
        return handle

    def stream(self, prompt, options=None, **args) -> Iterator[StreamChunk]:
        reply, ids, finish, stats = self._answer(prompt, request_options(options, args), 0)
        pieces = [reply[i: i + 3] for i in range(0, len(reply), 3)] or [""]
        for i, piece in enumerate(pieces):
            piece_ids = self.tokenizer(piece, add_special_tokens=False).input_ids
            if i == len(pieces) - 1:
                yield StreamChunk(piece, piece_ids, finish, stats)
            else:
                yield StreamChunk(piece, piece_ids)

    def generate(self, prompt, options=None, **args):
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (list, str))
        outs = self.submit(list(prompt) if batch else [prompt], options, **args).wait()
        return outs if batch else outs[0]


class UnconstrainedEngine(ScriptedEngine):
    """A scripted engine without schema-constrained decoding, as a custom engine passed as `engine=`
    may be: forced calls then get their opening written for them, and no schema may reach it."""

    constrains = False

    def submit(self, prompts, options=None, *, stream=False, **args) -> RequestHandle:
        options = request_options(options, args)
        if options.json_schema is not None:
            raise TypeError("this engine decodes under no json_schema")
        return super().submit(prompts, options, stream=stream)

    def stream(self, prompt, options=None, **args):
        options = request_options(options, args)
        if options.json_schema is not None:
            raise TypeError("this engine decodes under no json_schema")
        return super().stream(prompt, options)

    def generate(self, prompt, options=None, **args):
        return super().generate(prompt, options, **args)


class LoopWatchingEngine(ScriptedEngine):
    """Produces each stream chunk, and finishes each request, only after the caller's event loop
    has ticked (`ticked`, set by a ticker task): an adapter that blocked the loop while it waited
    on the engine would leave these waits to time out, whatever the machine's load."""

    WAIT_S = 10.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ticked = threading.Event()

    async def tick(self) -> None:
        """The ticker task a test runs beside its calls: marks every turn of its event loop."""
        while True:
            await asyncio.sleep(0.005)
            self.ticked.set()

    def _wait_for_a_tick(self) -> bool:
        self.ticked.clear()
        return self.ticked.wait(self.WAIT_S)

    def stream(self, *args, **kwargs):
        for chunk in super().stream(*args, **kwargs):
            assert self._wait_for_a_tick(), "the event loop stood still while a chunk was produced"
            yield chunk

    def submit(self, prompts, options=None, **kwargs):
        answered = super().submit(prompts, options, **kwargs).wait()
        handle = RequestHandle(len(prompts), kwargs.get("stream", False))

        def finish_later() -> None:
            for _ in range(3):
                if not self._wait_for_a_tick():
                    handle.fail(RuntimeError("the event loop stood still while the request ran"))
                    return
            for i, result in enumerate(answered):
                handle.finish(i, result)

        threading.Thread(target=finish_later, daemon=True).start()
        return handle
