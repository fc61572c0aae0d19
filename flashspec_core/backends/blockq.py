"""Linear layers read from a GGUF file's blocks (4- to 8-bit, or F16/BF16/F32 values), computed in fp32.

The blocks de-quantise exactly to the model's fp32 weights (d*q + m or d*(q - offset); a K-quant's
scales multiplied out exactly; F16 and BF16 widen exactly), so multiplying by them straight from
the blocks computes the same fp32 function of the same weights, only the order of its sums differs.
`gguf_weights.attach` checks, per layer, that the blocks de-quantise to the model's weights bit for
bit before any layer may use them. The kernel (`blockq.c`) is compiled on first use for this CPU
(`-march=native`) into the cache folder, keyed by the source and the CPU, and joins torch's OpenMP
runtime and thread count; without a C compiler it is not offered. Why: docs/backends.md.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from flashspec_core.models import cache_root

# compiled into one library: the block products and the layer stack built on them (decode_layers.c,
# with its attention, decode_attend.c, and its per-architecture head steps, decode_heads.c)
SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("blockq.c", "decode_layers.c", "decode_attend.c", "decode_heads.c"))
HEADERS = tuple(Path(__file__).with_name(n)
                for n in ("blockq.h", "blockq_isa.h", "blockq_tiles.h", "blockq_panel.h", "decode_layers.h"))
BLOCK = 32  # weights per block of the kernel's layouts along the input dimension
# The layouts blockq.c reads, in blockq.h's order, and the GGUF types each holds (repacked by
# `from_gguf_rows`): 4-bit nibbles with (d, m) or with an offset, the same with a fifth bit, int8
# with one d per 32 or per 16 weights; fp16, bf16 and fp32 weights as the file stores them; the
# K-quants' nibbles (and fifth bits, or 2-bit highs) with the file's compact scales (`BlockWeight`).
LAYOUTS = ("q4_1", "q8_0", "q4_0", "q5_0", "q5_1", "q8_s16", "f16", "bf16", "f32", "q4_k", "q5_k", "q6_k")
LAYOUT_OF = {"q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q5_0", "q5_1": "q5_1", "q8_0": "q8_0",
             "q4_k": "q4_k", "q5_k": "q5_k", "q6_k": "q6_k", "f16": "f16", "bf16": "bf16", "f32": "f32"}
KINDS = tuple(LAYOUT_OF)  # the GGUF block types the kernel reads
SUPER = 256  # weights per K-quant super-block
# per GGUF type: (weights, bytes) of one of its blocks; the float types store single values, which
# the kernel reads 32 at a time (so their rows, too, must be whole blocks of 32)
BLOCK_BYTES = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
               "q4_k": (SUPER, 144), "q5_k": (SUPER, 176), "q6_k": (SUPER, 210),
               "f16": (BLOCK, 64), "bf16": (BLOCK, 64), "f32": (BLOCK, 128)}
_FLOATS = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}  # the float types' dtypes
_OFFSET = {"q4_0": 8, "q5_0": 16}  # layouts whose weights are d * (q - offset): one d a block


@dataclass
class BlockWeight:
    """One [out, in] weight as blocks of 32 weights along `in`, laid out for `blockq.c`.

    kind: the GGUF type the blocks came from; `layout` the form blockq.c reads. Nibble layouts:
    qs [out, in / 32 * 16] uint8 (byte i of a block: weight i in the low nibble, i + 16 in the
    high one), q5_*: [out, in / 32 * 20] (a little-endian 32-bit word of fifth bits first, bit i
    for weight i), scales [out, in / 32, 2] fp32 (d, m) or [out, in / 32] (d) for q4_0 and q5_0;
    int8 layouts: qs [out, in] int8, scales [out, in / 32] (q8_0) or [out, in / 16] (q8_s16) fp32;
    float layouts: qs [out, in * 2 or 4] uint8 (the little-endian values), scales [out, 0].
    K-quants (nb = in / 32 blocks a row): q4_k and q5_k qs as q4_1 and q5_1, scales [out, 3 nb / 4]
    fp32 holding nb / 8 d, nb / 8 -dmin, then (as bytes) nb uint8 sc and nb uint8 m: block b's d and
    m are d[b / 8] * sc[b] and -dmin[b / 8] * m[b], exact in fp32. q6_k: qs [out, nb * 24] uint8, per
    block two little-endian words of 2-bit highs (for i < 16, weight i's then weight 16 + i's in the
    nibble at bit 4 (i / 2) of word i % 2: one shift a lane finds it) then 16 bytes of nibbles as
    q4_1's; scales [out, 5 nb / 8] fp32 holding nb / 8 d, then 2 nb int8 sc
    (one per 16 weights): weight = d * sc * (q - 32), d * sc exact.
    """

    kind: str
    qs: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int

    @property
    def layout(self) -> str:
        return LAYOUT_OF[self.kind]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] these blocks hold, as gguf-py and transformers compute it:
        d * q + m (one rounding), d * (q - offset), d * q, or a float value (exact)."""
        n, k, layout = self.out_features, self.in_features, self.layout
        if layout in _FLOATS:  # widened to fp32: exact
            return self.qs.contiguous().view(_FLOATS[layout]).reshape(n, k).float()
        if layout in ("q4_k", "q5_k", "q6_k"):
            return self._dequantize_k()
        if layout in ("q8_0", "q8_s16"):
            group = 32 if layout == "q8_0" else 16
            q = self.qs.view(n, k // group, group).float()
            return (self.scales.view(n, k // group, 1) * q).reshape(n, k)
        five = layout in ("q5_0", "q5_1")
        blocks = self.qs.view(n, k // BLOCK, 20 if five else 16)
        nibbles = blocks[..., 4:] if five else blocks
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).int()  # [out, blocks, 32]
        if five:
            bits = blocks[..., :4].clone(memory_format=torch.contiguous_format).view(torch.int32)  # [out, blocks, 1]
            q |= ((bits >> torch.arange(32, dtype=torch.int32)) & 1) << 4
        if layout in _OFFSET:
            return (self.scales.view(n, k // BLOCK, 1) * (q - _OFFSET[layout]).float()).reshape(n, k)
        scales = self.scales.view(n, k // BLOCK, 2)  # d, m
        return (scales[..., :1] * q.float() + scales[..., 1:]).reshape(n, k)


    def _dequantize_k(self) -> torch.Tensor:
        """`dequantize` for the K-quant layouts (see the class doc)."""
        n, k, layout = self.out_features, self.in_features, self.layout
        nb = k // BLOCK
        raw = self.scales.contiguous().view(torch.uint8)  # [out, bytes]
        floats = self.scales[:, : nb // 8]  # [out, nb / 8] d
        if layout == "q6_k":
            sc = raw[:, nb // 2:].contiguous().view(torch.int8).float()  # [out, 2 nb]
            blocks = self.qs.view(n, nb, 24)
            words = blocks[..., :8].contiguous().view(torch.int32)  # [out, nb, 2]
            lane = torch.arange(16)
            lanes = (words[..., lane % 2] >> (lane // 2 * 4).int()) & 15  # [out, nb, 16]
            high = torch.stack([lanes & 3, lanes >> 2], dim=-2)  # [out, nb, 2, 16]
            low = torch.stack([blocks[..., 8:] & 15, blocks[..., 8:] >> 4], dim=-2).int()  # [out, nb, 2, 16]
            q = (low | (high << 4)) - 32
            scale = floats.repeat_interleave(16, dim=1) * sc  # [out, 2 nb]: d * sc per 16 weights
            return (scale.view(n, nb, 2, 1) * q.float()).reshape(n, k)
        sm = raw[:, nb:].int()  # [out, 2 nb]: sc then m, after the nb / 4 floats
        d = floats.repeat_interleave(8, dim=1) * sm[:, :nb].float()  # [out, nb]
        m = self.scales[:, nb // 8: nb // 4].repeat_interleave(8, dim=1) * sm[:, nb:].float()
        five = layout == "q5_k"
        blocks = self.qs.view(n, nb, 20 if five else 16)
        nibbles = blocks[..., 4:] if five else blocks
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).int()  # [out, blocks, 32]
        if five:
            bits = blocks[..., :4].clone(memory_format=torch.contiguous_format).view(torch.int32)
            q |= ((bits >> torch.arange(32, dtype=torch.int32)) & 1) << 4
        return (d[..., None] * q.float() + m[..., None]).reshape(n, k)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] fp32: little-endian fp16 values."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _bytes_of(values: torch.Tensor) -> torch.Tensor:
    """[out, n] fp32 -> [out, n * 4] uint8: the values' little-endian bytes."""
    return values.clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..31 -> [..., 16] bytes: weight i's low 4 bits in byte i's low nibble, weight
    i + 16's in its high one (GGUF's order within a 32-weight block)."""
    q = q.to(torch.uint8)
    return (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)


def _fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..31 -> [..., 4] bytes: a little-endian word, bit i = weight i's fifth bit."""
    word = (((q.long() >> 4) & 1) << torch.arange(32)).sum(-1, keepdim=True)  # [..., 1] int64
    return word.view(torch.uint8)[..., :4]  # its low 4 bytes (little-endian)


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A K-quant super-block's 12 bytes of 6-bit scales and mins -> ([..., 8], [..., 8]) (ggml's
    get_scale_min_k4)."""
    d, m, md = raw[..., 0:4].long(), raw[..., 4:8].long(), raw[..., 8:12].long()
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mins


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A K-quant super-block's 128 bytes of nibbles -> [..., 8, 32] values 0..15: each 32 bytes hold
    one 32-weight block in their low nibbles and the next in their high ones."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    return (q & 15).reshape(*qs.shape[:-1], 8, 32)


def from_gguf_rows(kind: str, raw: torch.Tensor, out_features: int, in_features: int) -> BlockWeight:
    """A BlockWeight from GGUF's raw block bytes [out, bytes per row] (uint8), repacked into the
    layout blockq.c reads (`LAYOUT_OF`); the values are GGUF's own, scales multiplied out in fp32
    as ggml does (exact: an fp16 d times a 6- or 8-bit integer scale). F16, BF16 and F32 rows are
    kept as they are."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    size, nbytes = BLOCK_BYTES[kind]
    if in_features % size:
        raise ValueError(f"in_features must be a multiple of {size} for {kind}; got {in_features}")
    n, nb = out_features, in_features // size
    if kind in _FLOATS:  # the values as they are
        qs = raw.reshape(n, nb * nbytes).contiguous()
        return BlockWeight(kind, qs, torch.zeros(n, 0), out_features, in_features)
    blocks = raw.reshape(n, nb, nbytes)
    if kind == "q8_0":
        scales = _fp16(blocks[..., :2])
        qs = blocks[..., 2:].reshape(n, in_features).contiguous().view(torch.int8)
    elif kind in ("q4_0", "q5_0"):  # d, [fifth bits], nibbles: already the layout
        scales = _fp16(blocks[..., :2])
        qs = blocks[..., 2:].reshape(n, -1)
    elif kind in ("q4_1", "q5_1"):  # d, m, [fifth bits], nibbles
        scales = _fp16(blocks[..., :4].reshape(n, nb, 2, 2))  # d, m
        qs = blocks[..., 4:].reshape(n, -1)
    elif kind in ("q4_k", "q5_k"):  # d, dmin, scales, [fifth bits], nibbles; 8 blocks of 32
        d, dmin = _bytes_of(_fp16(blocks[..., 0:2])), _bytes_of(-_fp16(blocks[..., 2:4]))  # [out, nb * 4]
        sc, mins = _k_scales(blocks[..., 4:16])  # [out, nb, 8] each
        scales = torch.cat([d, dmin, sc.to(torch.uint8).reshape(n, -1),
                            mins.to(torch.uint8).reshape(n, -1)], dim=-1).view(torch.float32)
        q = _k_nibbles(blocks[..., -128:]).int()  # [out, nb, 8, 32]
        if kind == "q5_k":
            high = blocks[..., 16:48].reshape(n, nb, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
            q |= (high & 1).int() << 4
            qs = torch.cat([_fifth_bits(q), _nibbles(q)], dim=-1)
        else:
            qs = _nibbles(q)
        qs = qs.reshape(n, -1)
    else:  # q6_k: low nibbles, 2-bit highs, 16 int8 scales, d; 16 groups of 16
        low = blocks[..., :128].reshape(n, nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
        high = blocks[..., 128:192].reshape(n, nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        q = ((low & 15).reshape(n, nb, 8, 32) | ((high & 3).reshape(n, nb, 8, 32) << 4)).long()  # 0..63
        high = q >> 4  # [out, nb, 8, 32]: each weight's 2 high bits
        lanes = high[..., :16] | high[..., 16:] << 2  # lane i: weight i's highs, then weight 16 + i's
        shifts = (torch.arange(16) // 2 * 4).view(8, 2).T  # lane 2j + k: word k, bits 4j..4j + 3
        words = (lanes.view(n, nb, 8, 8, 2).transpose(-1, -2) << shifts).sum(-1)  # [out, nb, 8, 2] int64
        words = words.contiguous().view(torch.uint8).view(n, nb, 8, 2, 8)[..., :4].reshape(n, nb, 8, 8)
        qs = torch.cat([words, _nibbles(q & 15)], dim=-1).reshape(n, -1)
        d = _bytes_of(_fp16(blocks[..., 208:210]))  # [out, nb * 4]
        sc = blocks[..., 192:208].reshape(n, -1)  # [out, nb * 16] int8 bytes, one per 16 weights
        scales = torch.cat([d, sc], dim=-1).view(torch.float32)
    return BlockWeight(kind, qs.contiguous(), scales.reshape(n, -1).contiguous(), out_features, in_features)


def _compiler() -> str | None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(cc.split()[0])


FLAGS_ENV = "FLASHSPEC_KERNEL_FLAGS"  # compiler flags instead of -march=native: "-mavx2 -mfma -mf16c", ...


def build_flags() -> tuple[str, ...]:
    """The instruction set the kernels are built for: this CPU's (`-march=native`), or what
    $FLASHSPEC_KERNEL_FLAGS names (the AVX2 or plain-C kernels another machine would run, timed on
    this one). Only `-m...` options are taken; anything else is an error naming the variable."""
    text = os.environ.get(FLAGS_ENV, "").strip()
    if not text:
        return ("-march=native",)
    flags = tuple(text.split())
    bad = [f for f in flags if not f.startswith("-m")]
    if bad:
        raise ValueError(f"${FLAGS_ENV}={text!r}: {bad} is not an instruction-set option; give -m options "
                         "only, e.g. FLASHSPEC_KERNEL_FLAGS='-mavx2 -mfma -mf16c -mno-avx512f'")
    return flags


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
    lib.block_mm.argtypes = [i32, ptr, i32, i32, ptr, ptr, ptr, i32, i32]
    lib.block_mm.restype = None
    lib.blockq_lanes.restype = i32
    lib.blockq_set_rows.argtypes = [i32]
    lib.blockq_set_rows.restype = None
    lib.blockq_rows.restype = i32
    lib.blockq_set_prefetch.argtypes = [i32]
    lib.blockq_set_prefetch.restype = None
    lib.decode_layers.argtypes = [ptr] * 4 + [i32] + [ptr] * 3 + [i32] + [ptr] * 5 + [i32]
    lib.decode_layers.restype = None
    lib.decode_layers_work.argtypes = [ptr, i32, i32]
    lib.decode_layers_work.restype = ctypes.c_int64
    lib.decode_layers_slots.restype = i32
    return lib


def library_path() -> Path:
    """Where this machine's build lives in the cache: keyed by the sources' bytes, the CPU and the
    build flags, so an edited kernel, another CPU or another ISA gets a build of its own, never a
    stale one."""
    from flashspec_core.backends.calibration import cpu_flags, cpu_model

    key = hashlib.sha256(f"{source_key()}|{cpu_model()}|{cpu_flags()}|{build_flags()}".encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"blockq-{key}.so"


def source_key() -> str:
    """A hash of the kernel's sources: a build, or a calibration of its speed, is of one version."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))).hexdigest()[:16]


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel for this machine (built on first use), or None where it cannot be built."""
    if _compiler() is None:
        return None
    path = library_path()
    try:
        if not path.exists():
            build(path, build_flags())
        lib = load(path)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"the GGUF block kernel could not be built ({detail}); the fp32 kernels run instead",
                      stacklevel=2)
        return None
    ahead = fastest_prefetch(lib)
    lib.blockq_set_prefetch(ahead)
    logging.getLogger(__name__).info("GGUF block kernel %s: %d fp32 lanes a vector; rows fetched %d bytes ahead "
                                     "(the fastest of %s on this machine)", path.name, lib.blockq_lanes(), ahead,
                                     PREFETCH_BYTES)
    return lib


PREFETCH_BYTES = (0, 1024, 4096, 8192)  # distances `fastest_prefetch` tries


def fastest_prefetch(lib: ctypes.CDLL, rounds: int = 5) -> int:
    """The prefetch distance (PREFETCH_BYTES) at which one token's product streams a 64 MiB Q4_K
    weight (more than a cache holds) fastest on this machine, in tiles of one row and of four
    alike: the distance whose times, each over that tiling's best, sum least, from the best of
    `rounds` interleaved passes each (~0.4 s in all). Why measured: how far ahead pays depends on
    the memory's latency (little on bare metal, several KiB on a VM's), and a distance that helps
    one machine can cost another. Why both tilings: the calibration picks the tiling afterwards,
    and a distance one tiling likes may cost the other half its speed (a 4-row tile reads 8
    streams at once)."""
    out, inp = 32768, 4096
    nb = inp // BLOCK
    qs = torch.full((out, nb * 16), 17, dtype=torch.uint8)  # [out, bytes]: written, so every page is real
    scales = torch.full((out, nb * 3 // 4), 0.5)  # [out, 3 nb / 4]
    x, y = torch.ones(1, inp), torch.empty(1, out)  # [1, in], [1, out]
    best: dict[tuple[int, int], float] = {}
    tiling = lib.blockq_rows()
    try:
        for _ in range(rounds):
            for rows in TILE_ROWS:
                lib.blockq_set_rows(rows)
                for ahead in PREFETCH_BYTES:
                    lib.blockq_set_prefetch(ahead)
                    start = time.perf_counter()
                    lib.block_mm(LAYOUTS.index("q4_k"), x.data_ptr(), 1, inp, qs.data_ptr(), scales.data_ptr(),
                                 y.data_ptr(), out, torch.get_num_threads())
                    key = (rows, ahead)
                    best[key] = min(best.get(key, float("inf")), time.perf_counter() - start)
    finally:
        lib.blockq_set_rows(tiling)
    fastest = {rows: min(best[rows, a] for a in PREFETCH_BYTES) for rows in TILE_ROWS}
    return min(PREFETCH_BYTES, key=lambda a: sum(best[rows, a] / fastest[rows] for rows in TILE_ROWS))


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
        lib.block_mm(LAYOUTS.index(weight.layout), flat.data_ptr(), flat.shape[0], weight.in_features,
                     weight.qs.data_ptr(), weight.scales.data_ptr(), out.data_ptr(), weight.out_features,
                     torch.get_num_threads())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.out_features)
