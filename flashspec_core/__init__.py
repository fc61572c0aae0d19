"""flashspec_core: exact, adaptive speculative decoding.

    from flashspec_core import SpecEngine, SamplingParams
    engine = SpecEngine.from_default()
    print(engine.generate("Hello", max_new_tokens=32).text)

Names are imported lazily, so `import flashspec_core` loads neither torch nor transformers.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SpecEngine": "flashspec_core.engine",
    "SamplingParams": "flashspec_core.processors.sampling",
    "RequestOptions": "flashspec_core.options",
    "GenerationResult": "flashspec_core.results",
    "GenerationStats": "flashspec_core.results",
    "StreamChunk": "flashspec_core.results",
}

if TYPE_CHECKING:
    from flashspec_core.engine import SpecEngine as SpecEngine
    from flashspec_core.options import RequestOptions as RequestOptions
    from flashspec_core.processors.sampling import SamplingParams as SamplingParams
    from flashspec_core.results import GenerationResult as GenerationResult
    from flashspec_core.results import GenerationStats as GenerationStats
    from flashspec_core.results import StreamChunk as StreamChunk


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flashspec_core' has no attribute {name!r}")


__all__ = list(_EXPORTS)
__version__ = "0.1.0"
