"""Assemble an engine's parts from names: the target, the draft pool and the router.

Kept apart from the decode loop so that the loop never needs to know how a draft was built.
The embedded default target is loaded once per process and shared by every default engine.
"""
from __future__ import annotations

import threading
from typing import Mapping, Sequence

import torch

from flashspec_core.constrained.forced_draft import GrammarForcedDraft
from flashspec_core.drafts import DraftSource, ModelDraft, PromptLookupDraft, SuffixCacheDraft
from flashspec_core.models import LoadedModel, check_vocab, load_model
from flashspec_core.types import Arm, Router

# Names accepted in `drafts=[...]`; anything else is taken as a model path or cached HF id.
DRAFT_NAMES = ("prompt_lookup", "suffix_cache", "grammar", "nf4")
ROUTER_NAMES = ("thompson", "ucb1", "thompson-discounted", "ucb1-discounted", "fixed")

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
            if not isinstance(spec, DraftSource):
                raise ValueError(f"drafts: {spec!r} is neither a draft name nor a DraftSource")
            pool.append(spec)
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


def default_drafts(target: LoadedModel | None = None) -> list[DraftSource]:
    """The default pool: copy drafts, which cost next to nothing to run, the grammar-forced draft
    (it proposes only under a `json_schema`), plus the shipped trained drafts
    (flashspec_core/drafts/weights) that were made for `target`."""
    pool: list[DraftSource] = [PromptLookupDraft(), SuffixCacheDraft(), GrammarForcedDraft()]
    if target is not None:
        from flashspec_core.drafts.trained import shipped_drafts

        pool += shipped_drafts(target)
    return pool


def make_router(
    name: str, arms: Sequence[Arm], drafts: Mapping[str, DraftSource], persist: bool = False
) -> Router:
    """A router by name; `persist` keeps its statistics in the SQLite store across restarts."""
    if name not in ROUTER_NAMES:
        raise ValueError(f"router must be one of {list(ROUTER_NAMES)} or a Router object; got {name!r}")
    from flashspec_core.routing.router import BanditRouter, FixedRouter
    from flashspec_core.routing.store import RouterStore

    if name == "fixed":
        speculative = [a for a in arms if a.gamma > 0]
        return FixedRouter(speculative[len(speculative) // 2] if speculative else arms[0])
    free = {n: d for n, d in drafts.items() if d.deterministic}
    return BanditRouter(arms, algorithm=name, free_drafts=free, store=RouterStore() if persist else None)


def default_engine():
    """The embedded target, the default pool, and a Thompson router whose statistics persist."""
    from flashspec_core.engine import DEFAULT_GAMMAS, SpecEngine
    from flashspec_core.types import NO_DRAFT

    target = load_target(None)
    drafts = default_drafts(target)
    arms = [Arm(NO_DRAFT, 0)] + [Arm(d.name, g) for d in drafts for g in DEFAULT_GAMMAS]
    router = make_router("thompson", arms, {d.name: d for d in drafts}, persist=True)
    return SpecEngine(target, drafts, router=router)
