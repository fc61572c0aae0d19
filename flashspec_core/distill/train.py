"""Self-distillation: fit the draft to the target's next-token distributions on the target's outputs.

The loss at each continuation position is the cross-entropy from the target's distribution at
temperature 1 (restricted to the draft's head subset, the only tokens the draft can propose) to the
draft's, i.e. the forward KL up to a constant. Acceptance of a speculative step is governed by how
much of p the draft's q covers, which the forward KL drives up. The target is run alongside (frozen,
no grad) instead of storing its 49k-wide distributions. Progress is shown with tqdm and saved to a
checkpoint that `resume=True` continues from, step for step (batch order is a function of the step).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from flashspec_core.distill.data import TokenSet
from flashspec_core.distill.model import DraftNetwork


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.0
    time_budget: float | None = None  # seconds of training (a resumed run counts earlier time too)
    checkpoint_every: int = 200
    log_every: int = 25
    seed: int = 0
    max_len: int = 640  # longest sequence fed (prompt tail kept, continuation whole)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every", "log_every", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int; got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive; got {self.lr!r}")


@dataclass
class TrainResult:
    steps: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)  # one entry per log interval

    @property
    def final(self) -> dict[str, float]:
        return self.history[-1] if self.history else {}


def make_batch(data: TokenSet, rows: list[int], pad_token_id: int, max_len: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], attention mask [B, T], loss mask [B, T] and the batch's prompt tokens.

    The loss mask marks positions whose next token is part of the target's continuation (the last
    prompt position included: the draft's first guess follows the prompt). Over-long rows lose the
    start of their prompt.
    """
    seqs, starts = [], []
    for r in rows:
        seq, p = data.seqs[r], data.prompt_lens[r]
        cut = max(0, len(seq) - max_len)
        seqs.append(seq[cut:])
        starts.append(max(1, p - cut))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, (seq, p) in enumerate(zip(seqs, starts)):
        ids[b, : len(seq)] = torch.tensor(seq)
        attn[b, : len(seq)] = 1
        loss_mask[b, p - 1: len(seq) - 1] = True
    prompt_tokens = torch.tensor(sorted({t for s, p in zip(seqs, starts) for t in s[:p]}), dtype=torch.long)
    return ids.to(device), attn.to(device), loss_mask.to(device), prompt_tokens


def target_logprobs(target: PreTrainedModel, ids: torch.Tensor, attn: torch.Tensor,
                    loss_mask: torch.Tensor) -> torch.Tensor:
    """The target's log-probabilities at the masked positions. ids, attn, loss_mask: [B, T] -> [N, V] float32."""
    with torch.no_grad():
        hidden = target.model(input_ids=ids, attention_mask=attn).last_hidden_state[loss_mask]  # [N, H]
        return target.get_output_embeddings()(hidden).float().log_softmax(-1)


def distill_loss(network: DraftNetwork, target_logp: torch.Tensor, ids: torch.Tensor, attn: torch.Tensor,
                 loss_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy from target p to draft q over the current head; also KL, top-1 agreement, p mass in the head.

    target_logp: [N, V] from `target_logprobs`; ids, attn, loss_mask: [B, T].
    """
    hidden = network.hidden(ids, attn)[loss_mask]  # [N, H]
    logq = network.lm.lm_head(hidden).float().log_softmax(-1)  # [N, K']
    logp = target_logp.index_select(1, network.head_ids)  # [N, K']
    p = logp.exp()
    loss = -(p * logq).sum(-1).mean()
    with torch.no_grad():
        mass = p.sum(-1).clamp_min(1e-9)
        kl = ((p * (logp - logq)).sum(-1) / mass - mass.log()).mean()  # KL(p restricted and renormalised || q)
        top1 = (network.head_ids[logq.argmax(-1)] == target_logp.argmax(-1)).float().mean()
    return loss, {"loss": loss.detach(), "kl": kl, "top1": top1, "mass": mass.mean()}


def _lr_factor(step: int, progress: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % over the run's progress (steps or time, whichever is further)."""
    warm = min(1.0, (step + 1) / max(1, warmup))
    return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def _batch_rows(step: int, batches: list[list[int]], seed: int) -> list[int]:
    """Rows of the batch at `step`: length-bucketed batches, reshuffled every epoch, a pure function of step."""
    epoch, j = divmod(step, len(batches))
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return batches[int(torch.randperm(len(batches), generator=gen)[j])]


def _save_checkpoint(path: Path, network: DraftNetwork, optim: torch.optim.Optimizer, step: int, seconds: float,
                     history: list[dict[str, float]], cfg: TrainConfig) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "seconds": seconds, "history": history, "config": asdict(cfg),
                "state": network.trainable_state(), "optim": optim.state_dict(),
                "vocab_ids": network.vocab_ids.cpu()}, tmp)
    tmp.replace(path)


