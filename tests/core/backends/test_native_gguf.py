"""Qwen2, Qwen3 and Llama GGUF files, as a user would bring them, through the native layer stack.

Each file here is written at test time by gguf-py: a tiny random model (2 layers, head dim 128,
Qwen3's default) whose projections are random blocks of the types a real file mixes (Q4_K, Q5_0,
Q6_K, Q8_0, and F16 and BF16 tensors), or all F16 or BF16 (an unquantized file), with fp32 norms,
Qwen2's q/k/v biases and Qwen3's per-head q/k norms (a Llama file's q and k rows are permuted, as
llama.cpp's converter writes them, and transformers permutes them back). transformers loads it by
de-quantising every tensor; the engine's runner attaches the
file's blocks to every projection (bit for bit the loaded weights), runs its layers in
`decode_layers.c`, and its greedy tokens must be transformers' `generate` on the same file, its
logits generate's within fp32 rounding (a greedy token alone can survive a skipped bias).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TIE_GAP, random_gguf_bytes

from flashspec_core.backends import blockq
from flashspec_core.backends.cpu_linear import PackedLinear
from flashspec_core.backends.cpu_static import StaticCachedModel
from flashspec_core.backends.native_layers import NATIVE

pytestmark = pytest.mark.skipif(not blockq.available(), reason="no C compiler for the block kernel")

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, HEAD_DIM = 64, 256, 2, 2, 1, 512, 128
# per projection: its GGUF type (a K-quant where the width allows, as Q4_K_M files; F16 and BF16 too)
MIXED = {"attn_q": "q4_k", "attn_k": "f16", "attn_v": "q6_k", "attn_output": "q5_0", "ffn_gate": "q4_k",
         "ffn_up": "bf16", "ffn_down": "q6_k", "output": "q8_0"}
F16 = dict.fromkeys(MIXED, "f16")
BF16 = dict.fromkeys(MIXED, "bf16")
MAX_NEW = 12


def write_random_gguf(path: Path, arch: str, types: dict[str, str]) -> Path:
    """A random-weight `arch` ("qwen2", "qwen3" or "llama") model as a GGUF file at `path` (no
    tokenizer), each projection and the head of its GGUF type in `types`; the embedding Q8_0."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    gen = torch.Generator().manual_seed(0)

    def vector(name: str, size: int, mean: float) -> None:
        writer.add_tensor(name, (mean + 0.5 * torch.randn(size, generator=gen)).numpy().astype(np.float32))

    def matrix(name: str, kind: str, out: int, inp: int, seed: int) -> None:
        raw = random_gguf_bytes(kind, out, inp, seed).numpy()  # [out, bytes per row]
        if kind == "f16":
            writer.add_tensor(name, raw.view(np.float16).reshape(out, inp))
        else:
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind.upper()])

    matrix("token_embd.weight", "q8_0", VOCAB, HIDDEN, 1)
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    for layer in range(LAYERS):
        prefix = f"blk.{layer}."
        vector(prefix + "attn_norm.weight", HIDDEN, 1.0)
        vector(prefix + "ffn_norm.weight", HIDDEN, 1.0)
        for i, (name, (out, inp)) in enumerate(shapes.items()):
            matrix(f"{prefix}{name}.weight", types[name], out, inp, seed=10 * layer + i + 2)
        if arch == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                vector(f"{prefix}{name}.bias", shapes[name][0], 0.0)
        elif arch == "qwen3":
            vector(prefix + "attn_q_norm.weight", HEAD_DIM, 1.0)
            vector(prefix + "attn_k_norm.weight", HEAD_DIM, 1.0)
    vector("output_norm.weight", HIDDEN, 1.0)
    matrix("output.weight", types["output"], VOCAB, HIDDEN, 99)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize(("arch", "types"), [("qwen2", MIXED), ("qwen3", MIXED), ("llama", F16), ("qwen2", BF16)],
                         ids=["qwen2-mixed", "qwen3-mixed", "llama-f16", "qwen2-bf16"])
def test_greedy_from_a_random_gguf_is_transformers_generate(tmp_path, arch, types):
    path = write_random_gguf(tmp_path / f"tiny-{arch}.gguf", arch, types)
    stock, model = _load(path), _load(path)
    stock.generation_config.eos_token_id = None  # random weights: every step a token, whatever it is
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                    "llama": "LlamaForCausalLM"}[arch]
    runner = StaticCachedModel(model, pad_token_id=0, gguf=path)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert runner.block_layers == len(layers) == 7 * LAYERS + 1  # every projection and the head
    assert {m.blocks().kind for m in layers} == set(types.values())
    assert NATIVE in runner.kernels()
    runner.use_kernel(NATIVE)
    calls = []
    native = runner.native
    runner.native = lambda *args: calls.append(1) or native(*args)
    for prompt in ([3, 17, 42, 5, 9], [60, 1, 1, 2, 33, 8, 21, 13, 4]):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = stock.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                                 output_logits=True, return_dict_in_generate=True)
        expected = out.sequences[0, len(prompt):].tolist()
        assert len(expected) == MAX_NEW
        top2 = torch.stack([step[0].topk(2).values for step in out.logits])
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        runner.reset(1)
        seq = list(prompt)
        for step in range(MAX_NEW):
            logits = runner.forward_to([seq], keep_logits=1)[0, -1]  # [V]
            if seq[len(prompt):] == expected[:step]:  # the same prefix as generate's: the same logits
                torch.testing.assert_close(logits, out.logits[step][0], atol=1e-4, rtol=1e-4)
            seq.append(int(logits.argmax()))
        got = seq[len(prompt):]
        if got != expected:
            at = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
            assert gaps[at] < TIE_GAP, f"{arch}: diverges from generate at token {at}, top-2 gap {gaps[at]:.2e}"
    assert calls, "the native stack never ran"
