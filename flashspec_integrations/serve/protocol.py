"""The OpenAI chat-completions wire format, as far as this server speaks it, and its errors.

Requests are validated field by field before anything reaches the engine: a bad one is a 400
naming the field in OpenAI's `{"error": {...}}` body. Types are strict, as OpenAI documents them
(`"stream": "yes"` is refused, not coerced); the one widening kept is JSON's, an integer where a
number is expected. Fields this server cannot honour (`n` > 1, `logprobs`, frequency or presence
penalties) and unknown fields are refused by name. Extra request fields: `domain` (the router's
domain) and `metadata` (`flashspec_domain`, agent-node keys); responses carry an extra `flashspec`
field with the call's router statistics (OpenAI clients keep it: `response.model_extra`).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The engine's lowest temperature (flashspec_core.processors.sampling.MIN_TEMPERATURE; a test keeps
# them equal): this module imports no torch, since the CLI reads the limits through it.
MIN_TEMPERATURE = 0.01


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    """Objects inside messages: clients echo back fields of earlier responses (`refusal`,
    `annotations`, `audio`), which mean nothing to this model and are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCall(_Open):
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


class ToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs 'tool_call_id', the id of the call it answers")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs 'name', the function that was called")
        return self


class FunctionSpec(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Open):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(_Open):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    """POST /v1/chat/completions. Sampling defaults are OpenAI's (temperature 1)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**64, description="an int in [0, 2**64): the engine's seeds")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # The values this server cannot honour are refused by bounds, not Literal: a Literal compares
    # by equality, so it would take `"n": 1.0` or `"logprobs": 0` whatever the strict mode.
    n: int | None = Field(None, ge=1, le=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=0)
    frequency_penalty: float | None = Field(None, ge=0, le=0)
    presence_penalty: float | None = Field(None, ge=0, le=0)
    user: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16, description="OpenAI's rule: 16 pairs at most")
    store: bool | None = None
    domain: str | None = Field(None, min_length=1, description="FlashSpec: the router domain of this call")

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and any(not s for s in ([value] if isinstance(value, str) else value)):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("log-probabilities are not returned")
        return value

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sampled(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}: below it logits / temperature "
                             "overflow; send 0 for greedy decoding")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_as_openai_takes_it(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if len(key) > 64 or len(text) > 512:
                raise ValueError("keys may have at most 64 characters and values at most 512 (OpenAI's rule)")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ----------------------------------------------------------------------------------- responses


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(cid: str, model: str, message: dict, finish_reason: str, usage_: dict, extra: dict) -> dict:
    """A `chat.completion` object; `extra` is the FlashSpec field."""
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage_, "flashspec": extra,
    }


def chunk(cid: str, model: str, delta: dict | None, finish_reason: str | None = None, **extra: Any) -> dict:
    """A `chat.completion.chunk`; `delta=None` gives the choice-less chunk that carries usage."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": choices, **extra}


def model_list(model: str, owner: str = "flashspec") -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": owner}]}


# -------------------------------------------------------------------------------------- errors


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code: the prompt and max_tokens do not fit


class APIError(Exception):
    """An error to send as OpenAI does: HTTP status and a body naming the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# Fields OpenAI defines whose other values this server cannot honour, and what it can do instead.
_UNSUPPORTED = {
    "n": "only n=1 is served; send several requests (they are decoded as one batch)",
    "logprobs": "log-probabilities are not returned; leave logprobs unset or false",
    "top_logprobs": "log-probabilities are not returned; leave top_logprobs unset or 0",
    "frequency_penalty": "not supported (only 0); the engine offers repetition penalty in-process",
    "presence_penalty": "not supported (only 0); the engine offers repetition penalty in-process",
}


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _given(value: Any) -> str:
    """What a client sent, as JSON: the value when it is short, else its type."""
    if isinstance(value, list | dict):
        return "an array" if isinstance(value, list) else "an object"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else f"a string of {len(value)} characters" if isinstance(value, str) else "a number"


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A 400 for pydantic errors (as FastAPI reports them): the first one, with its field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if first.get("type") == "missing" and tuple(first.get("loc", ())) in (("body",), ()):
        return APIError(400, "the request body is empty; send a JSON object with 'model' and 'messages'")
    param = _param(tuple(first.get("loc", ())))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    if param is None:
        return APIError(400, f"the request body must be a JSON object with 'model' and 'messages': {first['msg']}")
    wrong_type = str(first.get("type", "")).endswith("_type")  # int_type, bool_type, ...: strict mode's refusals
    if param in _UNSUPPORTED and not wrong_type:
        return APIError(400, f"{param}: {_UNSUPPORTED[param]}", param)
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}{more}", param)
    given = f", not {_given(first.get('input'))}" if wrong_type else ""
    return APIError(400, f"{param}: {first['msg']}{given}{more}", param)


def parse_request(body: bytes) -> ChatCompletionRequest:
    """The request from raw bytes; APIError(400) naming the field otherwise."""
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None
