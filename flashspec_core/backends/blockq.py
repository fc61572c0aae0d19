"""Linear layers read from a GGUF file's 4- and 8-bit blocks, computed in fp32: the target's own weights.

Why: on a CPU a decode step is bound by the bytes of weights it reads. The default model ships as
a GGUF file whose layers are Q4_1 blocks (and its tied embedding Q8_0); transformers de-quantises
them into an fp32 copy 5x larger, which every step then streams from memory (about half of a
step of the default model). The fp32 weights are exactly the blocks' values
(d*q + m in fp32), so a kernel that multiplies by those values straight from the blocks computes
the same fp32 function of the same weights; only the order of its sums differs, as it does
between MKL's one-row and many-row kernels. `gguf_weights.attach` checks, per layer, that the
blocks de-quantise to the model's weights bit for bit before any layer may use them.

The kernel (`blockq.c`) is compiled on first use on the machine that runs it (`-march=native`,
so the AVX-512 or AVX2 path this CPU has) into the cache folder, keyed by the source and the CPU;
without a C compiler the kernel is simply not offered and the calibration times the others. It
joins torch's OpenMP runtime (the same libgomp), with torch's thread count.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from flashspec_core.models import cache_root

# compiled into one library: the block products and the layer stack built on them (decode_layers.c)
SOURCES = tuple(Path(__file__).with_name(n) for n in ("blockq.c", "decode_layers.c"))
HEADER = Path(__file__).with_name("blockq.h")
BLOCK = 32  # weights per block along the input dimension (GGUF's Q4_1 and Q8_0)
KINDS = ("q4_1", "q8_0")
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # fp16 d, fp16 m, 16 bytes of nibbles; fp16 d, 32 int8


@dataclass
class BlockWeight:
    """One [out, in] weight as GGUF blocks, laid out for `blockq.c`.

    q4_1: qs [out, in / 2] uint8 (byte i of a block: weight i in the low nibble, i + 16 in the
    high one), scales [out, in / 32, 2] fp32 (d, m); q8_0: qs [out, in] int8, scales [out, in / 32] fp32.
    """

    kind: str
    qs: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] these blocks hold (d*q + m, as gguf-py and transformers compute it)."""
        n, k = self.out_features, self.in_features
        if self.kind == "q4_1":
            q = self.qs.view(n, k // BLOCK, BLOCK // 2)
            q = torch.cat([q & 15, q >> 4], dim=-1).float()  # [out, blocks, 32]
            return (self.scales[..., :1] * q + self.scales[..., 1:]).reshape(n, k)
        return (self.scales[..., None] * self.qs.view(n, k // BLOCK, BLOCK).float()).reshape(n, k)


def from_gguf_rows(kind: str, raw: torch.Tensor, out_features: int, in_features: int) -> BlockWeight:
    """A BlockWeight from GGUF's raw block bytes [out, bytes per row] (uint8).

    Q4_1 blocks are 20 bytes (fp16 d, fp16 m, 16 bytes of nibbles), Q8_0 blocks 34 (fp16 d, 32 int8).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    if in_features % BLOCK:
        raise ValueError(f"in_features must be a multiple of {BLOCK}; got {in_features}")
    nb = in_features // BLOCK
    blocks = raw.reshape(out_features, nb, BLOCK_BYTES[kind])
    if kind == "q4_1":
        scales = blocks[..., :4].contiguous().view(torch.float16).float()  # [out, nb, 2]: d, m
        qs = blocks[..., 4:].reshape(out_features, nb * 16).contiguous()
    else:
        scales = blocks[..., :2].contiguous().view(torch.float16).float().reshape(out_features, nb)
        qs = blocks[..., 2:].reshape(out_features, in_features).contiguous().view(torch.int8)
    return BlockWeight(kind, qs, scales.contiguous(), out_features, in_features)


def _compiler() -> str | None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(cc.split()[0])


def build(target: Path, flags: tuple[str, ...] = ("-march=native",)) -> None:
    """Compile the kernels into `target` (written to a temporary file and renamed: never half-built).
    `flags` pick the instruction set: this machine's by default; tests build the AVX2 and plain-C
    paths too, which the machines they run on would otherwise never exercise."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".blockq-", suffix=".so")
    os.close(fd)
    # -ffp-contract=off: no a*b + c that transformers rounds twice becomes one FMA (the products'
    # FMAs are written out as intrinsics, which the flag leaves alone)
    cmd = [_compiler() or "cc", "-O3", *flags, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-o", tmp,
           *map(str, SOURCES)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: Path) -> ctypes.CDLL:
    """A built kernel library with its functions' signatures set."""
    lib = ctypes.CDLL(str(path))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    for fn in (lib.q4_1_mm, lib.q8_0_mm):
        fn.argtypes = [ptr, i32, i32, ptr, ptr, ptr, i32, i32]
        fn.restype = None
    lib.blockq_lanes.restype = i32
    lib.blockq_set_rows.argtypes = [i32]
    lib.blockq_set_rows.restype = None
    lib.decode_layers.argtypes = [ptr] * 4 + [i32] + [ptr] * 6 + [i32]
    lib.decode_layers.restype = None
    lib.decode_layers_work.argtypes = [ptr, i32, i32]
    lib.decode_layers_work.restype = ctypes.c_int64
    lib.decode_layers_slots.restype = i32
    return lib


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel for this machine (built on first use), or None where it cannot be built."""
    from flashspec_core.backends.calibration import cpu_flags, cpu_model

    if _compiler() is None:
        return None
    code = b"".join(p.read_bytes() for p in (*SOURCES, HEADER))
    key = hashlib.sha256(code + f"|{cpu_model()}|{cpu_flags()}".encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"blockq-{key}.so"
    try:
        if not path.exists():
            build(path)
        return load(path)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"the GGUF block kernel could not be built ({detail}); the fp32 kernels run instead", stacklevel=2)
        return None


def available() -> bool:
    return library() is not None


TILE_ROWS = (1, 4)


def set_tile_rows(rows: int, lib: ctypes.CDLL | None = None) -> None:
    """Rows of a weight per tile of the kernel from now on, process-wide: 1 (one stream of blocks per
    thread, up to 8 tokens a tile) or 4 (each load of the input reused by 4 rows, 8 streams). The
    faster one is the machine's (the calibration times both); results are identical either way."""
    if rows not in TILE_ROWS:
        raise ValueError(f"rows must be one of {TILE_ROWS}; got {rows!r}")
    lib = lib or library()
    if lib is not None:
        lib.blockq_set_rows(rows)


def block_linear(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [..., in] fp32 -> [..., out]: x @ W.T (+ bias) from W's blocks, on torch's thread count.
    `lib`: another build of the kernel (`build`, `load`) than this machine's."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError("the GGUF block kernel is not available on this machine (no C compiler)")
    if x.dtype != torch.float32 or x.shape[-1] != weight.in_features:
        raise ValueError(f"x must be fp32 [..., {weight.in_features}]; got {x.dtype} {tuple(x.shape)}")
    flat = x.reshape(-1, weight.in_features).contiguous()  # [M, in]
    out = torch.empty(flat.shape[0], weight.out_features)  # [M, out]
    if flat.shape[0]:
        fn = lib.q4_1_mm if weight.kind == "q4_1" else lib.q8_0_mm
        fn(flat.data_ptr(), flat.shape[0], weight.in_features, weight.qs.data_ptr(), weight.scales.data_ptr(),
           out.data_ptr(), weight.out_features, torch.get_num_threads())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.out_features)
