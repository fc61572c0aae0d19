"""The grammar engine wrapper: JSON schemas (or EBNF) compiled against a tokenizer's vocabulary.

xgrammar (why: docs/constrained.md, "Why xgrammar"), compiled per (tokenizer, schema) and cached in
at most `DEFAULT_CACHE_LIMIT_BYTES` per tokenizer (`set_cache_limit`). JSON is compiled compact
(`", "` and `": "`, no free whitespace) and strict (nothing beyond the schema); the stop tokens are
the engine's EOS ids, so EOS is allowed exactly where the grammar accepts. Given `timeout_s` the
compile runs in a worker process (compile_process.py), killed past the limit (a ValueError) or sent
back compiled. Structural tags (xgrammar's `StructuralTag` in its JSON form; tool_tags.py builds
them) compile here too, with the same settings for every JSON schema inside.
"""
from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from flashspec_core.constrained.compile_process import CompileWorkers

try:
    import xgrammar as xgr
except ImportError:  # pragma: no cover - exercised only without the optional dependency
    xgr = None  # type: ignore[assignment]  # the optional extra: require_xgrammar() says so before use

INSTALL_HINT = "pip install 'flashspec-agents[grammar]'"
JSON_SEPARATORS = (", ", ": ")
DEFAULT_CACHE_LIMIT_BYTES = 256 << 20
STRUCTURAL_TAG = "structural_tag"


# xgrammar's C++ errors start with its logger's prefix, "[08:22:37] /project/cpp/json_schema_converter.cc:5082: ":
# a time and a path inside xgrammar's build, which mean nothing to whoever sent the schema.
_NATIVE_PREFIX = re.compile(r"(?:\[\d{1,2}:\d{2}:\d{2}\]\s*)?[^\s\[\]]+\.(?:cc|cpp|cxx|cu|h|hpp):\d+:\s*")


def _problem(exc: BaseException) -> str:
    """What xgrammar says is wrong, without where in its C++ sources it noticed."""
    return _NATIVE_PREFIX.sub("", str(exc)).strip()


def require_xgrammar() -> None:
    if xgr is None:
        raise ValueError(f"json_schema: constrained decoding needs xgrammar; install it with: {INSTALL_HINT}")


@dataclass(frozen=True)
class Grammar:
    """A grammar compiled against one vocabulary.

    vocab_size: the width V of the logits it masks (the model's output size, which may exceed the
    tokenizer's length). stop_ids: the tokens that end a row, allowed only where the grammar accepts.
    """

    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int
    stop_ids: tuple[int, ...]
    source: str  # what it was built from, for messages

    @classmethod
    def from_ebnf(
        cls, ebnf: str, vocab: Sequence[str], stop_ids: Sequence[int], vocab_size: int | None = None
    ) -> Grammar:
        """An EBNF grammar over a raw vocabulary (token id i decodes to `vocab[i]`); for small tests.

        Stop ids are special tokens: give them any placeholder string in `vocab`.
        """
        require_xgrammar()
        size = len(vocab) if vocab_size is None else vocab_size
        info = xgr.TokenizerInfo(
            list(vocab), vocab_type=xgr.VocabType.RAW, vocab_size=size, stop_token_ids=list(stop_ids)
        )
        try:
            compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf)
        except RuntimeError as exc:
            raise ValueError(f"ebnf: the grammar does not compile: {_problem(exc)}") from exc
        return cls(compiled, size, tuple(stop_ids), "ebnf")


