"""The Python blocks of README.md and docs/: what a reader copies, read as the tests run it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SERVER_URL = "http://127.0.0.1:8000/v1"  # the address the pages' client blocks call


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of `page`, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def needs_server(block: str) -> bool:
    """A client block: it calls a running `flashspec-agents serve`."""
    return SERVER_URL in block


def run_blocks(blocks: list[str], name: str, url: str | None = None) -> None:
    """Runs `blocks` one after another in one namespace, as a reader pastes them into one session;
    a client block calls `url` instead of the pages' address."""
    namespace: dict = {"__name__": "__snippets__"}
    for i, block in enumerate(blocks):
        if url is not None:
            block = block.replace(SERVER_URL, url)
        exec(compile(block, f"{name} python block {i + 1}", "exec"), namespace)
