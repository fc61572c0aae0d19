"""Schemas from others cannot hold a caller for long nor fill memory: compiles are bounded in time
(`timeout_s`) and the compiled-grammar cache in bytes (`set_cache_limit`)."""
from __future__ import annotations

import itertools
import time

import pytest

from flashspec_core.constrained.grammar import (
    DEFAULT_CACHE_LIMIT_BYTES,
    cache_size_bytes,
    compile_json_schema,
    set_cache_limit,
)
from flashspec_core.models import vocab_size

pytestmark = pytest.mark.slow

_fresh = itertools.count()


def schema(properties: int) -> dict:
    """An object of optional properties with names no earlier call used (so never a cache hit)."""
    tag = next(_fresh)
    return {"type": "object", "properties": {f"p{tag}_{i}": {"type": "string"} for i in range(properties)}}


@pytest.fixture
def compile_(default_target):
    eos = default_target.tokenizer.eos_token_id
    return lambda s, **kw: compile_json_schema(s, default_target.tokenizer, vocab_size(default_target.model), [eos], **kw)


def test_a_compile_past_its_time_limit_is_a_value_error_and_finishes_in_the_background(compile_):
    compile_(schema(1))  # the tokenizer's compiler is built once, outside the timed call
    slow = schema(600)  # about a second to compile on a CPU: optional properties cost about n**3
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"json_schema: compiling the schema took longer than 0.05 s; simplify"):
        compile_(slow, timeout_s=0.05)
    assert time.perf_counter() - start < 0.5  # the caller did not wait for the compile
    deadline = time.monotonic() + 30
    while True:  # the compile went on and caches its grammar: a later call finds it at once
        try:
            assert compile_(slow, timeout_s=0.05).vocab_size > 0
            break
        except ValueError:
            assert time.monotonic() < deadline, "the compile never finished"
    assert compile_(schema(3), timeout_s=5).source == "json_schema"  # an ordinary schema is unaffected
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        compile_(schema(1), timeout_s=0)


def test_the_compiled_grammar_cache_stays_within_its_byte_limit(compile_):
    limit = 256 << 10  # about seven small schemas (~36 KB each on the default vocabulary)
    set_cache_limit(limit)
    try:
        sizes = []
        for _ in range(20):
            compile_({"type": "object", "properties": {**schema(6)["properties"], "n": {"type": "integer"}}})
            sizes.append(cache_size_bytes())
        assert max(sizes) <= limit, sizes
        assert sizes[5] > sizes[0]  # it does cache, up to the limit
    finally:
        set_cache_limit(DEFAULT_CACHE_LIMIT_BYTES)
    with pytest.raises(ValueError, match="limit_bytes must be a positive int"):
        set_cache_limit(0)
