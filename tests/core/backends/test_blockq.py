"""The GGUF block kernel: it multiplies by exactly the model's weights, layers get blocks only when
they hold those weights, and greedy decoding through it stays HF `generate`'s."""
from __future__ import annotations

import pytest
import torch
from helpers import random_blocks, random_gguf_bytes, tiny_llama

from flashspec_core.backends import blockq, gguf_weights
from flashspec_core.backends.blockq import block_linear, from_gguf_rows
from flashspec_core.backends.cpu_linear import BLOCKS, PackedLinear, use_packed_linear
from flashspec_core.models import default_gguf_path

pytestmark = pytest.mark.skipif(not blockq.available(), reason="no C compiler for the block kernel")


@pytest.fixture(params=blockq.TILE_ROWS, ids=lambda r: f"tiles-of-{r}")
def tile_rows(request):
    blockq.set_tile_rows(request.param)
    yield request.param
    blockq.set_tile_rows(1)


def _width(kind: str, blocks: int) -> int:
    """An input width of `blocks` of the kind's blocks (32 weights, or a K-quant's 256)."""
    return blockq.BLOCK_BYTES[kind][0] * blocks


def _gguf_py(kind: str, raw: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """[out, inp] fp32: gguf-py's (and so transformers') de-quantisation of GGUF bytes [out, bytes]."""
    import gguf

    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind.upper()])
    return torch.from_numpy(values.copy()).reshape(out, inp)


def _kernel_errors(blocks, weight: torch.Tensor, rows_list=(1, 2, 3, 4, 5, 6, 7, 8, 9, 17), lib=None) -> list[str]:
    """What is wrong with the kernel's product of `blocks` against weight [out, in] (empty: nothing):
    every token count within fp32 summation error of the exact product, and one-hot inputs, which
    read single weights (w * 1 plus exact zeros), giving the weights themselves bit for bit."""
    inp = weight.shape[1]
    wrong = []
    for rows in rows_list:
        x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
        exact = x.double() @ weight.double().T
        scale = x.double().abs() @ weight.double().abs().T  # what fp32 rounding of the sum is relative to
        err = (block_linear(x, blocks, lib=lib).double() - exact).abs()
        if not bool((err <= 1e-6 * scale + 1e-30).all()):
            wrong.append(f"{rows} rows: off by more than fp32 summation")
    if not torch.equal(block_linear(torch.eye(inp), blocks, lib=lib), weight.T):
        wrong.append("one-hot inputs do not read the weights")
    return wrong


@pytest.mark.parametrize("kind", blockq.KINDS)
@pytest.mark.parametrize(("out", "nb"), [(1, 1), (5, 2), (67, 3), (256, 18)])
def test_the_kernel_is_the_fp32_product_with_the_dequantised_weight(kind, out, nb, tile_rows):
    """Against gguf-py's de-quantisation of the same bytes: the weights transformers loads."""
    if kind.endswith("_k") and nb > 3:
        nb = 3  # 768 weights a row: enough super-blocks
    inp = _width(kind, nb)
    raw = random_gguf_bytes(kind, out, inp, seed=out)
    weight = _gguf_py(kind, raw, out, inp)  # [out, in]
    assert _kernel_errors(from_gguf_rows(kind, raw, out, inp), weight) == []


