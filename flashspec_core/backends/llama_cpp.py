"""A target whose forward runs in llama.cpp (through `llama-cpp-python`) on the GGUF file as is.

The runner keeps the `TargetRunner` contract (base.py). Rows are llama.cpp sequence ids; one
`llama_decode` call evaluates every row's new tokens (the draft path included) with logits at each
position asked for, and rollback is `llama_memory_seq_rm` by sequence position, as llama.cpp's own
speculative example does. Tokens go in by id, so the engine's tokenizer and chat template apply
unchanged. The target law is llama.cpp's: greedy output equals llama.cpp's own greedy decoding of
the same file (tested), which can differ from transformers' at near-ties. Why: docs/backends.md.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from flashspec_core.backends.base import TargetRunner
from flashspec_core.backends.prefix import common_prefix, longest_holder

INSTALL = (
    "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON\" "
    "pip install 'flashspec-agents[llamacpp]' (builds llama.cpp from source; docs/backends.md, "
    "'Portable build', says why those flags)"
)


MAX_ROWS = 256  # llama.cpp's LLAMA_MAX_SEQ
VARIANT_ENV = "FLASHSPEC_LLAMA_CPU_VARIANT"  # a CPU variant's name ("haswell", ...) to load instead of the best


def available() -> bool:
    """Whether llama-cpp-python is installed (it is imported only when a runner is built)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppModel(TargetRunner):
    """A llama.cpp model and context holding the KV cache of a batch of rows (sequence ids).

    gguf: the model file. n_ctx: tokens the cache holds, all rows together (one unified cache),
    until `limit_cache` bounds each row instead: the context then holds that many for every row.
    n_threads: CPU threads (default: torch's intra-op count, one per core). max_batch: sequence ids
    the context is created for; a larger batch re-creates the context (and drops the cache).
    """

    def __init__(self, gguf: str | Path, n_ctx: int = 4096, n_threads: int | None = None, max_batch: int = 1,
                 n_batch: int = 512):
        if not available():
            raise ValueError(f"backend='llama.cpp' needs llama-cpp-python; install it with: {INSTALL}")
        import llama_cpp as lc

        path = Path(gguf)
        if not path.is_file():
            raise ValueError(f"gguf: {str(path)!r} is not a file")
        self._lc = lc
        _quiet_logs(lc)
        load_cpu_backends()
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self._model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise ValueError(f"gguf: llama.cpp could not load {str(path)!r}")
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self.n_ctx = n_ctx
        self.row_ctx = 0  # tokens each row may hold (`limit_cache`); 0: n_ctx for all rows together
        self.n_batch = n_batch
        self.n_threads = n_threads or torch.get_num_threads()
        self.device = torch.device("cpu")
        self.path = path
        self._ctx: Any = None  # llama_context_p
        self._batch: Any = None  # llama_batch
        self._max_batch = 0
        self.small_pass = 0  # see _probe_small_pass: measured with the first context
        self._make_context(max(1, max_batch))

    # ------------------------------------------------------------------ context and batch

    def _make_context(self, max_batch: int) -> None:
        lc = self._lc
        self._free_context()
        params = lc.llama_context_default_params()
        if self.row_ctx:
            self.n_ctx = self.row_ctx * max_batch
        params.n_ctx = self.n_ctx
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = max_batch
        params.kv_unified = True  # rows share the cells: a batch of short rows fits n_ctx
        # Flash attention on (llama.cpp's own default where supported): each query row is then
        # computed alone, so a verify pass over γ+1 tokens gives bit for bit the logits of γ+1
        # one-token steps. Without it, a 2-token pass moved logits by up to 0.5 against one-token
        # decoding (a different matrix kernel for 2+ query rows), enough to flip near-ties.
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        # One-token passes on one thread. With more, llama.cpp's attention for a single query row
        # splits the cache across threads and sums the parts in another order once the context
        # passes 256 tokens: one-token decoding then differs from a verify pass over the same
        # positions by up to 0.7 in logits (measured), and speculation would change the output.
        # On one thread both compute the same sums (tests/core/backends/test_llama_cpp.py checks it
        # past 256 tokens); passes of 2+ tokens keep every thread.
        params.n_threads = 1
        params.n_threads_batch = self.n_threads
        params.no_perf = True
        ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {params.n_ctx} tokens")
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self._max_batch = max_batch
        self.held: list[list[int]] = [[] for _ in range(max_batch)]
        if not self.small_pass:
            self.small_pass = self._probe_small_pass()

    def _free_context(self) -> None:
        lc = self._lc
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            lc.llama_free(self._ctx)
            self._ctx = None

    def close(self) -> None:
        """Free the context and the model (also done when the object is collected)."""
        self._free_context()
        if getattr(self, "_model", None):
            self._lc.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    # ------------------------------------------------------------------ the runner contract

    def kernels(self) -> tuple[str, ...]:
        """One kernel: calibration only measures what a forward costs per width (the router's prior)."""
        return ("llama.cpp",)

    def use_kernel(self, name: str) -> None:
        if name != "llama.cpp":
            raise ValueError(f"kernel must be 'llama.cpp'; got {name!r}")

    def begin(self, batch_size: int) -> None:
        """As `CachedModel.begin`: a single prompt keeps the previous single prompt's prefix."""
        if batch_size != 1 or len(self.held) != 1:
            self.reset(batch_size)

    def reset(self, batch_size: int) -> None:
        if batch_size > MAX_ROWS:
            raise ValueError(f"prompt: a batch of {batch_size} prompts; backend='llama.cpp' decodes at most "
                             f"{MAX_ROWS} at once (llama.cpp's sequence limit): split the batch")
        if batch_size > self._max_batch:
            self._make_context(batch_size)
        self._lc.llama_memory_clear(self._mem, True)
        self.held = [[] for _ in range(batch_size)]

    def resize(self, rows: int) -> None:
        """Hold `rows` rows (sequence ids); the first min(rows, now) keep their caches. More rows
        than the context was created for re-create it (every row then starts empty)."""
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"rows must be in [1, {MAX_ROWS}] (llama.cpp's sequence limit); got {rows}")
        if rows > self._max_batch:
            self._make_context(rows)
        for row in range(rows, len(self.held)):
            self._rollback(row, 0)
        self.held = self.held[:rows] + [[] for _ in range(rows - len(self.held))]

    def limit_cache(self, row_tokens: int) -> None:
        """Hold `row_tokens` tokens for each row from now on: the context is created for that many
        times its rows (re-created now if it differs), so rows together never fill it mid-request."""
        self.row_ctx = row_tokens
        if self.n_ctx != row_tokens * self._max_batch:
            self._make_context(self._max_batch)

    def prefix_len(self, row: int, sequence: Sequence[int]) -> int:
        return common_prefix(self.held[row], sequence)

    def share_prefix(self, row: int, sequence: Sequence[int]) -> int:
        """`TargetRunner.share_prefix`: the row holding the longest prefix of `sequence`
        (`prefix.longest_holder`) lends its cache cells to row `row` (`llama_memory_seq_cp`: in a
        unified cache the cells are shared, not copied)."""
        best, source = longest_holder(self.held, row, sequence, self.prefix_len(row, sequence))
        if source != row:
            self._rollback(row, 0)
            self._lc.llama_memory_seq_cp(self._mem, source, row, 0, best)
            self.held[row] = list(sequence[:best])
        return best

    def _rollback(self, row: int, keep: int) -> None:
        if keep < len(self.held[row]):
            if not self._lc.llama_memory_seq_rm(self._mem, row, keep, -1):
                raise RuntimeError("llama.cpp could not roll back this model's cache by position")
            del self.held[row][keep:]

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Evaluate at most n_batch (token, position, row, wants logits) items in one call.

        Returns [n_out, V] float32: the logits of the items that want them, in item order.
        """
        lc = self._lc
        batch = self._batch
        n = len(items)
        arr = np.asarray(items, dtype=np.int64)  # [n, 4]
        np.ctypeslib.as_array(batch.token, shape=(n,))[:] = arr[:, 0]
        np.ctypeslib.as_array(batch.pos, shape=(n,))[:] = arr[:, 1]
        np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))[:] = 1
        np.ctypeslib.as_array(batch.logits, shape=(n,))[:] = arr[:, 3]
        for i, row in enumerate(arr[:, 2].tolist()):
            batch.seq_id[i][0] = row
        batch.n_tokens = n
        rc = lc.llama_decode(self._ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} (1: the cache of {self.n_ctx} tokens, "
                               "all rows together, is full)")
        n_out = int(arr[:, 3].sum())
        if not n_out:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        ptr = lc.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.vocab_size)).copy()

    def forward_to(
        self, sequences: Sequence[Sequence[int]], active: Sequence[bool] | None = None, keep_logits: int = 1
    ) -> torch.Tensor:
        """Make each active row hold `sequences[b]`; return [B, keep_logits, V] float32 logits.

        Same contract as `CachedModel.forward_to`; rows of inactive entries feed nothing.
        """
        bsz = len(sequences)
        active = [True] * bsz if active is None else list(active)
        if bsz > len(self.held):
            raise ValueError(f"sequences: {bsz} rows but the request began with {len(self.held)}")
        fed: list[list[tuple[int, int, int, bool]]] = []  # each active row's (token, position, row, wants logits)
        for b, seq in enumerate(sequences):
            if not active[b]:
                continue
            if len(seq) < keep_logits:
                raise ValueError("sequences: each active row needs at least keep_logits tokens")
            if len(seq) > (self.row_ctx or self.n_ctx):
                raise ValueError(f"sequences: row {b} has {len(seq)} tokens; this llama.cpp context holds "
                                 f"{self.row_ctx or self.n_ctx} a row")
            keep = min(common_prefix(self.held[b], seq), len(seq) - keep_logits)
            self._rollback(b, keep)
            chunk = list(seq[keep:])
            first_out = len(chunk) - keep_logits
            fed.append([(t, keep + i, b, i >= first_out) for i, t in enumerate(chunk)])
            self.held[b].extend(chunk)
        logits = torch.zeros((bsz, keep_logits, self.vocab_size), dtype=torch.float32)
        for call in self._calls(fed):
            wanted = [(b, pos - (len(sequences[b]) - keep_logits)) for _, pos, b, wants in call if wants]
            for (b, k), row in zip(wanted, torch.from_numpy(self._decode(call))):  # outputs in item order
                logits[b, k] = row
        return logits

    def _calls(self, fed: list[list[tuple[int, int, int, bool]]]) -> list[list[tuple[int, int, int, bool]]]:
        """The `llama_decode` calls that feed each row's items as that row alone would be fed.

        llama.cpp computes a pass of many tokens with other kernels than a pass of a few (its
        batch kernels round differently), so a row's logits would depend on how many tokens of
        other rows share its pass. A row feeding more than `small_pass` tokens (a prompt) gets
        calls of its own, in pieces of n_batch as llama.cpp's own evaluation feeds a prompt; rows
        feeding fewer (verify passes) share calls of at most `small_pass` tokens, which compute
        what each would compute alone."""
        small = self.small_pass
        calls: list[list[tuple[int, int, int, bool]]] = []
        shared: list[tuple[int, int, int, bool]] = []
        for items in fed:
            if len(items) > small:
                calls += [items[i:i + self.n_batch] for i in range(0, len(items), self.n_batch)]
                continue
            if len(shared) + len(items) > small:
                calls.append(shared)
                shared = []
            shared += items
        return calls + [shared] if shared else calls

    def _probe_small_pass(self) -> int:
        """The most tokens a pass may hold and still compute each token's logits as a one-token
        pass does, measured on this CPU's kernels in the new, empty context (llama.cpp switches to
        its batch kernels at a size of its own): the largest of 63, 31, 15, 7 that does, else 1."""
        probe = [(100 + 37 * i) % self.vocab_size for i in range(8 + 63)]
        self._decode([(t, i, 0, False) for i, t in enumerate(probe[:8])])
        alone = self._decode([(probe[8], 8, 0, True)])
        found = 1
        for size in (s for s in (63, 31, 15, 7) if s <= self.n_batch):
            self._lc.llama_memory_seq_rm(self._mem, 0, 8, -1)
            if np.array_equal(self._decode([(t, 8 + i, 0, i == 0) for i, t in enumerate(probe[8:8 + size])]), alone):
                found = size
                break
        self._lc.llama_memory_clear(self._mem, True)
        return found


# ggml variants built with AMX tile instructions. On some Sapphire Rapids virtual machines their
# batched matrix product dies with SIGILL at the first `tileloadd` (llama.cpp's own tools too),
# so they are passed over for the next-best variant the CPU supports (AVX-512 BF16/VNNI there).
_AMX_VARIANTS = ("sapphirerapids",)

# What `load_cpu_backends` loaded ("variant", once it ran: it runs once per process) and what
# `_quiet_logs` installed ("callback", kept alive: C holds only the pointer; "done").
_cpu_backends: dict[str, str | None] = {}
_logs: dict[str, Any] = {}


def load_cpu_backends() -> str | None:
    """Load llama.cpp's CPU backend: with a portable build (GGML_BACKEND_DL, one library per ISA
    level) the variant this CPU runs best is picked at run time by each variant's own score (its
    ISA checks), which is the machine-dependent kernel choice llama.cpp makes for itself.
    llama-cpp-python loads none, so this does what llama.cpp's tools do at start, in the folder
    pip installs the variants into. A build without variants has its CPU backend built in.
    $FLASHSPEC_LLAMA_CPU_VARIANT names the variant to load instead (what another machine runs).
    Returns the variant's name (e.g. "zen4", "haswell"), or None when there are none to load."""
    if "variant" in _cpu_backends:
        return _cpu_backends["variant"]
    import llama_cpp as lc

    _cpu_backends["variant"] = None
    package = Path(lc.__file__).parent
    # pip puts the variants in site-packages/bin (CMake's default BINDIR); some builds put them
    # beside the other libraries.
    folders = (package.parent / "bin", package / "lib")
    variants = sorted(p for folder in folders for p in folder.glob("libggml-cpu-*.so"))
    scores: dict[Path, int] = {}
    chosen = os.environ.get(VARIANT_ENV)
    for path in variants:
        if any(name in path.name for name in _AMX_VARIANTS) or chosen and path.stem != f"libggml-cpu-{chosen}":
            continue
        lib = ctypes.CDLL(str(path))
        lib.ggml_backend_score.restype = ctypes.c_int
        scores[path] = lib.ggml_backend_score()  # 0: this CPU lacks an instruction it needs
    best = max(scores, key=scores.__getitem__, default=None)
    if best is None or scores[best] <= 0:
        return None
    ggml = ctypes.CDLL(str(package / "lib" / "libggml.so.0"))  # the copy libllama links (its soname)
    ggml.ggml_backend_load.restype = ctypes.c_void_p
    ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    if not ggml.ggml_backend_load(str(best).encode()):
        raise RuntimeError(f"llama.cpp could not load its CPU backend {best}")
    _cpu_backends["variant"] = best.stem.removeprefix("libggml-cpu-")
    return _cpu_backends["variant"]


def _quiet_logs(lc: ModuleType) -> None:
    """Silence llama.cpp's load-time chatter on stderr unless FLASHSPEC_LLAMA_LOG=1. lc: llama_cpp."""
    if os.environ.get("FLASHSPEC_LLAMA_LOG") == "1" or _logs.get("done", False):
        return

    @lc.llama_log_callback
    def _drop(level: int, text: bytes, user_data: int | None) -> None:  # the C signature
        return None

    _logs["callback"] = _drop  # keep a reference: C holds only the pointer
    lc.llama_log_set(_drop, ctypes.c_void_p(0))
    _logs["done"] = True
