"""`flashspec-agents generate`: a prompt or a chat JSON file in, the engine's text streamed out.

In-process through `main(argv)` (sharing the session's default engine) plus one subprocess call of
the installed console script.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_loaded

from flashspec_integrations.cli import main

PROMPT = "Name one primary colour."
MESSAGES = [{"role": "user", "content": "Say hello in French."}]


@pytest.mark.slow
def test_generate_streams_the_engines_greedy_text(default_engine, capsys):
    expected = default_engine.generate(PROMPT, max_new_tokens=8).text
    assert main(["generate", PROMPT, "--max-new-tokens", "8", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n" and expected.strip()
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["steps"] >= 1 and stats["domain"]


@pytest.mark.slow
def test_generate_reads_a_chat_file(default_engine, capsys, tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(MESSAGES))
    expected = default_engine.generate(MESSAGES, max_new_tokens=8).text
    assert main(["generate", "--chat-file", str(path), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.slow
def test_bad_values_are_reported_not_raised(default_engine, capsys):
    assert main(["generate", PROMPT, "--max-new-tokens", "0"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err
    assert main(["generate", PROMPT, "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ('{"role": "user", "content": "hi"}', "list"),
    ('["hi"]', "list"),
])
def test_a_bad_chat_file_is_a_clear_error(default_engine, tmp_path, content, message):
    path = tmp_path / "chat.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--chat-file", str(path)])
    assert "--chat-file" in str(exit_info.value.code) and message in str(exit_info.value.code)


def test_console_script_is_installed_and_lists_its_commands():
    beside_python = Path(sys.executable).parent / "flashspec-agents"  # the venv's bin, activated or not
    script = str(beside_python) if beside_python.exists() else shutil.which("flashspec-agents")
    assert script, "the console script `flashspec-agents` is not installed; reinstall the package"
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "generate" in done.stdout and "demo" in done.stdout
    done = subprocess.run([script, "generate", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--chat-file" in done.stdout


def test_calibrate_measures_and_prints_the_table(tmp_path, capsys):
    """On a tiny target saved to a folder (`--model`): the command's own path, from loading to the
    printed table, without a forced minute-long measurement of the default model (the engine's
    calibration of the default model runs in the default-model tests)."""
    loaded = tiny_loaded(16, seed=0, max_positions=2048)  # room for the calibration's longer context
    folder = tmp_path / "tiny"
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    assert main(["calibrate", "--model", str(folder), "--backend", "hf"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "w=1" in out and "kept" in out
