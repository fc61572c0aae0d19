"""What a user would run instead of this engine, for the demo and the benchmarks to race against.

- `hf_generate`: transformers' `generate` (greedy) on a stock copy of the model.
- `LlamaCppGreedy`: llama-cpp-python's own `Llama.generate` on the same GGUF file, greedy, flash
  attention on (as the engine's llama.cpp runner), reusing the prompt prefix shared with the
  previous call as `Llama.generate` does. What CPU users run.
- `LlamaCppGreedy(prompt_lookup=k)`: the same with llama-cpp-python's `LlamaPromptLookupDecoding`.

Every runner maps (prompt token ids, max new tokens) to the new token ids, stopping after EOS.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel


def stock_default_model() -> PreTrainedModel:
    """A fresh copy of the default target as transformers builds it, for the HF baselines.

    The engine swaps the CPU linear layers of the model it runs (cpu_linear.py), so the baseline
    must not share that object: it measures stock transformers.
    """
    from flashspec_core.models import load_model

    return load_model(None).model


def hf_generate(model: PreTrainedModel, ids: Sequence[int], max_new_tokens: int, pad_token_id: int,
                **generate_kwargs: Any) -> tuple[list[int], float]:
    """Plain HF `generate` (greedy) of `model` on prompt token ids; returns (new tokens, seconds).

    `generate_kwargs` reach `generate` (e.g. `prompt_lookup_num_tokens` for HF's assisted mode).
    """
    inputs = torch.tensor([list(ids)], device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs,  # type: ignore[operator]  # transformers types generate loosely
                             attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_token_id, **generate_kwargs)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


class LlamaCppGreedy:
    """llama-cpp-python decoding a GGUF file greedily, as a CPU user runs it.

    gguf: the model file. eos_ids: tokens that end a reply. prompt_lookup: draft length of
    llama-cpp-python's own prompt-lookup speculation (0: plain decoding).
    """

    def __init__(self, gguf: str | Path, eos_ids: Iterable[int], n_ctx: int = 8192, prompt_lookup: int = 0,
                 one_token_threads: int | None = None):
        """one_token_threads: threads of one-token steps (default: every thread, llama.cpp's own
        default); 1 reproduces the engine's llama.cpp runner bit for bit (its module says why)."""
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from flashspec_core.backends import llama_cpp as runner

        runner.load_cpu_backends()  # the same CPU kernels the engine's runner loads
        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) if prompt_lookup else None
        threads = torch.get_num_threads()
        # With a draft model llama-cpp-python keeps every position's logits (its `_logits_all`), but
        # sizes that buffer from the `logits_all` argument: left False, a prompt past n_batch (512)
        # tokens failed with "could not broadcast input array" (0.3.36). Asked for, it holds n_ctx rows.
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=one_token_threads or threads,
                         n_threads_batch=threads, flash_attn=True, verbose=False, draft_model=draft,
                         logits_all=draft is not None)
        self.eos_ids = frozenset(eos_ids)

    def __call__(self, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float]:
        start = time.perf_counter()
        out: list[int] = []
        for token in self.llm.generate(list(ids), top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if token in self.eos_ids or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - start
