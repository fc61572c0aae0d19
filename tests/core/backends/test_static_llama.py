"""The static-cache forward behind the CUDA-graph target, run eagerly on the CPU.

After any history of rollbacks, growth and rows of a batch advancing by different amounts, each
row's logits equal a fresh transformers forward of its sequence, for every model family the
forward claims to support, on each path: transformers' ops, the fused path in torch ops, and the
fused path on fused_ops' Triton kernels (here under TRITON_INTERPRET=1, see conftest.py; it runs
milliseconds per kernel program, so those walks are shorter and cover one row count per family).
On a GPU the same runner replays graphs (tests/gpu/).
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_family

from flashspec_core.backends.cuda_graph import GraphedModel
from flashspec_core.backends.static_llama import StaticLlama, supports

VOCAB = 24


MODELS = {family: (lambda family=family: tiny_family(family, VOCAB)) for family in ("llama", "qwen2", "qwen3")}


@torch.no_grad()
def _fresh(model, seq, keep):
    return model(input_ids=torch.tensor([seq])).logits[0, -keep:]


PATHS = ("hf ops", "fused torch", "fused kernels")
CASES = [(family, rows, path) for family in MODELS for rows in (1, 3) for path in PATHS[:2]] + [
    ("llama", 3, "fused kernels"), ("qwen3", 1, "fused kernels"), ("qwen2", 1, "fused kernels")]


@pytest.mark.parametrize(("family", "rows", "path"), CASES)
def test_logits_match_a_fresh_forward_after_rollbacks(family, rows, path, torch_one_thread):
    model = MODELS[family]()
    assert supports(model)
    runner = GraphedModel(model, pad_token_id=0, max_len=48, graphs=False, fuse=path != "hf ops")
    if path == "fused torch":
        runner.static.ops = None
    elif path == "fused kernels" and runner.static.ops is None:
        pytest.skip("the Triton kernels run on CUDA or under TRITON_INTERPRET=1 (is triton installed?)")
    rng = random.Random(rows)
    runner.reset(rows)
    seqs = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(rows)]
    for _ in range(9 if path == "fused kernels" else 25):  # 9: enough to grow the cache
        keep = rng.choice([1, 2, 5])
        seqs = [s[:max(1, len(s) - rng.randint(0, 4))] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]
                for s in seqs]
        seqs = [s + [1] * max(0, keep - len(s)) for s in seqs]
        active = [b == 0 or rng.random() < 0.7 for b in range(rows)]
        out = runner.forward_to(seqs, active, keep_logits=keep)
        assert out.shape == (rows, keep, VOCAB)
        for b, s in enumerate(seqs):
            if active[b]:
                torch.testing.assert_close(out[b], _fresh(model, s, keep), atol=1e-4, rtol=1e-4)
    assert runner.static.max_len > 48, "the walk should have grown the cache past its first size"


@pytest.mark.parametrize("path", PATHS[:2])
def test_fewer_rows_than_allocated_use_the_first_ones_and_stay_exact(path, torch_one_thread):
    """Batches of changing size keep the largest allocation (so graphs captured on it stay valid);
    a batch of fewer rows feeds and attends over the first rows only, and a larger one reallocates."""
    model = MODELS["llama"]()
    runner = GraphedModel(model, pad_token_id=0, max_len=48, graphs=False, fuse=path != "hf ops")
    runner.static.ops = None
    rng = random.Random(4)
    for rows in (3, 1, 2, 3, 4):
        allocated = runner.static.keys[0]
        runner.reset(rows)
        assert (runner.static.keys[0] is allocated) == (rows <= allocated.shape[0])
        seqs = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(rows)]
        for _ in range(4):
            seqs = [s + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))] for s in seqs]
            out = runner.forward_to(seqs, keep_logits=1)
            assert out.shape == (rows, 1, VOCAB)
            for b, s in enumerate(seqs):
                torch.testing.assert_close(out[b], _fresh(model, s, 1), atol=1e-4, rtol=1e-4)
    assert runner.static.rows == 4


def test_prefix_reuse_across_requests_feeds_only_the_new_tail(torch_one_thread):
    model = MODELS["llama"]()
    runner = GraphedModel(model, pad_token_id=0, graphs=False)
    runner.begin(1)
    runner.forward_to([[1, 2, 3, 4, 5, 6]], keep_logits=1)
    runner.begin(1)  # the next single-prompt request
    assert runner.prefix_len(0, [1, 2, 3, 4, 9]) == 4
    out = runner.forward_to([[1, 2, 3, 4, 9, 10]], keep_logits=2)
    torch.testing.assert_close(out[0], _fresh(model, [1, 2, 3, 4, 9, 10], 2), atol=1e-4, rtol=1e-4)


def test_tokens_fed_from_the_device_extend_each_row_and_settle(torch_one_thread):
    """`feed_tokens` (a model draft's loop on a GPU: no host read per token) appends a token to
    every row as forward_to would; the host records hold placeholders until `settle`, which makes
    the prefix reusable again, and a placeholder never counts as a held token before that."""
    model = MODELS["llama"]()
    runner = GraphedModel(model, pad_token_id=0, max_len=40, graphs=False)
    runner.reset(2)
    seqs = [[1, 2, 3, 4, 5], [6, 7, 8]]
    runner.forward_to(seqs, keep_logits=1)
    for step in range(12):  # past the first cache size: growth while feeding
        new = torch.tensor([(3 * step) % VOCAB, (5 * step + 1) % VOCAB])
        out = runner.feed_tokens(new)
        seqs = [s + [int(t)] for s, t in zip(seqs, new)]
        assert out.shape == (2, 1, VOCAB)
        for b, s in enumerate(seqs):
            torch.testing.assert_close(out[b], _fresh(model, s, 1), atol=1e-4, rtol=1e-4)
    assert runner.prefix_len(0, seqs[0]) == 5 and runner.prefix_len(1, seqs[1]) == 3
    runner.settle([s[-12:] for s in seqs])
    assert runner.prefix_len(0, seqs[0]) == len(seqs[0]) and runner.static.max_len > 40
    out = runner.forward_to([s + [9] for s in seqs], keep_logits=1)  # feeds only the new token
    torch.testing.assert_close(out[1], _fresh(model, seqs[1] + [9], 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("keep", [1, 3])
def test_prompts_fed_in_pieces_give_each_row_its_own_logits(torch_one_thread, keep):
    """The bookkeeping of a GPU runner's prefill graph (`_prefill_in_pieces`), with each replay
    stood in for by the same forward run eagerly on the CPU: rows of a batch feed different
    lengths (one piece, several, an exact multiple, a short row, an inactive one), each active
    row's logits come from the piece it ends in and equal a fresh forward, and each row holds
    exactly its sequence afterwards. The graphs themselves: tests/gpu/test_cuda_graph.py."""
    model = MODELS["llama"]()
    runner = GraphedModel(model, pad_token_id=0, max_len=40, graphs=False)
    widths = []

    def replay(chunks, width):  # what a graph replay computes: ids and positions padded to width
        widths.append(width)
        runner._ensure(max(len(h) for h in runner.held) + width)
        host = runner._host_inputs(chunks, width)
        return SimpleNamespace(logits=runner.static(host[0], host[1]))

    runner._replay, runner.prefill_width = replay, 8
    rng = random.Random(keep)
    runner.reset(4)
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (21, 16, 4, 9)]
    active = [True, True, True, False]
    out = runner.forward_to(seqs, active, keep_logits=keep)
    assert widths == [8, 8, 8]  # the longest row's 21 tokens: 8 + 8 + 5
    for b in range(3):
        torch.testing.assert_close(out[b], _fresh(model, seqs[b], keep), atol=1e-4, rtol=1e-4)
    assert [len(h) for h in runner.held] == [21, 16, 4, 0]
    seqs = [s + [rng.randrange(VOCAB) for _ in range(n)] for s, n in zip(seqs, (30, 3, 12, 11))]
    widths.clear()
    out = runner.forward_to(seqs, [True] * 4, keep_logits=keep)  # prefix reuse, then growth past 40 slots
    assert widths == [8, 8, 8, 8]  # 30 more tokens on the longest row
    for b in range(4):
        torch.testing.assert_close(out[b], _fresh(model, seqs[b], keep), atol=1e-4, rtol=1e-4)
    assert [h == s for h, s in zip(runner.held, seqs)] == [True] * 4 and runner.static.max_len > 40
    runner.reset(2)  # a row whose last piece is shorter than the logits asked for: eagerly
    widths.clear()
    seqs = [[1] * 9, [2] * 3]
    out = runner.forward_to(seqs, keep_logits=3)
    assert widths == []
    torch.testing.assert_close(out[0], _fresh(model, seqs[0], 3), atol=1e-4, rtol=1e-4)


def test_unsupported_models_are_refused_with_the_reason():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    assert not supports(gpt2)
    with pytest.raises(ValueError, match="Llama-family"):
        StaticLlama(gpt2, max_len=16)


def test_graphs_need_a_cuda_model():
    with pytest.raises(ValueError, match="CUDA"):
        GraphedModel(MODELS["llama"](), pad_token_id=0, graphs=True)


def test_rms_norm_in_one_kernel_equals_transformers_norms_bit_for_bit():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from flashspec_core.backends.static_llama import rms_norm

    gen = torch.Generator().manual_seed(0)
    for cls in (LlamaRMSNorm, Qwen3RMSNorm):
        norm = cls(576, eps=1e-5)
        with torch.no_grad():
            norm.weight.normal_(generator=gen)
        for width in (1, 5, 300):
            x = torch.randn(2, width, 576, generator=gen) * 3
            assert torch.equal(rms_norm(norm, x), norm(x)), f"{cls.__name__} at width {width}"
