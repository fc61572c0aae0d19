"""Where the target's forward runs: transformers eagerly, CUDA graphs, or llama.cpp on the GGUF file.

Every runner implements `TargetRunner` (base.py), so the decode loop, the drafts and the
verifier never know which one runs.
"""
from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from flashspec_core.backends.base import TargetRunner
from flashspec_core.models import LoadedModel

TARGET_BACKENDS = ("auto", "hf", "cuda-graph", "llama.cpp")  # where the target's forward runs


def _device_type(model: PreTrainedModel) -> str:
    return model.get_output_embeddings().weight.device.type


def _quantized(model: PreTrainedModel) -> bool:
    return getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None) is not None


def _graphable(model: PreTrainedModel) -> bool:
    """A Llama-family model on CUDA, full precision or bitsandbytes NF4 (whose 4-bit matmuls the
    static forward calls as the model's own modules, unfused)."""
    from flashspec_core.backends.static_llama import supports

    nf4 = getattr(model, "is_loaded_in_4bit", False)
    return _device_type(model) == "cuda" and supports(model) and (nf4 or not _quantized(model))


def _cpu_static(model: PreTrainedModel) -> bool:
    """A Llama-family model on the CPU, not quantized: `cpu_static.StaticCachedModel` runs it."""
    from flashspec_core.backends.static_llama import supports

    return _device_type(model) == "cpu" and supports(model) and not _quantized(model)


def resolve_backend(backend: str, target: LoadedModel) -> str:
    """The backend "auto" stands for.

    On CUDA: "cuda-graph" (static cache, graph replays; `cuda_graph.py`) for Llama-family models,
    transformers' eager forward otherwise. On the CPU: transformers, also for GGUF targets (over
    a static cache for Llama-family models, `cpu_static.py`).
    llama.cpp is opt-in (`backend="llama.cpp"`): it decodes one token faster than transformers'
    fp32 forward, but processes prompts more slowly, a verify pass costs several one-token steps,
    and its logits depend on how a prompt was batched (64+ token passes round differently), so a
    repeated greedy request that reuses the cached prefix can come out differently from the first
    (llama.cpp's own prompt cache does the same).
    """
    if backend not in TARGET_BACKENDS:
        raise ValueError(f"backend must be one of {TARGET_BACKENDS}; got {backend!r}")
    if backend == "llama.cpp" and target.gguf is None:
        raise ValueError("backend='llama.cpp' needs a GGUF target (the default model, or a .gguf path)")
    if backend == "cuda-graph" and not _graphable(target.model):
        raise ValueError("backend='cuda-graph' needs a Llama-family model (llama, mistral, qwen2, qwen3) "
                         "on a CUDA device, full precision or NF4 (load_in_4bit); use backend='hf'")
    if backend != "auto":
        return backend
    if _device_type(target.model) == "cuda":
        return "cuda-graph" if _graphable(target.model) else "hf"
    return "hf"


def make_runner(target: LoadedModel, backend: str, pad_token_id: int, context_window: int) -> TargetRunner:
    """A target runner for a resolved backend name."""
    if backend == "llama.cpp":
        from flashspec_core.backends.llama_cpp import LlamaCppModel

        assert target.gguf is not None  # resolve_backend refuses llama.cpp without a GGUF file
        return LlamaCppModel(target.gguf, n_ctx=context_window)
    if backend == "cuda-graph":
        from flashspec_core.backends.cuda_graph import GraphedModel

        return GraphedModel(target.model, pad_token_id)
    return _eager_runner(target.model, pad_token_id, target.gguf)


def _eager_runner(model: PreTrainedModel, pad_token_id: int, gguf: str | Path | None = None) -> TargetRunner:
    """transformers' forward without graphs: on the CPU, a Llama-family model runs over a static
    cache (`cpu_static.py`: no per-step copy of the cache); anything else over `DynamicCache`.
    `gguf`: the file the model was loaded from, whose blocks its linear layers may compute from."""
    if _cpu_static(model):
        from flashspec_core.backends.cpu_static import StaticCachedModel

        return StaticCachedModel(model, pad_token_id, gguf=gguf)
    from flashspec_core.backends.hf import CachedModel

    return CachedModel(model, pad_token_id, gguf=gguf)


def model_runner(model: PreTrainedModel, pad_token_id: int) -> TargetRunner:
    """The runner for a model draft: CUDA graphs where the target would get them, else eager (the
    static cache on the CPU, which spares a small draft's step a copy of its cache)."""
    if _graphable(model):
        from flashspec_core.backends.cuda_graph import GraphedModel

        return GraphedModel(model, pad_token_id)
    return _eager_runner(model, pad_token_id)
