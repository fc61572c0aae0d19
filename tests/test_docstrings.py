"""Module docstrings of the three packages say the contract in ten lines or fewer; the rationale
lives in docs/."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flashspec_core", "flashspec_integrations", "flashspec_workloads")
MAX_LINES = 10


def docstring_lines(path: Path) -> int | None:
    """Lines of the module docstring as written (the closing quotes' line included), or None."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), clean=False)
    return None if doc is None else doc.count("\n") + 1


def too_long(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            lines = docstring_lines(path)
            if lines is not None and lines > MAX_LINES:
                found.append(f"{path.relative_to(root)} ({lines} lines)")
    return found


def test_module_docstrings_are_at_most_ten_lines():
    offenders = too_long(ROOT)
    assert not offenders, (
        f"module docstrings longer than {MAX_LINES} lines (keep the contract, move the rationale to docs/): "
        + ", ".join(offenders)
    )


def test_an_eleven_line_docstring_is_caught(tmp_path):
    package = tmp_path / PACKAGES[0]
    package.mkdir()
    (package / "ok.py").write_text('"""' + "line\n" * 9 + '"""\n')
    (package / "long.py").write_text('"""' + "line\n" * 10 + '"""\n')
    (package / "none.py").write_text("x = 1\n")
    assert too_long(tmp_path) == [f"{PACKAGES[0]}/long.py (11 lines)"]
