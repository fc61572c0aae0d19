"""The core imports no agent framework and nothing of the outer packages (docs/design.md, invariant 4)."""
from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "flashspec_core"
OUTSIDE = ("flashspec_integrations", "flashspec_workloads", "langchain", "langchain_core", "llama_index", "ray")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_core_module_imports_an_outer_package_or_a_framework():
    offenders = {str(p.relative_to(CORE)): sorted(m for m in imported_modules(p) if m.split(".")[0] in OUTSIDE)
                 for p in sorted(CORE.rglob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(offenders) > 50  # the walk found the package
