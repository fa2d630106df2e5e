"""Search-R1-style QA data from FlashRAG-layout files (tiny fixtures in tmp dirs)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from verl_replay.data import __main__ as cli
from verl_replay.data.search_qa import load_qa_file, search_tool_config


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def flashrag(tmp_path):
    root = tmp_path / "flashrag"
    _write(
        root / "nq" / "train.jsonl", [{"id": "n1", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"]}]
    )
    _write(root / "hotpotqa" / "train.jsonl", [{"id": "h1", "question": "Where is X?", "golden_answers": ["Y", "Z"]}])
    _write(root / "hotpotqa" / "dev.jsonl", [{"id": "h2", "question": "q2", "golden_answers": ["a"]}])
    _write(root / "bamboogle" / "test.jsonl", [{"id": "b1", "question": "q3", "golden_answers": "b"}])
    return root


def test_prepare_search_writes_train_test_and_the_tool_config(flashrag, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "prepare",
                "search",
                "--input",
                str(flashrag),
                "--output",
                str(out),
                "--retrieval-url",
                "http://h:8000/retrieve",
            ]
        )
        == 0
    )
    train = pd.read_parquet(out / "search_train.parquet")
    assert list(train["data_source"]) == ["nq", "hotpotqa"] and set(train["agent_name"]) == {"tool_agent"}
    assert list(train["reward_model"][1]["ground_truth"]["target"]) == ["Y", "Z"]
    assert train["prompt"][0][0]["content"].endswith("Question: who wrote hamlet?")
    test = pd.read_parquet(out / "search_test.parquet")
    assert list(test["data_source"]) == ["hotpotqa", "bamboogle"]  # dev where there is no test split
    tools = json.loads((out / "search_tools.yaml").read_text())["tools"][0]
    assert tools["class_name"] == "verl_replay.integrations.verl.search_tool.LocalSearchTool"
    assert tools["config"] == {"type": "native", "topk": 3, "retrieval_service_url": "http://h:8000/retrieve"}
    assert "wrote      2 rows" in capsys.readouterr().out


def test_bad_search_inputs_are_refused(flashrag, tmp_path, capsys):
    assert cli.main(["prepare", "search", "--input", str(tmp_path / "none"), "--output", str(tmp_path)]) == 2
    assert cli.main(["prepare", "search", "--input", str(flashrag), "--output", str(tmp_path)]) == 2
    assert "exactly one of --retrieval-url" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exactly one"):
        search_tool_config(retrieval_url="u", corpus="c")
    bad = tmp_path / "bad.jsonl"
    _write(bad, [{"question": "q"}])
    with pytest.raises(ValueError, match="golden_answers"):
        load_qa_file(bad, "nq")
