"""Prompts in the three forms the engine takes: raw text, chat messages, or token ids.

Chat messages go through the target's own chat template (with the generation prompt added), so
the model sees exactly the format it was trained on.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard, cast

from transformers import PreTrainedTokenizerBase

PromptLike = str | Sequence[dict] | Sequence[int]


def _is_messages(obj: Any) -> TypeGuard[Sequence[dict]]:
    return isinstance(obj, (list, tuple)) and len(obj) > 0 and all(isinstance(m, dict) for m in obj)


def _is_ids(obj: Any) -> TypeGuard[Sequence[int]]:
    return (isinstance(obj, (list, tuple)) and len(obj) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in obj))


def is_batch(prompt: Any) -> bool:
    """A list of prompts (strings, message lists or id lists), as opposed to one prompt."""
    return isinstance(prompt, (list, tuple)) and not _is_messages(prompt) and not _is_ids(prompt) and (
        len(prompt) == 0 or all(isinstance(p, (str, list, tuple)) for p in prompt)
    )


def render_messages(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], **template_kwargs: Any) -> str:
    for i, m in enumerate(messages):
        if "role" not in m:
            raise ValueError(f"prompt: message {i} has no 'role'; chat messages are dicts with 'role' and 'content'")
    if tokenizer.chat_template is None:
        raise ValueError("prompt: chat messages need a tokenizer with a chat template; pass a string instead")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **template_kwargs)
    return cast(str, text)  # tokenize=False: the rendered string


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: PromptLike) -> str:
    """The prompt as text, for domain detection."""
    if isinstance(prompt, str):
        return prompt
    if _is_messages(prompt):
        return "\n".join(str(m.get("content") or "") for m in prompt)
    if _is_ids(prompt):
        return cast(str, tokenizer.decode(list(prompt)))  # one sequence: one string
    return ""


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: PromptLike, vocab_size: int) -> list[int]:
    """Token ids of one prompt; ValueError naming `prompt` for anything empty or malformed."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: empty string; pass some text, chat messages or token ids")
        ids = tokenizer(prompt).input_ids
    elif _is_messages(prompt):
        ids = tokenizer(render_messages(tokenizer, prompt), add_special_tokens=False).input_ids
    elif _is_ids(prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids must be in [0, {vocab_size}); got {bad[:5]}")
    else:
        raise ValueError(
            "prompt: expected a non-empty string, a list of chat messages ({'role', 'content'} dicts) "
            f"or a list of token ids; got {type(prompt).__name__} {str(prompt)[:60]!r}"
        )
    if not ids:
        raise ValueError("prompt: it encodes to no tokens; pass some text")
    return ids


class ContextLengthError(ValueError):
    """A prompt, or a prompt plus `max_new_tokens`, does not fit what one row may hold: the model's
    context window, or less where the engine's memory plan gives a row less (memory_plan.py).
    Raised when the request is submitted, never mid-decode; the server answers it with a 400 whose
    code is `context_length_exceeded`, as OpenAI's API does."""


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[PromptLike], vocab_size: int,
                   max_new_tokens: int, context_window: int, limit: str = "") -> list[list[int]]:
    """Token ids of each prompt; ContextLengthError naming the argument when a prompt, or a prompt
    plus `max_new_tokens`, does not fit `context_window` tokens (nothing is truncated silently).
    limit: what that bound is and how to raise it, for the message (default: the model's context window)."""
    limit = limit or f"the model's context window of {context_window} tokens"
    encoded = [encode_prompt(tokenizer, p, vocab_size) for p in prompts]
    for ids in encoded:
        if len(ids) >= context_window:
            raise ContextLengthError(f"prompt: {len(ids)} tokens leave no room for new tokens in {limit}; "
                                     "shorten the prompt")
        if len(ids) + max_new_tokens > context_window:
            raise ContextLengthError(
                f"max_new_tokens: the prompt has {len(ids)} tokens, so at most {context_window - len(ids)} "
                f"new tokens fit {limit}; lower max_new_tokens (max_tokens) to {context_window - len(ids)} "
                "or shorten the prompt")
    return encoded
