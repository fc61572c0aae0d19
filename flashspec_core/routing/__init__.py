"""Per-step draft routing: domain detection, bandits, the router and its on-disk statistics."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from flashspec_core.arms import Arm
from flashspec_core.drafts.base import DraftSource
from flashspec_core.routing.bandits import UCB1, ThompsonSampling, bandit_from_state
from flashspec_core.routing.base import Router
from flashspec_core.routing.domains import classify_prompt, resolve_domain
from flashspec_core.routing.fixed import FixedRouter
from flashspec_core.routing.router import ALGORITHMS, BanditRouter
from flashspec_core.routing.store import RouterStore, default_store_path

ROUTER_NAMES = (*ALGORITHMS, "fixed")


def make_router(name: str, arms: Sequence[Arm], drafts: Mapping[str, DraftSource], persist: bool = False) -> Router:
    """A router by name; `persist` keeps its statistics in the SQLite store across restarts."""
    if name not in ROUTER_NAMES:
        raise ValueError(f"router must be one of {list(ROUTER_NAMES)} or a Router object; got {name!r}")
    if name == "fixed":
        speculative = [a for a in arms if a.gamma > 0]
        return FixedRouter(speculative[len(speculative) // 2] if speculative else arms[0])
    free = {n: d for n, d in drafts.items() if d.deterministic}
    return BanditRouter(arms, algorithm=name, free_drafts=free, store=RouterStore() if persist else None)


__all__ = [
    "UCB1",
    "ThompsonSampling",
    "bandit_from_state",
    "Router",
    "BanditRouter",
    "FixedRouter",
    "RouterStore",
    "default_store_path",
    "classify_prompt",
    "resolve_domain",
    "make_router",
    "ROUTER_NAMES",
]
