"""Schemas from others cannot hold a caller or a CPU for long nor fill memory: compiles are bounded
in time (`timeout_s`: killed with their worker process past it) and the compiled-grammar cache in
bytes (`set_cache_limit`)."""
from __future__ import annotations

import itertools
import time

import pytest
from helpers import alive

from flashspec_core.constrained.grammar import (
    DEFAULT_CACHE_LIMIT_BYTES,
    cache_size_bytes,
    compile_json_schema,
    compile_workers,
    set_cache_limit,
)
from flashspec_core.models import vocab_size

pytestmark = pytest.mark.slow

_fresh = itertools.count()


def schema(properties: int) -> dict:
    """An object of optional properties with names no earlier call used (so never a cache hit)."""
    tag = next(_fresh)
    return {"type": "object", "properties": {f"p{tag}_{i}": {"type": "string"} for i in range(properties)}}


# Two properties whose regex xgrammar expands for minutes: a few bytes, no end in sight.
ENDLESS = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]{1,20000}"},
                                            "b": {"type": "string", "pattern": "[0-9]{1,20000}"}}}


@pytest.fixture
def compile_(default_target):
    eos = default_target.tokenizer.eos_token_id
    return lambda s, **kw: compile_json_schema(s, default_target.tokenizer, vocab_size(default_target.model), [eos],
                                               **kw)


@pytest.fixture
def workers(default_target):
    pool = compile_workers(default_target.tokenizer, vocab_size(default_target.model),
                           [default_target.tokenizer.eos_token_id])
    assert pool.wait_ready(120), "no grammar worker started"
    return pool


def test_a_compile_past_its_time_limit_is_a_value_error_and_its_process_is_killed(compile_, workers):
    before = set(workers.pids())
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"json_schema: compiling the schema took longer than 1 s; simplify"):
        compile_(ENDLESS, timeout_s=1)
    assert time.perf_counter() - start < 3.0  # the caller waited the limit (1 s), not the compile (minutes)
    killed = before - set(workers.pids())
    assert len(killed) == 1 and not any(alive(pid) for pid in killed)  # nothing goes on compiling it
    start = time.perf_counter()
    assert compile_(schema(3), timeout_s=5).source == "json_schema"  # the other worker takes the next one
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        compile_(schema(1), timeout_s=0)


def test_a_grammar_compiled_in_a_worker_is_the_one_compiled_here(compile_, workers):
    shape = schema(4)
    there, here = compile_(shape, timeout_s=30), compile_(shape)
    assert there.compiled.serialize_json() == here.compiled.serialize_json()
    assert (there.vocab_size, there.stop_ids) == (here.vocab_size, here.stop_ids)
    with pytest.raises(ValueError, match='json_schema: xgrammar cannot compile this schema: Unsupported type "strin"'):
        compile_({"type": "strin"}, timeout_s=30)  # a refusal comes back as it would here


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
