"""The distillation pipeline: prompts -> target continuations -> trained draft -> weights and model card.

`flashspec-agents distill` runs it with ShareGPT's conversations. Each stage can be cut short or
reused: `--export-prompts` tokenises the conversations where the dataset is installed and stops
(for a GPU host without it), `--data` caches the target's continuations so a
second draft (a specialist) trains on the same text without regenerating it, `--resume` continues
from the checkpoint, and `--time-budget` / `--gen-time` bound the wall-clock time of a run.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from flashspec_core.distill.card import write_card
from flashspec_core.distill.data import Conversation, TokenSet, conversation_prompts, frequent_tokens
from flashspec_core.distill.evaluate import evaluate_draft
from flashspec_core.distill.generate import continue_prompts
from flashspec_core.distill.model import DraftNetwork, decoder_layers, load_draft, save_draft
from flashspec_core.distill.options import DistillOptions
from flashspec_core.distill.train import TrainConfig, train_draft
from flashspec_core.models import LoadedModel, eos_ids, load_model, resolve_device, vocab_size


def _continuations(opts: DistillOptions, loaded: LoadedModel, prompts: TokenSet, pad: int, eos: list[int]) -> TokenSet:
    """Dev rows (greedy, for evaluation) then train rows (time-limited) of the target's continuations."""
    dev = TokenSet()
    for domain in ("chat", "code"):
        rows = prompts.select(domain, "dev").take(opts.dev_rows)
        for s, d, sp, p in zip(rows.seqs, rows.domains, rows.splits, rows.prompt_lens):
            dev.append(s, d, sp, p)
    train_prompts = prompts.select(opts.domain, "train")
    if opts.max_prompts is not None:
        train_prompts = train_prompts.take(opts.max_prompts)
    common: dict[str, Any] = dict(max_new_tokens=opts.gen_tokens, eos_ids=eos, pad_token_id=pad,
                                  batch_size=opts.gen_batch, seed=opts.seed, progress=opts.progress)
    start = time.perf_counter()
    out = continue_prompts(loaded.model, dev, sample_fraction=0.0, **common)
    left = None if opts.gen_time is None else max(1.0, opts.gen_time - (time.perf_counter() - start))
    gen = continue_prompts(loaded.model, train_prompts, sample_fraction=opts.sample_fraction, time_budget=left,
                           **common)
    for s, d, sp, p in zip(gen.seqs, gen.domains, gen.splits, gen.prompt_lens):
        out.append(s, d, sp, p)
    return out


def run_distill(opts: DistillOptions, loaded: LoadedModel | None = None,
                conversations: Callable[[], Iterable[Conversation]] | None = None) -> dict:
    """The whole pipeline; returns a summary (paths, steps, final metrics). `loaded` overrides
    `opts.target`; `conversations` gives the prompts' source when no `opts.prompts` file is given
    (read only then)."""
    device = resolve_device(opts.device)
    loaded = loaded or load_model(opts.target, device=device)
    model, tok = loaded.model, loaded.tokenizer
    vocab = vocab_size(model)

    def prompts_from_conversations() -> TokenSet:
        if conversations is None:
            raise ValueError("prompts: give a --prompts file (or conversations to draw prompts from)")
        return conversation_prompts(conversations(), tok, vocab, opts.max_prompt_tokens, seed=opts.seed)

    if opts.export_prompts:
        prompts = prompts_from_conversations()
        path = prompts.save(opts.export_prompts)
        return {"prompts": str(path), "rows": len(prompts)}
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos = sorted(eos_ids(loaded))
    if opts.data and Path(opts.data).is_file():
        data = TokenSet.load(opts.data)
    else:
        prompts = TokenSet.load(opts.prompts) if opts.prompts else prompts_from_conversations()
        data = _continuations(opts, loaded, prompts, pad, eos)
        if opts.data:
            data.save(opts.data)
    train_rows, dev_rows = data.select(opts.domain, "train"), data.select(None, "dev")
    if opts.max_prompts is not None:
        train_rows = train_rows.take(opts.max_prompts)
    if not len(train_rows):
        raise ValueError(f"domain: no training rows of domain {opts.domain!r} in the data; check --prompts/--data")
    if opts.layers > len(decoder_layers(model)):
        raise ValueError(f"layers: the target has only {len(decoder_layers(model))} layers; use at most that many")
    # The target's first layers: their residual stream is coherent, unlike first + last (docs/distill.md).
    init_layers = list(range(opts.layers))
    vocab_ids = frequent_tokens(train_rows.continuation_tokens(), opts.vocab, always=eos)
    network = DraftNetwork(model, opts.layers, vocab_ids, init_layers=init_layers, dtype=torch.float32)
    if opts.init_from:
        start, _ = load_draft(opts.init_from, model, dtype=torch.float32)
        if start.num_layers != opts.layers:
            raise ValueError(f"init_from: {opts.init_from} has {start.num_layers} layers but --layers is {opts.layers}")
        network.lm.load_state_dict(start.trainable_state(), strict=False)
        del start
    cfg = TrainConfig(steps=opts.steps, batch_size=opts.batch_size, lr=opts.lr, time_budget=opts.time_budget,
                      checkpoint_every=opts.checkpoint_every, seed=opts.seed,
                      warmup=min(50, max(1, opts.steps // 10)))
    result = train_draft(network, model, train_rows, cfg, pad, checkpoint=out_dir / f"{opts.name}.ckpt.pt",
                         resume=opts.resume, progress=opts.progress)
    evaluation = evaluate_draft(network, model, dev_rows, pad) if len(dev_rows) else {}
    weights = save_draft(network, model, out_dir / f"{opts.name}.safetensors", {
        "name": opts.name, "domain": opts.domain, "target": loaded.name, "steps": str(result.steps)})
    info = {
        "name": opts.name, "target": Path(loaded.name).stem if loaded.name.endswith(".gguf") else loaded.name,
        "domain": opts.domain,
        "architecture": {"num_layers": opts.layers, "hidden_size": model.config.hidden_size, "init_layers": init_layers,
                         "head_size": len(vocab_ids),
                         "parameters": sum(v.numel() for v in network.trainable_state().values()),
                         "file_bytes": weights.stat().st_size, "dtype": "bfloat16"},
        "data": {"domain": opts.domain, "train_rows": len(train_rows), "max_prompt_tokens": opts.max_prompt_tokens,
                 "gen_tokens": opts.gen_tokens, "sample_fraction": opts.sample_fraction,
                 "train_tokens": sum(1 for _ in train_rows.continuation_tokens()), "dev_rows": len(dev_rows)},
        "training": {"steps": result.steps, "seconds": result.seconds, "device": _device_name(device),
                     "batch_size": opts.batch_size, "lr": opts.lr,
                     "init_from": Path(opts.init_from).name if opts.init_from else None,
                     "history": result.history},
        "evaluation": evaluation,
    }
    card = write_card(out_dir / f"{opts.name}.md", info)
    return {"weights": str(weights), "card": str(card), "steps": result.steps, "final": result.final,
            "evaluation": evaluation}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"
