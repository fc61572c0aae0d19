"""The trained draft's network: a few decoder layers that borrow the target's embeddings and head.

Why this shape: the default target is the smallest of its family, so no smaller model shares its
tokenizer. A stack of one or two of the target's own decoder layers (same width, same attention
and rotary setup, initialised from target layers) reads the target's input embeddings and scores
its output head restricted to a token subset. Only the layers and the final norm are trained and
stored, so a shipped draft stays small; the embeddings and head are taken from the target at load
time. The head subset (the tokens the target emits most, plus the tokens of the current prompt)
keeps the draft's projection cheap; tokens outside it get q = 0, which verification handles exactly.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

WEIGHTS_FORMAT = "flashspec-distilled-draft/1"
FINGERPRINT_ROWS = 16
FINGERPRINT_RTOL = 0.05
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "model_type")


class IncompatibleDraft(ValueError):
    """The draft was trained for another target (shape or embeddings differ)."""


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder layer list of an HF causal LM (Llama-style `model.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("target: expected an HF causal LM with `model.layers` (Llama, Qwen, Mistral style)")
    return layers


def embedding_fingerprint(target: PreTrainedModel) -> torch.Tensor:
    """Norms of a few fixed embedding rows: tells this target from another of the same shape.

    Robust to quantisation (a Q4 GGUF and its float original agree to well under 5 %), unlike a hash.
    Returns [FINGERPRINT_ROWS] float32 on CPU.
    """
    weight = cast(torch.Tensor, target.get_input_embeddings().weight)  # [V, H]
    rows = torch.linspace(0, weight.shape[0] - 1, FINGERPRINT_ROWS).long().to(weight.device)
    return weight.detach()[rows].float().norm(dim=-1).cpu()


def target_vocab(target: PreTrainedModel) -> int:
    return target.get_output_embeddings().weight.shape[0]


class DraftNetwork(nn.Module):
    """Trainable decoder layers + norm around the target's frozen embeddings and a head subset.

    `lm` is an ordinary HF causal LM (so the engine's KV-cache runner drives it unchanged) whose
    input embedding shares the target's weight and whose `lm_head` holds the rows `head_ids` of the
    target's output embedding. Its logits are over `head_ids` only: [..., len(head_ids)].
    """

    vocab_ids: torch.Tensor  # [K] the trained subset (a buffer)

    def __init__(
        self,
        target: PreTrainedModel,
        num_layers: int,
        vocab_ids: Sequence[int] | torch.Tensor,
        init_layers: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int; got {num_layers!r}")
        target_layers = decoder_layers(target)
        emb = cast(torch.Tensor, target.get_input_embeddings().weight)  # [V, H]
        device, dtype = emb.device, dtype or emb.dtype
        self.target_vocab = target_vocab(target)
        ids = torch.as_tensor(vocab_ids, dtype=torch.long).unique()  # sorted: argmax ties match the target's
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.target_vocab:
            raise ValueError(f"vocab_ids must be non-empty token ids in [0, {self.target_vocab}); fix the subset")
        self.register_buffer("vocab_ids", ids.to(device), persistent=False)  # [K] the trained subset

        cfg = copy.deepcopy(target.config)
        cfg.num_hidden_layers = num_layers
        cfg.vocab_size = int(ids.numel())
        cfg.tie_word_embeddings = False
        cfg.pad_token_id = None  # the embedding is replaced by the target's; a pad row may lie outside K
        if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
            cfg.layer_types = list(cfg.layer_types)[:num_layers]
        self.lm = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype)
        # Share (never store) the target's embedding; cast only when the draft runs in another dtype.
        shared = emb.detach() if emb.dtype == dtype else emb.detach().to(dtype)
        self.lm.model.embed_tokens = nn.Embedding.from_pretrained(shared, freeze=True)
        # [V, H] the target's head; a plain tensor (not a Parameter), so it is not registered here.
        self._out_weight = target.get_output_embeddings().weight.detach()
        self.lm.lm_head = nn.Linear(cfg.hidden_size, int(ids.numel()), bias=False).to(device=device, dtype=dtype)
        self.lm.lm_head.weight.requires_grad_(False)
        self.head_ids = ids.to(device)
        self.set_head(self.vocab_ids)

        if init_layers is not None:
            if len(init_layers) != num_layers or any(not 0 <= i < len(target_layers) for i in init_layers):
                raise ValueError(
                    f"init_layers must name {num_layers} target layers in [0, {len(target_layers)}); "
                    f"got {list(init_layers)!r}")
            for mine, theirs in zip(self.lm.model.layers, init_layers):
                mine.load_state_dict(target_layers[theirs].state_dict())
            self.lm.model.norm.load_state_dict(target.model.norm.state_dict())
        self.lm.eval()

    @property
    def num_layers(self) -> int:
        return len(self.lm.model.layers)

    def set_head(self, ids: torch.Tensor) -> None:
        """Score the target-head rows `ids` (sorted, unique, [K']) from now on; no copy of the target is kept."""
        w = self._out_weight
        ids = ids.to(w.device)
        self.lm.lm_head.weight = nn.Parameter(w.index_select(0, ids).to(self.lm.lm_head.weight.dtype),
                                              requires_grad=False)
        self.lm.lm_head.out_features = int(ids.numel())
        self.head_ids = ids

    def head_with(self, extra: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """The trained subset united with `extra` token ids (say, the prompt's): sorted, [K']."""
        extra = torch.as_tensor(extra, dtype=torch.long, device=self.vocab_ids.device).flatten()
        extra = extra[(extra >= 0) & (extra < self.target_vocab)]
        return torch.cat([self.vocab_ids, extra]).unique()

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Final hidden states. input_ids, attention_mask: [B, T] -> [B, T, H]."""
        return self.lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What is trained and stored: the decoder layers and the final norm."""
        return {k: v for k, v in self.lm.state_dict().items() if k.startswith(("model.layers.", "model.norm."))}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.lm.named_parameters() if n.startswith(("model.layers.", "model.norm."))]


def save_draft(
    network: DraftNetwork,
    target: PreTrainedModel,
    path: str | Path,
    metadata: dict[str, str],
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write the trained layers, the vocabulary subset and the target fingerprint to one safetensors file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in network.trainable_state().items()}
    tensors["vocab_ids"] = network.vocab_ids.to("cpu", torch.int32)
    tensors["fingerprint"] = embedding_fingerprint(target)
    meta = {"format": WEIGHTS_FORMAT, "num_layers": str(network.num_layers), **{k: str(v) for k, v in metadata.items()}}
    for key in _SHAPE_KEYS:
        meta[f"target_{key}"] = str(getattr(target.config, key, ""))
    meta["target_vocab"] = str(target_vocab(target))
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def read_draft_file(path: str | Path,
                    check: PreTrainedModel | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a saved draft; ValueError if the file is not one.

    With `check`, raise IncompatibleDraft before reading the weights if they were made for
    another target (cheap: metadata and the small fingerprint only).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: draft weights {str(path)!r} do not exist")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != WEIGHTS_FORMAT:
            raise ValueError(f"path: {str(path)!r} is not a flashspec distilled draft (format {meta.get('format')!r})")
        if check is not None:
            problem = compatibility_problem(meta, f.get_tensor("fingerprint"), check)
            if problem:
                raise IncompatibleDraft(f"path: {str(path)!r} does not fit this target: {problem}")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


def compatibility_problem(meta: dict[str, str], fingerprint: torch.Tensor, target: PreTrainedModel) -> str | None:
    """Why this draft cannot serve `target`, or None when it was trained for it. fingerprint: [FINGERPRINT_ROWS]."""
    for key in _SHAPE_KEYS:
        if meta.get(f"target_{key}") != str(getattr(target.config, key, "")):
            return (f"target {key} is {getattr(target.config, key, None)!r}, "
                    f"the draft expects {meta.get(f'target_{key}')!r}")
    if meta.get("target_vocab") != str(target_vocab(target)):
        return f"target vocabulary is {target_vocab(target)}, the draft expects {meta.get('target_vocab')}"
    if not torch.allclose(embedding_fingerprint(target), fingerprint.float(), rtol=FINGERPRINT_RTOL):
        return "the target's embeddings differ from the ones the draft was trained on"
    return None


def load_draft(path: str | Path, target: PreTrainedModel,
               dtype: torch.dtype | None = None) -> tuple[DraftNetwork, dict[str, str]]:
    """Rebuild a saved draft around `target` (ValueError if it was trained for another target)."""
    tensors, meta = read_draft_file(path, check=target)
    tensors.pop("fingerprint")
    network = DraftNetwork(target, int(meta["num_layers"]), tensors.pop("vocab_ids").long(), dtype=dtype)
    state = {k: v.to(network.lm.lm_head.weight.dtype) for k, v in tensors.items()}
    missing = set(network.trainable_state()) - set(state)
    if missing:
        raise ValueError(f"path: {str(path)!r} lacks weights {sorted(missing)[:3]}...; the file is damaged")
    network.lm.load_state_dict(state, strict=False)
    return network, meta
