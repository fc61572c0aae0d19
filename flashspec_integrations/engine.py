"""What the front ends use of an engine: `SpecEngine` has it, and so may a custom engine passed
as `engine=` (a test double, a remote client).

The adapters and the server plan a call (`plan.plan_chat`), then submit or stream it with the
plan's `RequestOptions`; they read the tokenizer, the context window, the model's name and whether
the engine decodes under the options' `json_schema` (`constrains`; where it does not, a forced
call's opening is written for the model and its free output parsed); the server's planner also
reads the model and end tokens it compiles grammars for. Nothing else of the engine is touched, its internals never.
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
