"""One grammar worker process: compiles what its owner sends until the owner goes.

    python -m flashspec_core.constrained.compile_worker FD VOCAB_JSON_PATH CACHE_LIMIT_BYTES

FD is this end of a socket pair, a `multiprocessing.connection.Connection`; VOCAB_JSON_PATH a file
holding the vocabulary (xgrammar's TokenizerInfo as JSON). Each message is a (kind, text) pair for
`grammar.compile_text`, answered with ("ok", the compiled grammar as JSON) or ("error", xgrammar's
refusal). It says READY first, once xgrammar is imported. compile_process.py starts, uses and kills
these.
"""
from __future__ import annotations

import sys
from multiprocessing.connection import Connection
from pathlib import Path

READY = ("ready", "")


def serve(conn: Connection, vocab_path: str, cache_limit_bytes: int) -> None:
    import xgrammar as xgr

    from flashspec_core.constrained.grammar import compile_text

    info = xgr.TokenizerInfo.deserialize_json(Path(vocab_path).read_text())
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True, cache_limit_bytes=cache_limit_bytes)
    conn.send(READY)
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):  # the owner closed its end or exited
            return
        try:
            reply = ("ok", compile_text(compiler, kind, text).serialize_json())
        except ValueError as exc:
            reply = ("error", str(exc))
        try:
            conn.send(reply)
        except OSError:  # the owner gave up on it and closed its end
            return


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), sys.argv[2], int(sys.argv[3]))
