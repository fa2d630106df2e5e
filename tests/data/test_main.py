from __future__ import annotations

import json

import pyarrow.parquet as pq

from verl_replay.data.__main__ import main


def test_cli_prepares_math_and_prints_where_files_went(tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    (src / "aime25.jsonl").write_text(
        "".join(json.dumps({"problem": f"P{i}", "answer": str(i)}) + "\n" for i in range(5))
    )
    assert main(["prepare", "math", "--input", str(src), "--output", str(tmp_path / "out"), "--limit", "3"]) == 0
    out = capsys.readouterr().out
    target = (tmp_path / "out" / "math_aime25.parquet").absolute()
    assert "wrote      3 rows  aime25" in out and str(target) in out
    assert pq.read_table(target).num_rows == 3


def test_cli_prepares_spider_with_databases_override(tmp_path, singer_db, capsys):
    (tmp_path / "spider").mkdir()
    (tmp_path / "spider" / "dev.json").write_text(
        json.dumps([{"db_id": "concert_singer", "question": "Names?", "query": "SELECT name FROM singer"}])
    )
    code = main(
        [
            "prepare",
            "spider",
            "--input",
            str(tmp_path / "spider"),
            "--output",
            str(tmp_path / "out"),
            "--databases-dir",
            str(singer_db.parent.parent),
            "--sample-rows",
            "1",
        ]
    )
    assert code == 0
    row = pq.read_table(tmp_path / "out" / "spider_dev.parquet").to_pylist()[0]
    assert "example rows from singer" in row["prompt"][0]["content"]


def test_cli_reports_missing_inputs_as_errors(tmp_path, capsys):
    code = main(["prepare", "bird", "--input", str(tmp_path / "nothing"), "--output", str(tmp_path / "out")])
    assert code == 2
    assert "error: BIRD root directory not found" in capsys.readouterr().err
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "dev.json").write_text(json.dumps([{"db_id": "x", "question": "q"}]))
    (tmp_path / "dev" / "dev_databases").mkdir()
    assert main(["prepare", "bird", "--input", str(tmp_path), "--output", str(tmp_path / "out")]) == 2
    assert "missing column(s) ['SQL']" in capsys.readouterr().err


def test_cli_prepare_tiny_reuses_cached_assets(tiny_assets, capsys):
    tiny = tiny_assets  # the default (fully warm-started) build, cached per machine
    assert main(["prepare", "tiny", "--output", str(tiny.root)]) == 0
    out = capsys.readouterr().out
    assert f"reused cached tiny assets; model and tokenizer: {tiny.model_dir}" in out
    assert "wrote     48 rows  tiny_sql" in out and str(tiny.sql_train) in out
