"""The native layer stack (backends/decode_layers.c through native_layers.py) against transformers.

Models here are tiny Llamas, Qwen2s and Qwen3s whose seven projections per layer are random GGUF
blocks (their fp32 weights set to the blocks' values, as loading a GGUF file does), with random
norm weights (Qwen3's per-head q/k norms too), random q/k/v biases (Qwen2) and grouped query heads.
After any walk of prompts, rollbacks, growth and batch rows, the logits of the NATIVE kernel equal
a fresh transformers forward of each row's sequence within fp32 rounding, on one thread and two
(the OpenMP partition), and on every instruction-set build.
"""
from __future__ import annotations

import random

import pytest
import torch
from helpers import random_blocks, tiny_family, tiny_llama
from walks import ragged_walk

from flashspec_core.backends import blockq, native_layers, ragged
from flashspec_core.backends.cpu_linear import BLOCKS, PackedLinear, use_packed_linear
from flashspec_core.backends.cpu_static import StaticCachedModel
from flashspec_core.backends.native_layers import NATIVE, NATIVE_4ROW, NativeLayers, eligible, refusal
from flashspec_core.backends.ragged import Feed

pytestmark = pytest.mark.skipif(not blockq.available(), reason="no C compiler for the block kernel")

VOCAB = 24


def q4_k_m(name: str) -> str:
    """The GGUF type llama.cpp's Q4_K_M gives projection `name` of a model whose hidden size is not a
    multiple of 256 (as the default model's): q5_0 where a K-quant cannot be, v alternating with
    q8_0, down q4_k and q6_k."""
    layer = int(name.split(".")[2])
    if name.endswith("v_proj"):
        return "q8_0" if layer % 2 else "q5_0"
    if name.endswith("down_proj"):
        return "q6_k" if layer % 2 else "q4_k"
    return "q5_0"


def blocked_llama(kinds=("q4_1", "q8_0"), family: str = "llama", hidden: int = 32):
    """tiny_family(family) with every projection of every layer computing from random blocks: q, k,
    v, gate and up of kinds[0], o and down of kinds[-1] (as GGUF files mix them), or kinds(name)
    per projection; the LM head stays fp32. hidden=64: head dim 16 (2 query heads per kv head),
    where 4+ tokens a pass take decode_attend.c's 16-queries-at-a-time attention; 128: an
    intermediate size of 256, wide enough for K-quants in down."""
    model = tiny_family(family, VOCAB)
    if hidden != 32:
        model = tiny_llama(VOCAB, seed=3, layers=2, hidden=hidden, max_positions=1024)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith("norm"):
                    module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=gen))
    use_packed_linear(model)
    with torch.no_grad():
        for i, (name, module) in enumerate(model.named_modules()):
            if isinstance(module, PackedLinear) and name != "lm_head":
                if callable(kinds):
                    kind = kinds(name)
                else:
                    kind = kinds[-1] if name.endswith(("o_proj", "down_proj")) else kinds[0]
                blocks = random_blocks(kind, module.out_features, module.in_features, seed=i)
                module.weight.copy_(blocks.dequantize())
                module.use_blocks(blocks)
    return model


def blocked_family(family: str, kinds=("q4_1", "q8_0")):
    """blocked_llama(family=...) with random q/k/v biases (transformers starts them at zero, where
    a skipped bias would go unnoticed); Qwen3's q/k norm weights are random already (tiny_family)."""
    model = blocked_llama(kinds, family=family)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PackedLinear) and module.bias is not None:
                module.bias.copy_(0.5 * torch.randn(module.bias.shape, generator=gen))
    return model


@torch.no_grad()
def _fresh(model, seq, keep):
    return model(input_ids=torch.tensor([seq])).logits[0, -keep:]


def _walk(runner, model, rows: int, seed: int, steps: int = 20) -> None:
    """Random forwards (new prompts, rollbacks, growth, inactive rows), each checked row by row."""
    rng = random.Random(seed)
    runner.reset(rows)
    seqs = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 30))] for _ in range(rows)]
    for _ in range(steps):
        keep = rng.choice([1, 2, 5, 9])
        seqs = [s[:max(1, len(s) - rng.randint(0, 4))] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]
                for s in seqs]
        seqs = [s + [1] * max(0, keep - len(s)) for s in seqs]
        active = [b == 0 or rng.random() < 0.7 for b in range(rows)]
        out = runner.forward_to(seqs, active, keep_logits=keep)
        for b, s in enumerate(seqs):
            if active[b]:
                torch.testing.assert_close(out[b], _fresh(model, s, keep), atol=1e-4, rtol=1e-4)


def _native_walk(model, rows: int, threads: int, chunk: int, steps: int) -> StaticCachedModel:
    """`_walk` on the NATIVE kernel with `chunk` slots per attention item on `threads` threads;
    fails if the native stack never ran. Returns the runner."""
    runner = StaticCachedModel(model, pad_token_id=0, max_len=48)
    assert NATIVE in runner.kernels()
    runner._native = NativeLayers(runner.static, chunk=chunk)
    runner.use_kernel(NATIVE)
    calls = []
    native = runner.native
    runner.native = lambda *args: calls.append(1) or native(*args)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _walk(runner, model, rows, seed=rows + threads, steps=steps)
    finally:
        torch.set_num_threads(before)
    assert calls, "the native stack never ran"
    return runner


