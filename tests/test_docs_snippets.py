"""Every Python block of README.md and docs/ runs, offline on the default model; the blocks that
call a server run against a real one in tests/integrations/serve/test_docs_clients.py."""
from __future__ import annotations

import pytest
from snippets import PAGES, needs_server, python_blocks, run_blocks

LOCAL = {page.name: [b for b in python_blocks(page) if not needs_server(b)] for page in PAGES}


def test_the_readme_has_usage_and_client_blocks():
    readme = python_blocks(PAGES[0])
    assert len(LOCAL["README.md"]) >= 4 and any(needs_server(b) for b in readme), "the README's blocks moved"


@pytest.mark.parametrize("page", [name for name, blocks in LOCAL.items() if blocks])
def test_a_pages_python_blocks_run_in_order(page, default_target, capsys):
    run_blocks(LOCAL[page], page)
    assert capsys.readouterr().out.strip(), "the blocks print what they made"