@dataclass
class _Compilers:
    """What compiles for one vocabulary: the in-process compiler, and the worker processes of
    compiles with a time limit (started at their first use)."""

    info: Any  # xgrammar.TokenizerInfo
    compiler: Any  # xgrammar.GrammarCompiler, caching what it compiles
    cache_limit_bytes: int
    _workers: CompileWorkers | None = None

    def workers(self) -> CompileWorkers:
        if self._workers is None:
            self._workers = CompileWorkers(self.info.serialize_json(), COMPILE_WORKERS,
                                           max(1, self.cache_limit_bytes // COMPILE_WORKERS))
        return self._workers

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()


class _CompilerCache:
    """One xgrammar compiler per (tokenizer, V, stop ids); the compiler caches compiled schemas.

    Building the vocabulary info takes ~0.5 s for a 49k vocabulary, so it is done once per
    tokenizer; tokenizers are held weakly so that a dropped model frees its compiler too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.limit_bytes = DEFAULT_CACHE_LIMIT_BYTES
        # id(tokenizer) -> (weak reference, {(V, stop ids): compiler}); keyed by id because a
        # tokenizer class need not be hashable.
        self._by_id: dict[int, tuple[weakref.ref, dict]] = {}

    def set_limit(self, limit_bytes: int) -> None:
        """Compilers built from now on cache at most `limit_bytes`; the present ones are dropped."""
        with self._lock:
            self.limit_bytes = limit_bytes
            dropped, self._by_id = self._by_id, {}
        for _, per in dropped.values():
            for entry in per.values():
                entry.close()

    def size_bytes(self) -> int:
        with self._lock:
            return sum(c.compiler.get_cache_size_bytes() for _, per in self._by_id.values() for c in per.values())

    def get(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> _Compilers:
        with self._lock:
            entry = self._by_id.get(id(tokenizer))
            if entry is None or entry[0]() is not tokenizer:
                self._by_id = {k: v for k, v in self._by_id.items() if v[0]() is not None}
                entry = self._by_id[id(tokenizer)] = (weakref.ref(tokenizer), {})
            per = entry[1]
            key = (vocab_size, stop_ids)
            if key not in per:
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
                )
                compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True,
                                               cache_limit_bytes=self.limit_bytes)
                per[key] = _Compilers(info, compiler, self.limit_bytes)
            return per[key]


COMPILE_WORKERS = 2  # processes that run compiles with a time limit, per vocabulary
JSON_SCHEMA_KIND = "json_schema"
_compilers = _CompilerCache()


def compile_workers(tokenizer: Any, vocab_size: int, stop_ids: Collection[int]) -> CompileWorkers:
    """The worker processes of compiles with a time limit for this vocabulary, started at the first
    call (a server starts them ahead of its first request: `wait_ready`)."""
    require_xgrammar()
    return _compilers.get(tokenizer, vocab_size, _stops(stop_ids)).workers()


def set_cache_limit(limit_bytes: int) -> None:
    """Bound the compiled-grammar cache of each tokenizer to `limit_bytes` (default
    `DEFAULT_CACHE_LIMIT_BYTES`); grammars compiled before are dropped."""
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be a positive int; got {limit_bytes!r}")
    _compilers.set_limit(limit_bytes)


def cache_size_bytes() -> int:
    """The bytes the compiled-grammar caches hold now, summed over tokenizers."""
    return _compilers.size_bytes()


def _schema_text(schema: dict | str) -> str:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema: not valid JSON ({exc}); pass a dict or a JSON string") from exc
    else:
        parsed = schema
    if not isinstance(parsed, dict):
        raise ValueError(
            f"json_schema: a JSON schema is an object (dict); got {type(parsed).__name__}. "
            'For plain JSON mode pass {"type": "object"}'
        )
    try:
        return json.dumps(parsed)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema: not JSON-serialisable ({exc})") from exc


def compile_text(compiler: Any, kind: str, text: str) -> Any:
    """xgrammar's CompiledGrammar of `text`, a JSON schema (kind "json_schema") or a structural tag
    (kind STRUCTURAL_TAG) as JSON text; ValueError naming `json_schema` when xgrammar refuses it.
    The one compile step, run in this process or in a worker (compile_process.py)."""
    if kind == STRUCTURAL_TAG:
        compacted = _compacted(text)  # ValueError naming the schema xgrammar cannot compile
        try:
            return compiler.compile_structural_tag(compacted)
        except Exception as exc:  # xgrammar raises its own error types and pydantic's for a bad tag
            raise ValueError(f"json_schema: xgrammar cannot compile this structural tag: {_problem(exc)}") from exc
    try:
        return compiler.compile_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"json_schema: xgrammar cannot compile this schema: {_problem(exc)}") from exc


def _check_timeout(timeout_s: float | None) -> None:
    if timeout_s is not None and (isinstance(timeout_s, bool) or not timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None; got {timeout_s!r}")


def _stops(stop_ids: Collection[int]) -> tuple[int, ...]:
    stops = tuple(sorted(set(int(s) for s in stop_ids)))
    if not stops:
        raise ValueError("json_schema: the model has no EOS token, so a constrained row could never end")
    return stops


def _compile(kind: str, text: str, tokenizer: Any, vocab_size: int, stops: tuple[int, ...],
             timeout_s: float | None) -> Grammar:
    """`text` compiled here (no limit) or in a worker process killed past `timeout_s`.

    Raises ValueError (refused, or past the limit) or compile_process.CompileBusy (every worker
    stayed busy with other compiles for the whole limit).
    """
    entry = _compilers.get(tokenizer, vocab_size, stops)
    if timeout_s is None:
        return Grammar(compile_text(entry.compiler, kind, text), vocab_size, stops, kind)
    try:
        serialized = entry.workers().compile(kind, text, timeout_s)
    except TimeoutError:
        raise ValueError(
            f"json_schema: compiling the schema took longer than {timeout_s:g} s; simplify it (fewer "
            "optional properties, alternatives, nesting levels or pattern repetitions)"
        ) from None
    return Grammar(xgr.CompiledGrammar.deserialize_json(serialized, entry.info), vocab_size, stops, kind)


def compile_json_schema(
    schema: dict | str, tokenizer: Any, vocab_size: int, stop_ids: Collection[int], timeout_s: float | None = None
) -> Grammar:
    """Compile a JSON schema (dict or JSON text) for an HF tokenizer; ValueError naming `json_schema`.

    timeout_s: the longest the compile may take (None: as long as it takes, in this process); a
    compile past it is killed with its worker process (module docstring).
    """
    require_xgrammar()
    _check_timeout(timeout_s)
    text = _schema_text(schema)
    return _compile(JSON_SCHEMA_KIND, text, tokenizer, vocab_size, _stops(stop_ids), timeout_s)


def is_structural_tag(spec: Any) -> bool:
    """Whether `spec` is a structural tag in xgrammar's JSON form (no JSON schema has this type)."""
    return isinstance(spec, dict) and spec.get("type") == STRUCTURAL_TAG


def _compact_json_ebnf(schema: Any) -> str:
    """The EBNF of a JSON schema compiled as `compile_json_schema` compiles it."""
    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(
            f"json_schema: xgrammar cannot compile a schema inside the structural tag: {_problem(exc)}"
        ) from exc
    return str(grammar)


def _compact(fmt: Any) -> Any:
    """A structural tag's formats with every JSON-style `json_schema` format replaced by the compact
    grammar of its schema (xgrammar's own JSON format allows free whitespace)."""
    if isinstance(fmt, list):
        return [_compact(f) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    if fmt.get("type") == "json_schema" and fmt.get("style", "json") == "json" and not fmt.get("any_order"):
        return {"type": "grammar", "grammar": _compact_json_ebnf(fmt.get("json_schema", True))}
    return {k: _compact(v) for k, v in fmt.items()}


@functools.lru_cache(maxsize=256)
def _compacted(spec_text: str) -> str:
    """A structural tag's JSON text with its JSON schemas compacted (one conversion per distinct tag:
    agent loops send the same tools every step)."""
    spec = json.loads(spec_text)
    return json.dumps({**spec, "format": _compact(spec.get("format"))})


def compile_structural_tag(
    spec: dict, tokenizer: Any, vocab_size: int, stop_ids: Collection[int], timeout_s: float | None = None
) -> Grammar:
    """Compile a structural tag (xgrammar's JSON form, a dict) for an HF tokenizer; ValueError
    naming `json_schema` when xgrammar refuses it. timeout_s: as `compile_json_schema`'s."""
    require_xgrammar()
    _check_timeout(timeout_s)
    stops = _stops(stop_ids)
    try:
        spec_text = json.dumps(spec, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema: the structural tag is not JSON-serialisable ({exc})") from exc
    return _compile(STRUCTURAL_TAG, spec_text, tokenizer, vocab_size, stops, timeout_s)


def as_grammar(spec: dict | str | Grammar, tokenizer: Any, vocab_size: int, stop_ids: Collection[int],
               timeout_s: float | None = None) -> Grammar:
    """The engine's `json_schema=` argument as a compiled Grammar (a Grammar passes through);
    timeout_s: as `compile_json_schema`'s."""
    if isinstance(spec, Grammar):
        if spec.vocab_size != vocab_size:
            raise ValueError(
                f"json_schema: the Grammar masks {spec.vocab_size} tokens but the model emits "
                f"{vocab_size}; compile it with vocab_size={vocab_size}"
            )
        # The grammar ends where it accepts a stop token, the row where it emits an EOS id: a stop
        # id that is not an EOS would leave the row running past the end of the grammar.
        eos = sorted(set(int(s) for s in stop_ids))
        if not spec.stop_ids or not set(spec.stop_ids) <= set(eos):
            raise ValueError(
                f"json_schema: the Grammar's stop ids {list(spec.stop_ids)} must be end-of-sequence "
                f"ids of the model, which are {eos}; build it with stop_ids={eos}"
            )
        return spec
    if not isinstance(spec, (dict, str)):
        raise ValueError(
            f"json_schema: expected a JSON schema (dict or JSON string), a structural tag or a Grammar; "
            f"got {type(spec).__name__}"
        )
    if isinstance(spec, dict) and is_structural_tag(spec):
        return compile_structural_tag(spec, tokenizer, vocab_size, stop_ids, timeout_s)
    return compile_json_schema(spec, tokenizer, vocab_size, stop_ids, timeout_s)
