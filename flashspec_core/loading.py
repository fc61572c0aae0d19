"""Load an engine's models by name: the target, the draft pool (model drafts included), and the γ offered.

Kept apart from the decode loop so that the loop never needs to know how a draft was built.
The embedded default target is loaded once per process and shared by every default engine.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from flashspec_core.constrained.forced_draft import GrammarForcedDraft
from flashspec_core.drafts import DraftSource, ModelDraft, PromptLookupDraft, SuffixCacheDraft
from flashspec_core.drafts.base import check_draft
from flashspec_core.models import LoadedModel, check_vocab, load_model

# Names accepted in `drafts=[...]`; anything else is taken as a model path or cached HF id.
DRAFT_NAMES = ("prompt_lookup", "suffix_cache", "grammar", "nf4")

_loaded: dict[tuple, LoadedModel] = {}
_loaded_lock = threading.Lock()


def load_target(
    target: str | None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    load_in_4bit: bool = False,
) -> LoadedModel:
    """Load (or reuse, within this process) a target model."""
    key = (str(target), str(device), str(dtype), load_in_4bit)
    with _loaded_lock:
        if key not in _loaded:
            _loaded[key] = load_model(target, device=device, dtype=dtype, load_in_4bit=load_in_4bit)
        return _loaded[key]


def _model_draft(loaded: LoadedModel, target: LoadedModel, name: str) -> ModelDraft:
    check_vocab(target.model, loaded.model, name)
    pad = target.tokenizer.pad_token_id or 0
    return ModelDraft(loaded.model, name=name, pad_token_id=pad)


def build_drafts(
    specs: Sequence[str | DraftSource] | None,
    target: LoadedModel,
    target_spec: str | None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> list[DraftSource]:
    """Draft sources from names, paths or ready objects; None gives the default pool.

    "nf4" is an NF4 (bitsandbytes 4-bit) copy of the target: it shares the tokenizer by
    construction and runs faster than the full-precision target.
    """
    if specs is None:
        return default_drafts(target)
    pool: list[DraftSource] = []
    for spec in specs:
        if not isinstance(spec, str):
            pool.append(check_draft(spec, "drafts (a draft name or a DraftSource)"))
        elif spec == "prompt_lookup":
            pool.append(PromptLookupDraft())
        elif spec == "suffix_cache":
            pool.append(SuffixCacheDraft())
        elif spec == "grammar":
            pool.append(GrammarForcedDraft())
        elif spec == "nf4":
            pool.append(_model_draft(load_target(target_spec, device, dtype, load_in_4bit=True), target, "nf4"))
        else:
            try:
                loaded = load_target(spec, device, dtype)
            except ValueError as exc:
                raise ValueError(
                    f"drafts: unknown draft {spec!r}; use one of {list(DRAFT_NAMES)}, a model path, "
                    "a .gguf file or a cached HF id"
                ) from exc
            pool.append(_model_draft(loaded, target, spec))
    return pool


# The γ of every draft's arms. A CPU pays for each drafted token in verify time (calibration
# measures how much); on a GPU a graphed pass over 17 tokens costs about what one over 2 does, so
# γ = 16 costs nothing extra where a copy runs long.
CPU_GAMMAS = (2, 4, 8)
GPU_GAMMAS = (2, 4, 8, 16)


def default_gammas(target: LoadedModel) -> tuple[int, ...]:
    """The γ an engine over `target` offers each draft when none are given: see GPU_GAMMAS."""
    on_cuda = target.model.get_output_embeddings().weight.device.type == "cuda"
    return GPU_GAMMAS if on_cuda else CPU_GAMMAS


def default_drafts(target: LoadedModel | None = None) -> list[DraftSource]:
    """The default pool: copy drafts, which cost next to nothing to run, the grammar-forced draft
    (it proposes only under a `json_schema`), plus, on the CPU, the shipped trained drafts
    (flashspec_core/drafts/weights) that were made for `target`.

    On a GPU the trained drafts are left out: their token-by-token loop syncs with the host per
    drafted token, which costs more than the graphed target's whole step, so they run below plain
    decoding there. Pass them in `drafts=` to use them anyway.
    """
    pool: list[DraftSource] = [PromptLookupDraft(), SuffixCacheDraft(), GrammarForcedDraft()]
    if target is not None and target.model.get_output_embeddings().weight.device.type == "cpu":
        from flashspec_core.drafts.trained import shipped_drafts

        pool += shipped_drafts(target)
    return pool


