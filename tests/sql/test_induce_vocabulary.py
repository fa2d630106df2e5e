"""The vocabulary-induction CLI with an injected backend."""

from __future__ import annotations

import json

import pytest
import yaml

from verl_replay.sql.induce_vocabulary import main
from verl_replay.sql.vocabulary import UnreviewedVocabularyWarning, load_vocabulary


def _answer(content: str) -> str:
    if "EXISTS" in content:
        return "name: correlated exists\ndescription: Tests related rows with EXISTS."
    if "JOIN" in content:
        return "name: Join\ndescription: Joins tables."
    return "I don't know what this is, it looks like a query to me."


def test_cli_writes_reviewable_yaml(tmp_path, scripted_backend) -> None:
    seeds = tmp_path / "seeds.jsonl"
    rows = [
        {"sql": "SELECT a FROM t JOIN u ON t.x = u.x", "question": "q1"},
        {"sql": "SELECT a FROM t WHERE EXISTS (SELECT 1 FROM u)"},
        {"sql": "SELECT b FROM t JOIN u ON t.y = u.y"},
        {"sql": "SELECT 1"},
    ]
    seeds.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    out = tmp_path / "vocab.yaml"
    backend = scripted_backend(_answer)
    assert main(["--seeds", str(seeds), "--out", str(out), "--max-approaches", "16"], backend=backend) == 0

    data = yaml.safe_load(out.read_text(encoding="utf-8"))
    assert data["reviewed"] is False
    assert [(a["name"], a["count"]) for a in data["approaches"]] == [("join", 2), ("correlated_exists", 1)]
    assert data["approaches"][1]["examples"] == [rows[1]["sql"]]
    assert data["induction"]["unparsed"] == 1 and data["induction"]["num_items"] == 4
    with pytest.warns(UnreviewedVocabularyWarning):
        vocab = load_vocabulary(out)
    assert vocab.default == "join"


def test_cli_reports_bad_seed_lines(tmp_path, scripted_backend) -> None:
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text('{"sql": "SELECT 1"}\n{"query": "SELECT 2"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"seeds.jsonl:2: missing or empty string field 'sql'"):
        main(["--seeds", str(seeds), "--out", str(tmp_path / "v.yaml")], backend=scripted_backend(_answer))


def test_cli_requires_model_without_injected_backend(tmp_path) -> None:
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text('{"sql": "SELECT 1"}\n', encoding="utf-8")
    with pytest.raises(SystemExit, match="--model is required"):
        main(["--seeds", str(seeds), "--out", str(tmp_path / "v.yaml")])