@pytest.mark.parametrize(("rows", "threads", "chunk", "hidden", "kinds"),
                         [(1, 1, 128, 32, None), (1, 2, 5, 32, None), (3, 2, 8, 32, None), (1, 2, 7, 64, None),
                          (2, 1, 128, 64, None), (1, 2, 8, 128, q4_k_m), (2, 1, 128, 128, q4_k_m),
                          (1, 2, 8, 64, ("f16", "bf16")), (2, 1, 128, 32, ("bf16", "f32"))],
                         ids=lambda v: getattr(v, "__name__", None))
def test_native_logits_match_a_fresh_transformers_forward(rows, threads, chunk, hidden, kinds):
    """chunk: cache slots per attention work item; small ones split every context into chunks
    whose partial softmaxes are merged (decode_attend.c's `attend`). hidden 64: head dim 16, so
    passes of 4+ tokens take the 16-queries-at-a-time attention. q4_k_m: the mix of types (within a
    layer's q, k and v too) of a Q4_K_M file; f16, bf16, f32: tensors a file stores unquantized."""
    model = blocked_llama(hidden=hidden, **({"kinds": kinds} if kinds else {}))
    runner = _native_walk(model, rows, threads, chunk, steps=20)
    assert runner.static.max_len > 48, "the walk should have grown the cache past its first size"


@pytest.mark.parametrize(("family", "rows", "threads", "chunk"),
                         [("qwen2", 1, 1, 128), ("qwen2", 2, 2, 5), ("qwen3", 1, 2, 7), ("qwen3", 2, 1, 128)])
