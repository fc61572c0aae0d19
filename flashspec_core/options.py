"""What one call asks of the engine besides its prompts: `RequestOptions`.

`SpecEngine.generate`, `agenerate`, `stream`, `astream` and `submit` take these settings as
keyword arguments (typed by `RequestArgs`) or as one `RequestOptions` (a front end builds it once
per planned call), or both: keywords then override the options' fields. They are checked when the
options are made, before anything is queued: a ValueError naming the argument.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from flashspec_core.processors.sampling import SamplingParams, request_params

if TYPE_CHECKING:
    from flashspec_core.constrained.grammar import Grammar

DEFAULT_MAX_NEW_TOKENS = 128


class RequestArgs(TypedDict, total=False):
    """The keyword arguments a call takes for its `RequestOptions`: the same names and types."""

    max_new_tokens: int
    sampling: SamplingParams | dict[str, Any] | None
    stop: str | Sequence[str] | None
    domain: str | None
    hint: str | None
    json_schema: dict | str | Grammar | None
    timeout: float | None


@dataclass(frozen=True)
class RequestOptions:
    """One call's settings. Once made, `sampling` is a SamplingParams and `stop` a tuple of strings.

    max_new_tokens: the token budget of each row. sampling: a SamplingParams or a dict of its
    fields (None: greedy). stop: a string or strings that end a row (not included in its text).
    domain: the router's domain for the call; hint: a front end's guess at it, which `domain`
    overrides and the prompt classifier stands in for (routing/domains.py).
    json_schema: constrain the output to JSON valid against this schema (a forced tool call,
    structured output; {"type": "object"} for JSON mode), or a structural tag or a compiled
    Grammar: exactly the law of grammar-masked decoding of the target, not its law conditioned on
    a valid output (docs/exactness.md; flashspec_core.constrained).
    timeout: seconds after which the request ends with TimeoutError (checked between steps).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: SamplingParams | dict[str, Any] | None = None
    stop: str | Sequence[str] | None = None
    domain: str | None = None
    hint: str | None = None
    json_schema: dict | str | Grammar | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        sampling, stops = request_params(self.max_new_tokens, self.sampling, self.stop)
        timeout = self.timeout
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None; got {timeout!r}")
        object.__setattr__(self, "sampling", sampling)
        object.__setattr__(self, "stop", stops)

    @property
    def sampling_params(self) -> SamplingParams:
        """`sampling` as the type it always has once made."""
        assert isinstance(self.sampling, SamplingParams)  # set in __post_init__
        return self.sampling

    @property
    def stops(self) -> tuple[str, ...]:
        """`stop` as the tuple it always is once made."""
        assert isinstance(self.stop, tuple)  # set in __post_init__
        return self.stop

    def replace(self, **changes: Any) -> RequestOptions:
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)


def request_options(options: RequestOptions | None, args: RequestArgs) -> RequestOptions:
    """`options` (default: all defaults) with the keyword arguments `args` over it."""
    if options is None:
        return RequestOptions(**args)
    if not isinstance(options, RequestOptions):
        raise TypeError(f"options must be a RequestOptions; got {type(options).__name__} (the settings after the "
                        "prompt are keyword arguments: max_new_tokens=, sampling=, stop=, ...)")
    return options.replace(**args) if args else options