@pytest.mark.parametrize("kind", blockq.KINDS)
def test_every_kind_decodes_to_gguf_py_s_values_bit_for_bit(kind):
    """The repacked blocks hold exactly gguf-py's fp32 values, signs of zero included (ggml's
    d * (q - 8) is -0.0 where d < 0 and q = 8)."""
    out, inp = 9, _width(kind, 4)
    raw = random_gguf_bytes(kind, out, inp, seed=11)
    expected = _gguf_py(kind, raw, out, inp)
    got = from_gguf_rows(kind, raw, out, inp).dequantize()
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "q5_0"])
def test_a_wrong_sub_block_scale_is_caught(kind):
    """A planted bug that keeps every magnitude: two sub-blocks' scales swapped in one row (as a
    misread K-quant scale table would). The kernel's checks against gguf-py's weights must fail."""
    out, inp = 4, _width(kind, 2 if kind.endswith("_k") else 4)
    raw = random_gguf_bytes(kind, out, inp, seed=2)
    weight = _gguf_py(kind, raw, out, inp)
    blocks = from_gguf_rows(kind, raw, out, inp)
    assert _kernel_errors(blocks, weight, rows_list=(1, 5)) == []
    nb = inp // 32
    planted = blockq.BlockWeight(kind, blocks.qs, blocks.scales.clone(), out, inp)
    table = planted.scales.view(torch.uint8) if kind.endswith("_k") else planted.scales  # the same storage
    # the K-quants' integer scales (bytes after the fp32 d, and -dmin): sub-blocks 2 and 3 (q6_k: groups
    # 0 and 1); q5_0: blocks 2 and 3's d
    a, b = {"q4_k": (nb + 2, nb + 3), "q5_k": (nb + 2, nb + 3), "q6_k": (nb // 2, nb // 2 + 1)}.get(kind, (2, 3))
    table[2, [a, b]] = table[2, [b, a]]
    assert not torch.equal(planted.scales, blocks.scales), "the plant changed nothing"
    errors = _kernel_errors(planted, weight, rows_list=(1, 5))
    assert "one-hot inputs do not read the weights" in errors and len(errors) >= 2


def test_k_quants_need_whole_super_blocks():
    with pytest.raises(ValueError, match="in_features must be a multiple of 256 for q4_k"):
        from_gguf_rows("q4_k", torch.zeros(2, 144 * 2, dtype=torch.uint8), 2, 576)


@pytest.mark.parametrize("kind", blockq.KINDS)
def test_tiles_of_one_and_of_four_rows_give_the_same_product_bit_for_bit(kind):
    """The tile setting is a speed choice the calibration makes per machine: a row's sums must run
    in the same order under both (67 rows: tiles of 4 and a tail of single rows)."""
    inp = _width(kind, 1 if kind.endswith("_k") else 3)
    blocks = random_blocks(kind, 67, inp, seed=5)
    try:
        for tokens in range(1, 18):
            x = torch.randn(tokens, inp, generator=torch.Generator().manual_seed(tokens))
            blockq.set_tile_rows(4)
            four = block_linear(x, blocks)
            blockq.set_tile_rows(1)
            assert torch.equal(block_linear(x, blocks), four), f"{tokens} tokens"
    finally:
        blockq.set_tile_rows(1)
    with pytest.raises(ValueError, match="rows must be one of"):
        blockq.set_tile_rows(2)


def test_the_prefetch_distance_is_measured_and_changes_no_product():
    """The library picks its prefetch distance by timing the machine; any distance it may pick
    reads the same weights in the same order (a prefetch is a hint, never a load of the product)."""
    lib = blockq.library()
    blockq.set_tile_rows(4)
    try:
        chosen = blockq.fastest_prefetch(lib, rounds=1)
        assert lib.blockq_rows() == 4  # timing both tilings leaves the process's own in place
    finally:
        blockq.set_tile_rows(1)
    assert chosen in blockq.PREFETCH_BYTES
    blocks = random_blocks("q6_k", 67, 512, seed=3)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    try:
        products = []
        for ahead in blockq.PREFETCH_BYTES:
            lib.blockq_set_prefetch(ahead)
            products.append(block_linear(x, blocks))
        assert all(torch.equal(p, products[0]) for p in products)
        # within fp32 summation of the exact product (AVX2's 8-lane sums round unlike MKL's)
        weight = blocks.dequantize().double()
        exact, scale = x.double() @ weight.T, x.double().abs() @ weight.abs().T
        assert bool(((products[0].double() - exact).abs() <= 1e-6 * scale).all())
    finally:
        lib.blockq_set_prefetch(chosen)


def test_the_prefetch_distance_suits_both_tilings(monkeypatch):
    """A distance one tiling likes may cost the other half its speed, and the calibration picks the
    tiling after the distance is set: the pick must not be one tiling's best at the other's cost."""
    # (rows, distance) -> seconds: 1024 is the 1-row tiles' best by a hair and the 4-row tiles' worst
    times = {(1, 0): 1.5, (1, 1024): 1.0, (1, 4096): 1.02, (1, 8192): 1.1,
             (4, 0): 1.4, (4, 1024): 1.6, (4, 4096): 1.0, (4, 8192): 1.01}
    state = {"rows": 1, "ahead": 0, "now": 0.0}

    class FakeLib:
        def blockq_rows(self): return state["rows"]
        def blockq_set_rows(self, rows): state["rows"] = rows
        def blockq_set_prefetch(self, ahead): state["ahead"] = ahead
        def block_mm(self, *args): state["now"] += times[state["rows"], state["ahead"]]

    monkeypatch.setattr(blockq.time, "perf_counter", lambda: state["now"])
    assert blockq.fastest_prefetch(FakeLib(), rounds=2) == 4096
    assert state["rows"] == 1


def test_the_blocks_read_from_the_file_are_gguf_py_s_dequantisation():
    import gguf

    reader = gguf.GGUFReader(str(default_gguf_path()))
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name.lower()
        if kind not in blockq.KINDS or kind in seen or len(tensor.shape) != 2:  # not the norms' vectors
            continue
        seen.add(kind)
        inp, out = (int(n) for n in tensor.shape)
        raw = torch.from_numpy(tensor.data.copy()).view(torch.uint8)
        expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        assert torch.equal(from_gguf_rows(kind, raw, out, inp).dequantize(), expected.reshape(out, inp))
    assert seen == {"q4_1", "q8_0"}, "the default file has both block types"


def test_rows_are_matched_to_the_weight_and_anything_else_is_refused():
    blocks = random_blocks("q4_1", 8, 64)
    weight = blocks.dequantize()
    order = torch.tensor([3, 0, 1, 2, 7, 6, 5, 4])
    matched = gguf_weights.match_rows(blocks, weight[order].clone())
    assert matched is not None and torch.equal(matched.dequantize(), weight[order])
    edited = weight.clone()
    edited[2, 5] = torch.nextafter(edited[2, 5], torch.tensor(1.0))  # one ulp off
    assert gguf_weights.match_rows(blocks, edited) is None


def test_a_layer_computes_from_its_blocks_only_while_its_weight_is_unchanged():
    blocks = random_blocks("q4_1", 16, 64)
    linear = torch.nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(blocks.dequantize())
    model = torch.nn.Sequential(linear)
    choice = use_packed_linear(model)
    layer = model[0]
    assert isinstance(layer, PackedLinear)
    layer.use_blocks(blocks)
    choice.name = BLOCKS
    calls = []
    real = blockq.block_linear

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    import flashspec_core.backends.cpu_linear as cpu_linear

    x = torch.randn(3, 64)
    try:
        cpu_linear.block_linear = counting
        with torch.no_grad():
            torch.testing.assert_close(layer(x), x @ linear.weight.T, rtol=1e-5, atol=1e-5)
            assert calls == [1]
            layer.weight.mul_(2)  # edited in place: the blocks no longer hold it
            torch.testing.assert_close(layer(x), x @ layer.weight.T)
            assert calls == [1], "an edited weight must not run from stale blocks"
    finally:
        cpu_linear.block_linear = real


def _on_cpu(loaded) -> None:
    if loaded.model.get_output_embeddings().weight.device.type != "cpu":
        pytest.skip("the default target is on a GPU here; the block kernel is a CPU kernel")


def test_attach_finds_every_layer_of_the_default_model(default_target):
    from flashspec_core.backends.cpu_static import StaticCachedModel

    _on_cpu(default_target)

    runner = StaticCachedModel(default_target.model, pad_token_id=0, gguf=default_target.gguf)
    layers = [m for m in default_target.model.modules() if isinstance(m, PackedLinear)]
    assert runner.block_layers == len(layers) == 7 * default_target.model.config.num_hidden_layers + 1
    assert BLOCKS in runner.kernels()
    assert {m.blocks().kind for m in layers} == {"q4_1", "q8_0"}  # layers, and the tied head


def test_a_model_that_is_not_the_file_gets_no_blocks():
    model = tiny_llama(vocab=49152, hidden=576, layers=1, seed=0)
    use_packed_linear(model)
    assert gguf_weights.attach(model, default_gguf_path()) == 0


def test_stacked_projections_equal_separate_calls_bit_for_bit():
    from flashspec_core.backends.cpu_linear import project

    parts = [random_blocks("q4_1", out, 64, seed=out) for out in (12, 4, 4)]
    linears = []
    for blocks in parts:
        linear = torch.nn.Linear(64, blocks.out_features, bias=False)
        with torch.no_grad():
            linear.weight.copy_(blocks.dequantize())
        linears.append(linear)
    model = torch.nn.Sequential(*linears)
    choice = use_packed_linear(model)
    for layer, blocks in zip(model, parts):
        layer.use_blocks(blocks)
    choice.name = BLOCKS
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        separate = [layer(x) for layer in model]
        stacked = project(x, tuple(model))
        assert all(torch.equal(a, b) for a, b in zip(stacked, separate))
        model[1].weight.mul_(2)  # one layer edited: no stale stacked weight, it runs stock
        again = project(x, tuple(model))
        torch.testing.assert_close(again[1], x @ model[1].weight.T)


@pytest.mark.parametrize("flags", [("-mavx2", "-mfma", "-mno-avx512f"), ("-mavx2", "-mfma", "-mf16c", "-mno-avx512f"),
                                   ("-mno-avx2", "-mno-avx512f")],
                         ids=["avx2", "avx2-f16c", "plain-c"])
def test_every_instruction_set_path_computes_the_same_product(tmp_path, flags):
    """The kernel is built per machine; this one may have AVX-512, the next only AVX2 (with or
    without F16C's fp16 conversions) or neither."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction-set flags")
    path = tmp_path / "blockq.so"
    blockq.build(path, flags)
    lib = blockq.load(path)
    assert lib.blockq_lanes() == (8 if "-mavx2" in flags else 1)
    for tile_rows in blockq.TILE_ROWS:
        blockq.set_tile_rows(tile_rows, lib=lib)
        for kind in blockq.KINDS:
            inp = _width(kind, 1 if kind.endswith("_k") else 3)
            raw = random_gguf_bytes(kind, 67, inp, seed=3)
            errors = _kernel_errors(from_gguf_rows(kind, raw, 67, inp), _gguf_py(kind, raw, 67, inp),
                                    rows_list=(1, 3, 5, 6, 9), lib=lib)
            assert errors == [], f"{kind}, tiles of {tile_rows}: {errors}"


def test_an_edited_kernel_source_gets_a_build_of_its_own(tmp_path, monkeypatch):
    """The cached build is keyed by the sources' bytes: a changed blockq.c is never served stale."""
    before = blockq.library_path()
    copies = []
    for source in blockq.SOURCES:
        copy = tmp_path / source.name
        copy.write_bytes(source.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(blockq, "SOURCES", tuple(copies))
    assert blockq.library_path() == before  # the same bytes elsewhere: the same build
    copies[0].write_bytes(copies[0].read_bytes() + b"\n/* edited */\n")
    assert blockq.library_path() != before


def test_every_kernel_header_keys_the_build():
    """A header the C sources include but the build key leaves out would serve a stale library after
    an edit: every header beside the sources is named in HEADERS, every source in SOURCES."""
    folder = blockq.SOURCES[0].parent
    assert set(folder.glob("*.h")) == set(blockq.HEADERS)
    assert set(folder.glob("*.c")) == set(blockq.SOURCES)


def test_another_instruction_set_is_built_and_calibrated_apart(monkeypatch):
    """$FLASHSPEC_KERNEL_FLAGS builds what another machine runs (the AVX2 kernels on an AVX-512 CPU):
    its build and its calibration are keyed apart from this CPU's own, and a flag that is not an
    instruction-set option is refused by name, not passed to the compiler."""
    from flashspec_core.backends import calibration

    monkeypatch.delenv(blockq.FLAGS_ENV, raising=False)  # this CPU's own build, whatever the shell set
    native_path, native_key = blockq.library_path(), calibration.fingerprint("m", "hf")
    monkeypatch.setenv(blockq.FLAGS_ENV, "-mavx2 -mfma -mf16c -mno-avx512f")
    assert blockq.build_flags() == ("-mavx2", "-mfma", "-mf16c", "-mno-avx512f")
    assert blockq.library_path() != native_path
    assert calibration.fingerprint("m", "hf") != native_key
    monkeypatch.setenv(blockq.FLAGS_ENV, "-mavx2 -o /tmp/elsewhere.so")
    with pytest.raises(ValueError, match="FLASHSPEC_KERNEL_FLAGS.*-o"):
        blockq.build_flags()
    monkeypatch.setenv(blockq.FLAGS_ENV, " ")
    assert blockq.build_flags() == ("-march=native",) and blockq.library_path() == native_path


@pytest.mark.parametrize("kind", blockq.KINDS)
def test_many_tokens_at_once_give_what_a_few_at_a_time_give_bit_for_bit(kind):
    """Past a tile's columns each row is dequantised once into a panel and every token runs against
    it: its sums must run in the tiles' order (a verify pass, or rows side by side, gives the
    tokens' logits whatever else the step holds)."""
    inp = _width(kind, 9 if kind.endswith("_k") else 35)  # past one panel chunk (1024 weights)
    blocks = random_blocks(kind, 67, inp, seed=7)
    x = torch.randn(41, inp, generator=torch.Generator().manual_seed(41))
    try:
        blockq.set_tile_rows(4)
        few = torch.cat([block_linear(x[j:j + 3], blocks) for j in range(0, 41, 3)])  # the last 2
        for tile_rows in blockq.TILE_ROWS:
            blockq.set_tile_rows(tile_rows)
            assert torch.equal(block_linear(x, blocks), few), f"tiles of {tile_rows}"
    finally:
        blockq.set_tile_rows(1)
