"""The demo: an agent-like stream of steps on the default model, against plain HF `generate`.

Greedy decoding on both sides, so the two must produce the same tokens; the demo checks that and
reports the speedup measured in the same run on the same machine.
"""
from __future__ import annotations

import time
from collections import Counter

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from flashspec_core.engine import SpecEngine
from flashspec_core.models import load_model
from flashspec_workloads.dev import demo_workload

# What the LangChain and LlamaIndex adapters pass for these steps (tools bound, retrieval
# synthesis); chat and code are left to the engine's prompt classifier.
ADAPTER_HINTS = {"tool", "rag"}


def stock_default_model() -> PreTrainedModel:
    """A fresh copy of the default target as transformers builds it, for the HF baselines.

    The engine swaps the CPU linear layers of the model it runs (cpu_linear.py), so the baseline
    must not share that object: it measures stock transformers.
    """
    return load_model(None).model


def hf_generate(engine: SpecEngine, model: PreTrainedModel, messages, max_new_tokens: int,
                **generate_kwargs) -> tuple[list[int], float]:
    """Plain HF `generate` (greedy) of `model` on the engine's encoding of `messages`.

    Returns the new tokens and the seconds taken. `generate_kwargs` reach `generate` (e.g.
    `prompt_lookup_num_tokens` for HF's own assisted mode).
    """
    ids = engine._encode_all([messages], max_new_tokens)[0]
    inputs = torch.tensor([ids], device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=engine.tokenizer.pad_token_id, **generate_kwargs)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def run_demo(max_new_tokens: int = 64, baseline: bool = True) -> None:
    engine = SpecEngine.from_default()
    steps = demo_workload(max_new_tokens=max_new_tokens)
    rows, spec_tokens, spec_seconds, outputs = [], 0, 0.0, []
    for step in tqdm(steps, desc="flashspec", unit="step"):
        res = engine.generate(step.messages, max_new_tokens=step.max_new_tokens,
                              hint=step.domain if step.domain in ADAPTER_HINTS else None)
        arms = Counter(a for a in res.stats.arms)
        rows.append((step.domain, res.stats.domain, arms.most_common(1)[0][0], res.stats.drafted,
                     res.stats.accepted, len(res.token_ids), res.tokens_per_second))
        spec_tokens += len(res.token_ids)
        spec_seconds += res.stats.seconds
        outputs.append(res.token_ids)
    print(f"\n{'step':>4} {'workload':<8} {'domain':<8} {'draft (most used)':<20} {'drafted':>7} {'accepted':>8} {'tokens':>6} {'tok/s':>7}")
    for i, (wl, dom, arm, drafted, accepted, n, tps) in enumerate(rows):
        print(f"{i:>4} {wl:<8} {dom:<8} {arm:<20} {drafted:>7} {accepted:>8} {n:>6} {tps:>7.1f}")
    spec_rate = spec_tokens / spec_seconds
    print(f"\nflashspec: {spec_tokens} tokens in {spec_seconds:.2f} s = {spec_rate:.1f} tok/s")
    if not baseline:
        return
    hf_tokens, hf_seconds, same = 0, 0.0, 0
    stock = stock_default_model()
    for step, ours in tqdm(list(zip(steps, outputs)), desc="HF generate", unit="step"):
        theirs, seconds = hf_generate(engine, stock, step.messages, step.max_new_tokens)
        hf_tokens += len(theirs)
        hf_seconds += seconds
        same += theirs == ours
    hf_rate = hf_tokens / hf_seconds
    print(f"HF generate: {hf_tokens} tokens in {hf_seconds:.2f} s = {hf_rate:.1f} tok/s")
    print(f"speedup over HF generate: {spec_rate / hf_rate:.2f}x   identical outputs: {same}/{len(steps)} steps")
