"""Per-step draft routing: domain detection, bandits, the router and its on-disk statistics."""
from flashspec_core.routing.bandits import UCB1, ThompsonSampling, bandit_from_state
from flashspec_core.routing.domains import classify_prompt, resolve_domain
from flashspec_core.routing.router import BanditRouter, FixedRouter
from flashspec_core.routing.store import RouterStore, default_store_path

__all__ = [
    "UCB1",
    "ThompsonSampling",
    "bandit_from_state",
    "BanditRouter",
    "FixedRouter",
    "RouterStore",
    "default_store_path",
    "classify_prompt",
    "resolve_domain",
]
