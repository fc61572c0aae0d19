"""One engine per engine setting, per process, shared by every adapter instance of either framework.

Both adapters resolve their engine here on first use (construction never loads weights): models
built with the same target, drafts, router and device share one `SpecEngine`, so the weights load
once and the router's statistics keep growing across them, where a second engine would load a
second copy and split what the router learns.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from flashspec_core import SpecEngine

# What `SpecEngine.from_default()` loads (flashspec_core.models names it the same).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class EngineSettings:
    """The settings that pick an engine; equal settings get the same engine object."""

    target: str | None = None
    drafts: tuple[str, ...] | None = None
    router: str = "thompson"
    device: str | None = None

    @property
    def is_default(self) -> bool:
        return self == EngineSettings()

    @property
    def model_name(self) -> str:
        """The target as the user named it (the embedded default's name when none was given)."""
        return self.target or DEFAULT_MODEL_NAME


_engines: dict[EngineSettings, SpecEngine] = {}
_lock = threading.Lock()


def engine_for(settings: EngineSettings) -> SpecEngine:
    """The process-wide engine for `settings`: the embedded default engine for default settings."""
    if settings.is_default:
        return SpecEngine.from_default()
    with _lock:
        if settings not in _engines:
            drafts = list(settings.drafts) if settings.drafts is not None else None
            _engines[settings] = SpecEngine.from_pretrained(
                settings.target, drafts=drafts, router=settings.router, device=settings.device
            )
        return _engines[settings]