def test_qwen_biases_and_q_k_norms_match_a_fresh_transformers_forward(family, rows, threads, chunk):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms (decode_layers.c's `bias_and_norm`)."""
    _native_walk(blocked_family(family), rows, threads, chunk, steps=10)


@pytest.mark.parametrize(("family", "slot"), [("qwen2", 0), ("qwen2", 1), ("qwen2", 2), ("qwen3", 3), ("qwen3", 4)])
def test_a_skipped_bias_or_q_k_norm_is_caught(monkeypatch, family, slot):
    """The check above has power: with one of a layer's bias or norm addresses left out of the
    table (decode_layers.c then skips it), the native logits are not transformers'."""
    real = native_layers._extras_row

    def without(layer):
        row = real(layer)
        row[slot] = 0
        return row

    monkeypatch.setattr(native_layers, "_extras_row", without)
    model = blocked_family(family)
    runner = StaticCachedModel(model, pad_token_id=0, max_len=48)
    runner.use_kernel(NATIVE)
    with pytest.raises(AssertionError):
        _walk(runner, model, rows=1, seed=3, steps=2)


def test_native_and_torch_forwards_agree_on_the_cache_they_leave():
    """Keys and values written by the native stack are those the torch forward writes."""
    model = blocked_llama(kinds=("q4_1",))
    a, b = StaticCachedModel(model, pad_token_id=0), StaticCachedModel(model, pad_token_id=0)
    a.use_kernel(BLOCKS)
    b.use_kernel(NATIVE)
    seq = list(range(1, 20))
    for runner in (a, b):
        runner.reset(1)
        runner.forward_to([seq], keep_logits=1)
        runner.forward_to([seq + [3, 4, 5]], keep_logits=3)
    for ka, kb in zip(a.static.keys + a.static.values, b.static.keys + b.static.values):
        torch.testing.assert_close(ka[:, :, :22], kb[:, :, :22], atol=1e-5, rtol=1e-5)


def test_an_edited_projection_or_a_partial_rotation_sends_the_forward_back_to_torch():
    model = blocked_llama()
    runner = StaticCachedModel(model, pad_token_id=0)
    runner.use_kernel(NATIVE)
    one = (torch.zeros(1, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([0]))  # positions, starts, rows
    half = torch.ones(1, 4)  # a rotation over half of each 8-wide head: not what the C rotates
    assert runner.native(torch.zeros(1, 32), half, half, *one) is None
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(2)  # the blocks no longer hold it
    assert runner.native(torch.zeros(1, 32), torch.ones(1, 8), torch.zeros(1, 8), *one) is None
    _walk(runner, model, rows=1, seed=7, steps=4)  # the torch forward, with the edited weight


def test_positions_outside_the_cache_are_refused():
    model = blocked_llama()
    runner = StaticCachedModel(model, pad_token_id=0, max_len=16)
    with pytest.raises(ValueError, match="positions"):
        runner._native(torch.zeros(1, 32), torch.ones(1, 8), torch.zeros(1, 8), torch.tensor([16]),
                       torch.tensor([0, 1]), torch.tensor([0]))


def test_only_models_the_native_stack_computes_are_eligible():
    assert eligible(StaticCachedModel(blocked_llama(), pad_token_id=0).static)
    assert not eligible(StaticCachedModel(tiny_family("llama", VOCAB), pad_token_id=0).static)  # no blocks
    partly = blocked_llama()
    with torch.no_grad():
        partly.model.layers[0].self_attn.o_proj.weight.add_(1e-3)
    runner = StaticCachedModel(partly, pad_token_id=0)
    assert NATIVE not in runner.kernels()
    assert BLOCKS in runner.kernels()  # the other projections still run from their blocks
    mixed = blocked_llama()
    k_proj = mixed.model.layers[1].self_attn.k_proj
    blocks = random_blocks("q8_0", k_proj.out_features, k_proj.in_features)
    with torch.no_grad():
        k_proj.weight.copy_(blocks.dequantize())
    k_proj.use_blocks(blocks)  # q, k and v of two kinds: each projection is its own product
    assert eligible(StaticCachedModel(mixed, pad_token_id=0).static)
    for family in ("qwen2", "qwen3"):  # q/k/v biases, per-head q/k norms: in decode_layers.c
        assert eligible(StaticCachedModel(blocked_family(family), pad_token_id=0).static)
    o_bias = blocked_llama()
    o_proj = o_bias.model.layers[1].self_attn.o_proj
    o_proj.bias = torch.nn.Parameter(torch.ones(o_proj.out_features))  # not in decode_layers.c
    assert refusal(StaticCachedModel(o_bias, pad_token_id=0).static) == "layer 1: a bias on o, gate, up or down"
    assert "without GGUF blocks" in str(refusal(StaticCachedModel(partly, pad_token_id=0).static))


@pytest.mark.parametrize("flags", [("-mavx2", "-mfma"), ("-mno-avx2",)])
def test_every_instruction_set_build_runs_the_same_layers(tmp_path, flags):
    path = tmp_path / "blockq.so"
    blockq.build(path, flags)
    lib = blockq.load(path)
    model = blocked_llama(hidden=128, kinds=q4_k_m)  # every quantized layout of blockq.c but Q4_1's
    runner = StaticCachedModel(model, pad_token_id=0, max_len=48)
    runner._native = NativeLayers(runner.static, lib=lib, chunk=8)
    runner.use_kernel(NATIVE)
    _walk(runner, model, rows=2, seed=11, steps=8)
    for family, kinds in (("qwen2", ("f16", "q4_1")), ("qwen3", ("bf16", "f32"))):  # biases, q/k norms, floats
        model = blocked_family(family, kinds=kinds)
        runner = StaticCachedModel(model, pad_token_id=0, max_len=48)
        runner._native = NativeLayers(runner.static, lib=lib, chunk=8)
        runner.use_kernel(NATIVE)
        _walk(runner, model, rows=1, seed=12, steps=4)


@pytest.mark.parametrize(("kernel", "hidden", "threads"),
                         [(NATIVE, 32, 1), (NATIVE, 64, 2), (NATIVE_4ROW, 64, 2), (BLOCKS, 64, 1)])
def test_rows_of_different_widths_share_one_forward(kernel, hidden, threads):
    """A step's rows, each feeding its own amount (prompt, prompt piece, draft, one token), in one
    ragged forward of the native stack (BLOCKS: the torch layers over the same blocks)."""
    model = blocked_llama(hidden=hidden)
    runner = StaticCachedModel(model, pad_token_id=0, max_len=48)
    runner._native = NativeLayers(runner.static, chunk=8)
    runner.use_kernel(kernel)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ragged_walk(model, runner, rows=3, seed=hidden + threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kernel", [NATIVE, NATIVE_4ROW])
def test_a_rows_layers_are_the_same_bits_alone_and_beside_others(kernel):
    """What the layer stack computes for a row does not depend on the rows fed beside it (their
    number, widths or place): every product and attention step of a token reads only its own
    row's values. (The LM head after it is torch's, whose products may round by the batch.)"""
    model = blocked_llama(hidden=64)
    rng = random.Random(4)
    seq = [rng.randrange(VOCAB) for _ in range(21)]
    draft = [3, 1, 4, 1, 5]
    others = [[rng.randrange(VOCAB) for _ in range(n)] for n in (33, 6)]
    fed_alone = [([seq], [0], [1]), ([draft], [len(seq)], [1])]  # (chunks, offsets, cache rows) per step
    fed_beside = [([others[0], seq, others[1]], [0, 0, 0], [0, 1, 2]),
                  ([[2] * 9, draft, [5]], [33, len(seq), 6], [0, 1, 2])]
    results = []
    for steps in (fed_alone, fed_beside):
        runner = StaticCachedModel(model, pad_token_id=0)
        runner.use_kernel(kernel)
        runner.reset(3)
        out = []
        for chunks, offsets, rows in steps:
            feed = Feed.of(chunks, offsets, rows)
            hidden = ragged.hidden(runner.static, feed, runner.native)  # [T, hidden]
            b = rows.index(1)  # the middle cache row, alone or between two others
            out.append(hidden[int(feed.starts[b]):int(feed.starts[b + 1])])
        results.append(out)
    for a, b in zip(*results):
        assert torch.equal(a, b)
