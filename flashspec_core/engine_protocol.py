"""What callers use of an engine, as Protocols: the LangChain and LlamaIndex adapters and the
server call nothing else, so `SpecEngine` and a custom engine passed as `engine=` (a test double,
a remote client) are interchangeable.

They plan a call, then submit or stream it with its `RequestOptions`; they read the tokenizer, the
context window, the model's name and whether the engine decodes under the options' `json_schema`
(`constrains`); the server's planner also reads the model and end tokens it compiles grammars for.
"""
from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from flashspec_core.handle import RequestHandle
    from flashspec_core.options import RequestOptions
    from flashspec_core.prompts import PromptLike
    from flashspec_core.results import StreamChunk


class Engine(Protocol):
    """An engine as the front ends call it (`flashspec_core.SpecEngine` is one)."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def context_window(self) -> int:
        """Tokens a row holds at most: prompt and output together."""
        ...

    @property
    def model_name(self) -> str: ...

    @property
    def constrains(self) -> bool:
        """Whether `submit` decodes under the options' `json_schema`."""
        ...

    def submit(self, prompts: Sequence[PromptLike], options: RequestOptions, /, *,
               stream: bool = False) -> RequestHandle:
        """Queue a request of one row per prompt; its handle is waited on, iterated or cancelled."""
        ...

    def stream(self, prompt: PromptLike, options: RequestOptions, /) -> Generator[StreamChunk, None, None]: ...


class ServedEngine(Engine, Protocol):
    """What the server's planner reads besides: the model and end tokens it compiles grammars for."""

    @property
    def target_model(self) -> PreTrainedModel: ...

    @property
    def eos_ids(self) -> frozenset[int]: ...