def train_draft(
    network: DraftNetwork,
    target: PreTrainedModel,
    data: TokenSet,
    cfg: TrainConfig,
    pad_token_id: int,
    checkpoint: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
) -> TrainResult:
    """Train `network` in place on `data` (rows with continuations) and return what happened."""
    usable = [i for i in range(len(data)) if len(data.seqs[i]) > data.prompt_lens[i]]
    if not usable:
        raise ValueError("data: no row has a continuation to learn from; generate continuations first")
    device = network.vocab_ids.device
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    usable.sort(key=lambda i: len(data.seqs[i]))
    batches = [usable[i:i + cfg.batch_size] for i in range(0, len(usable), cfg.batch_size)]
    params = network.trainable_parameters()
    for p in params:
        p.requires_grad_(True)
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, seconds, history = 0, 0.0, []
    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt is not None and resume and ckpt.is_file():
        saved = torch.load(ckpt, map_location=device, weights_only=False)
        if not torch.equal(saved["vocab_ids"].to(device), network.vocab_ids):
            raise ValueError(f"checkpoint: {ckpt} was trained with another head subset; delete it or drop --resume")
        network.lm.load_state_dict(saved["state"], strict=False)
        optim.load_state_dict(saved["optim"])
        step, seconds, history = saved["step"], saved["seconds"], saved["history"]
    network.lm.train()
    sums: dict[str, float] = {}
    n_sum = 0
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not progress)
    started = time.perf_counter() - seconds
    while step < cfg.steps and (cfg.time_budget is None or time.perf_counter() - started < cfg.time_budget):
        ids, attn, loss_mask, prompt_tokens = make_batch(data, _batch_rows(step, batches, cfg.seed), pad_token_id,
                                                         cfg.max_len, device)
        network.set_head(network.head_with(prompt_tokens))
        with autocast:
            logp = target_logprobs(target, ids, attn, loss_mask)
            loss, metrics = distill_loss(network, logp, ids, attn, loss_mask)
        elapsed = time.perf_counter() - started
        progress_frac = max(step / cfg.steps, elapsed / cfg.time_budget if cfg.time_budget else 0.0)
        for group in optim.param_groups:
            group["lr"] = cfg.lr * _lr_factor(step, progress_frac, cfg.warmup)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        step += 1
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        n_sum += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
            entry = {"step": step, "seconds": round(time.perf_counter() - started, 1),
                     **{k: round(v / n_sum, 4) for k, v in sums.items()}}
            history.append(entry)
            bar.set_postfix(loss=entry["loss"], kl=entry["kl"], top1=entry["top1"])
            sums, n_sum = {}, 0
        if ckpt is not None and step % cfg.checkpoint_every == 0:
            _save_checkpoint(ckpt, network, optim, step, time.perf_counter() - started, history, cfg)
        bar.update(1)
    bar.close()
    if n_sum:
        history.append({"step": step, "seconds": round(time.perf_counter() - started, 1),
                        **{k: round(v / n_sum, 4) for k, v in sums.items()}})
    seconds = time.perf_counter() - started
    if ckpt is not None:
        _save_checkpoint(ckpt, network, optim, step, seconds, history, cfg)
    network.set_head(network.vocab_ids)
    network.lm.eval()
    for p in params:
        p.requires_grad_(False)
    return TrainResult(step, seconds, history)
