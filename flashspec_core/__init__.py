"""flashspec_core: exact, adaptive speculative decoding.

    from flashspec_core import SpecEngine, SamplingParams
    engine = SpecEngine.from_default()
    print(engine.generate("Hello", max_new_tokens=32).text)
"""
from flashspec_core.engine import SpecEngine
from flashspec_core.results import GenerationResult, GenerationStats, StreamChunk
from flashspec_core.sampling import SamplingParams

__all__ = ["SpecEngine", "SamplingParams", "GenerationResult", "GenerationStats", "StreamChunk"]
__version__ = "0.1.0"
