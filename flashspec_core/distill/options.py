"""The options of `flashspec-agents distill`, kept free of torch so `--help` stays instant."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


@dataclass
class DistillOptions:
    name: str = "distill_general"
    domain: str = "all"
    out: str = "distill_out"
    target: str | None = None
    device: str | None = None
    prompts: str | None = None
    export_prompts: str | None = None
    data: str | None = None
    max_prompts: int | None = None
    max_prompt_tokens: int = 384
    dev_rows: int = 64
    gen_tokens: int = 160
    gen_batch: int = 256
    gen_time: float | None = None
    sample_fraction: float = 0.25
    layers: int = 2
    vocab: int = 8192
    init_from: str | None = None
    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-4
    time_budget: float | None = None
    checkpoint_every: int = 200
    resume: bool = False
    seed: int = 0
    smoke: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name must be lowercase letters, digits and '_' (starting with a letter); "
                             f"got {self.name!r}")
        if self.domain not in ("all", "chat", "code"):
            raise ValueError(f"domain must be 'all', 'chat' or 'code'; got {self.domain!r}")
        if self.smoke:  # a few seconds on a CPU: proves the pipeline, trains nothing useful
            self.max_prompts = min(self.max_prompts or 16, 16)
            self.dev_rows, self.gen_tokens, self.gen_batch = min(self.dev_rows, 4), min(self.gen_tokens, 12), 8
            self.steps, self.batch_size, self.checkpoint_every = min(self.steps, 3), 4, 2
            self.vocab, self.layers = min(self.vocab, 512), 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `flashspec-agents distill`, one per DistillOptions field."""
    defaults = DistillOptions()
    helps = {
        "name": "draft name: file stem of the weights and card, and the draft's name in the engine",
        "domain": "train on 'all' (a generalist), 'chat' or 'code' prompts",
        "out": "folder for the weights (.safetensors), model card (.md) and checkpoint",
        "target": "target: a .gguf file, a local folder or a cached HF id (default: the embedded default model)",
        "prompts": "tokenised prompts (.npz from --export-prompts) instead of reading ShareGPT",
        "export_prompts": "tokenise ShareGPT prompts into this .npz and stop",
        "data": "cache of the target's continuations (.npz): read if present, else generated and written",
        "gen_time": "seconds for generating continuations (dev rows first, then train rows until time is up)",
        "init_from": "start from the layers of a saved draft (e.g. a generalist, to make a specialist)",
        "time_budget": "stop training after this many seconds",
        "resume": "continue from <out>/<name>.ckpt.pt",
        "smoke": "tiny settings (a few prompts, 3 steps) to check the pipeline on a CPU",
    }
    for f in fields(DistillOptions):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name == "progress":
            parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
        elif f.name == "domain":
            parser.add_argument(flag, choices=("all", "chat", "code"), default=default, help=helps.get(f.name))
        elif isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=helps.get(f.name))
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            parser.add_argument(flag, type=kind, default=default, help=helps.get(f.name))
