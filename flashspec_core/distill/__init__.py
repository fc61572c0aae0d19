"""Self-distilled draft models for a target: data, network, training, evaluation, model card, command.

command.py runs the pipeline (`flashspec-agents distill` on ShareGPT); `flashspec_core.drafts.trained` serves
the resulting weights as a draft source. Names are imported lazily so that reading the command's
options does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DistillOptions": "flashspec_core.distill.options",
    "run_distill": "flashspec_core.distill.command",
    "DraftNetwork": "flashspec_core.distill.model",
    "load_draft": "flashspec_core.distill.model",
    "save_draft": "flashspec_core.distill.model",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashspec_core.distill' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
