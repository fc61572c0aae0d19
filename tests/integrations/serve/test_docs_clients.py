"""The client blocks of README.md and docs/ (stock OpenAI, LangChain and LlamaIndex clients) run
against a running endpoint: the test deployment, at its address and key."""
from __future__ import annotations

import pytest
from snippets import PAGES, needs_server, python_blocks, run_blocks

from .conftest import API_KEY

CLIENTS = {page.name: [b for b in python_blocks(page) if needs_server(b)] for page in PAGES}


@pytest.mark.parametrize("page", [name for name, blocks in CLIENTS.items() if blocks])
def test_a_pages_client_blocks_run_against_the_endpoint(page, service, monkeypatch, capsys):
    monkeypatch.setenv("FLASHSPEC_API_KEY", API_KEY)
    run_blocks(CLIENTS[page], page, url=service[0])
    assert capsys.readouterr().out.strip(), "the blocks print the replies"
