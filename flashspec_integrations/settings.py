"""The constructor fields both adapters share: one name and one meaning for each setting.

`ChatFlashSpec`, LangChain's `FlashSpecLLM` and LlamaIndex's `FlashSpecLLM` all inherit these, so
`target=`, `drafts=`, `max_tokens=` (or `max_new_tokens=`), `temperature=`, `domain=`, `timeout=` ...
read the same in either framework, take the same call keywords (`check_call_kwargs`), serialise the
same (everything but a ready `engine` object), and resolve their engine through the same
process-wide cache (`engines.engine_for`).
"""
from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from flashspec_core import SamplingParams
from flashspec_core.engine_protocol import Engine
from flashspec_integrations.engines import EngineSettings, engine_for

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "no_repeat_ngram_size")
# OpenAI's additive penalties: frameworks pass them (often as 0); the engine has HF's penalties.
OPENAI_PENALTIES = ("frequency_penalty", "presence_penalty")
DECODING_KWARGS = frozenset({"max_tokens", "max_new_tokens", "stop", "domain", *SAMPLING_FIELDS, *OPENAI_PENALTIES})
_ENGINE_FIELDS = ("target", "model", "drafts", "router", "device")  # `model` is a name of target


class FlashSpecFields(BaseModel):
    """Engine, decoding and routing settings of an adapter model; the engine loads on first use."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, extra="forbid")

    target: str | None = Field(
        None, validation_alias=AliasChoices("target", "model"),
        description="the target: a .gguf file, a local folder or a cached HF id; None is the embedded "
        "SmolLM2-135M-Instruct (`model=` is accepted as a name for it)",
    )
    drafts: list[str] | None = Field(None, description="draft names or paths; None is the default pool")
    router: str = Field("thompson", description="router name (flashspec_core.routing.ROUTER_NAMES)")
    device: str | None = Field(None, description="'cpu', 'cuda', ...; None picks one")
    # Typed loosely for pydantic (a Protocol cannot be validated); `get_engine` returns it as an Engine.
    engine: Any = Field(None, exclude=True, description="a ready SpecEngine (or any `Engine`), instead of the four "
                        "settings above")

    max_tokens: int = Field(
        256, gt=0, validation_alias=AliasChoices("max_tokens", "max_new_tokens"),
        description="new tokens per call at most (`max_new_tokens=` is accepted as a name for it)",
    )
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy (the default: reproducible agent steps)")
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1 disables nucleus sampling")
    seed: int | None = Field(None, description="seeds every random draw of a call")
    repetition_penalty: float = Field(1.0, gt=0.0, description="HF's penalty on repeated tokens; 1 disables")
    no_repeat_ngram_size: int = Field(0, ge=0, description="ban repeating an n-gram of the output; 0 disables")
    stop: list[str] | None = Field(
        None, validation_alias=AliasChoices("stop", "stop_sequences"), description="stop strings of every call"
    )

    domain: str | None = Field(None, description="a fixed router domain for every call (run metadata and tags win)")
    domain_per_node: bool = Field(False, description="add the agent node to the domain hint as a sub-key")
    timeout: float | None = Field(
        None, gt=0, description="seconds per call: the engine ends a call past it at its next step boundary (a long "
        "prefill included) and the call raises TimeoutError")

    _resolved: Engine | None = PrivateAttr(None)
    _resolve_lock: Any = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="before")
    @classmethod
    def _one_way_to_name_the_engine(cls, values: Any) -> Any:
        if not isinstance(values, Mapping):
            return values
        if "engine_kwargs" in values:
            raise ValueError(
                "engine_kwargs: pass the engine settings as fields instead: target=, drafts=, router=, device= "
                "(the same names in both adapters)"
            )
        if values.get("engine") is not None and any(values.get(k) is not None for k in _ENGINE_FIELDS):
            raise ValueError(
                "engine: pass either a ready engine= or the settings target=/drafts=/router=/device=, not both")
        return values

    # ----------------------------------------------------------------------------- engine

    def engine_settings(self) -> EngineSettings:
        drafts = tuple(self.drafts) if self.drafts is not None else None
        return EngineSettings(self.target, drafts, self.router, self.device)

    def get_engine(self) -> Engine:
        """The engine: `engine=` if given, else the shared one for these settings (loaded on first use)."""
        if self.engine is not None:
            return cast(Engine, self.engine)
        with self._resolve_lock:
            if self._resolved is None:
                self._resolved = engine_for(self.engine_settings())
            return self._resolved

    @property
    def model_name(self) -> str:
        """What the model is called in traces and responses: the given engine's model, else the target."""
        if self.engine is not None:
            return str(self.get_engine().model_name)
        return self.engine_settings().model_name

    # --------------------------------------------------------------------------- decoding

    def decoding(self, kwargs: Mapping[str, Any]) -> tuple[int, SamplingParams]:
        """max_new_tokens and sampling of one call: call keywords override the fields."""
        for name in OPENAI_PENALTIES:
            value = kwargs.get(name)
            if value is not None and value != 0:
                raise ValueError(
                    f"{name}={value!r}: OpenAI's additive penalties are not implemented by the engine (0 is "
                    "accepted); use repetition_penalty= (HF's, e.g. 1.2) or no_repeat_ngram_size= instead"
                )
        name = "max_new_tokens" if "max_new_tokens" in kwargs and "max_tokens" not in kwargs else "max_tokens"
        max_new = kwargs.get(name, self.max_tokens)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new <= 0:
            raise ValueError(f"{name} must be a positive int; got {max_new!r}")
        # None means "not set" (frameworks pass temperature=None), except for seed, where it is a value.
        fields = {k: kwargs[k] if k in kwargs and (kwargs[k] is not None or k == "seed") else getattr(self, k)
                  for k in SAMPLING_FIELDS}
        try:
            return max_new, SamplingParams(**fields)
        except ValueError as exc:  # pydantic's ValidationError names the field
            raise ValueError(f"sampling arguments {fields}: {exc}") from exc

    def check_call_kwargs(self, kwargs: Mapping[str, Any], allowed: Collection[str] = (),
                          passed_through: Collection[str] = ()) -> None:
        """Reject call keywords that would otherwise be silently ignored: a ValueError naming them
        and the ones a call takes (the decoding keywords and `allowed`; `passed_through` are taken
        without being offered: the framework's own, which need no action)."""
        offered = DECODING_KWARGS | set(allowed)
        unknown = set(kwargs) - offered - set(passed_through)
        if unknown:
            raise ValueError(f"unsupported call arguments {sorted(unknown)}; use {', '.join(sorted(offered))}")

    def stops(self, call_stop: str | Sequence[str] | None, *extra: str) -> list[str]:
        """The field's stop strings, then the call's, then the adapter's own; each once."""
        call = [call_stop] if isinstance(call_stop, str) else list(call_stop or [])
        return list(dict.fromkeys([*(self.stop or []), *call, *extra]))
