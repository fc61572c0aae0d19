"""Workloads for benchmarks, the demo and draft training: streams of agent-like decode requests.

Kept outside `flashspec_core` on purpose: the engine never reads them; only the demo, the
benchmarks and draft distillation do. Standard library only, so a stream can be built before
torch is imported.

- `flashspec_workloads.dev`: the short mixed dev stream (ShareGPT chat and code, hand-written
  tool calls and RAG documents) that BENCHMARKS.md's dev workload figures use.
- `flashspec_workloads.sharegpt`: the ShareGPT reader and its train/dev split.
"""
from flashspec_workloads.common import Step

__all__ = ["Step"]
