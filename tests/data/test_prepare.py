from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from verl_replay.data.math_benchmarks import MathExample
from verl_replay.data.prepare import (
    MATH_RL_SCHEMA,
    SQL_RL_SCHEMA,
    math_rows,
    prepare_ambiqt,
    prepare_bird,
    prepare_math,
    prepare_spider,
    sql_rows,
    write_rl_parquet,
)
from verl_replay.data.schema import SQLExample, schema_text


@pytest.fixture
def bird_root(tmp_path: Path, singer_db: Path) -> Path:
    root = tmp_path / "bird"
    db = root / "dev" / "dev_databases" / "concert_singer" / "concert_singer.sqlite"
    db.parent.mkdir(parents=True)
    db.write_bytes(singer_db.read_bytes())
    records = [
        {
            "question_id": 0,
            "db_id": "concert_singer",
            "question": "Oldest singer?",
            "evidence": "oldest refers to MAX(age)",
            "SQL": "SELECT name FROM singer ORDER BY age DESC LIMIT 1",
            "difficulty": "simple",
        },
        {
            "question_id": 1,
            "db_id": "concert_singer",
            "question": "How many concerts?",
            "evidence": "",
            "SQL": "SELECT COUNT(*) FROM concert",
            "difficulty": "simple",
        },
    ]
    (root / "dev" / "dev.json").write_text(json.dumps(records))
    return root


def test_prepare_bird_writes_verl_rows(bird_root, tmp_path):
    [written] = prepare_bird(bird_root, tmp_path / "out", split="dev")
    assert written.path == (tmp_path / "out" / "bird_dev.parquet").absolute()
    assert (written.rows, written.data_source, written.split) == (2, "bird", "dev")
    table = pq.read_table(written.path)
    assert table.schema.equals(SQL_RL_SCHEMA, check_metadata=False)
    row = table.to_pylist()[0]
    db_path = Path(row["extra_info"]["db_path"])
    assert db_path.is_absolute() and db_path.is_file()
    assert row["data_source"] == "bird" and row["ability"] == "sql"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "SELECT name FROM singer ORDER BY age DESC LIMIT 1"}
    assert row["extra_info"] | {"db_path": None} == {
        "split": "dev",
        "index": 0,
        "question_id": "0",
        "db_id": "concert_singer",
        "db_path": None,
        "semantics": "bird",
        "question": "Oldest singer?",
        "evidence": "oldest refers to MAX(age)",
        "gold_sqls": ["SELECT name FROM singer ORDER BY age DESC LIMIT 1"],
    }
    content = row["prompt"][0]["content"]
    assert schema_text(db_path) in content
    assert "Evidence: oldest refers to MAX(age)" in content and "Question: Oldest singer?" in content
    assert "Evidence" not in table.to_pylist()[1]["prompt"][0]["content"]


def test_prepare_bird_options(bird_root, tmp_path):
    [written] = prepare_bird(bird_root, tmp_path / "out", limit=1, with_sample_rows=1, system_prompt="Be exact.")
    rows = pq.read_table(written.path).to_pylist()
    assert len(rows) == 1
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Be exact."}
    assert "example rows from singer" in rows[0]["prompt"][1]["content"]


def test_prepare_spider_uses_spider_semantics(tmp_path, singer_db):
    root = tmp_path / "spider"
    (root / "database" / "concert_singer").mkdir(parents=True)
    (root / "database" / "concert_singer" / "concert_singer.sqlite").write_bytes(singer_db.read_bytes())
    (root / "dev.json").write_text(
        json.dumps([{"db_id": "concert_singer", "question": "Names?", "query": "SELECT name FROM singer"}])
    )
    [written] = prepare_spider(root, tmp_path / "out")
    row = pq.read_table(written.path).to_pylist()[0]
    assert written.path.name == "spider_dev.parquet"
    assert row["data_source"] == "spider" and row["extra_info"]["semantics"] == "spider"
    assert row["extra_info"]["question_id"] == "dev-0"


def test_prepare_ambiqt_keeps_both_gold_queries(tmp_path, singer_db):
    records = [
        {
            "db_id": "concert_singer",
            "question": "Name and age?",
            "query1": "select name, age from singer",
            "query2": "select name, max(age) from singer group by name",
        },
        {
            "db_id": "concert_singer",
            "question": "Countries?",
            "query1": "select country from singer",
            "query2": "select country from singer_country",
        },
    ]
    path = tmp_path / "ambiqt.json"
    path.write_text(json.dumps(records))
    [written], skipped = prepare_ambiqt(path, tmp_path / "out", databases_dir=singer_db.parent.parent)
    rows = pq.read_table(written.path).to_pylist()
    assert len(rows) == 1 and [q for q, _ in skipped] == ["ambiqt-1"]
    assert rows[0]["data_source"] == "ambiqt"
    assert rows[0]["extra_info"]["gold_sqls"] == [records[0]["query1"], records[0]["query2"]]
    assert rows[0]["reward_model"]["ground_truth"] == records[0]["query1"]
    only_broken = tmp_path / "broken.json"
    only_broken.write_text(json.dumps(records[1:]))
    with pytest.raises(
        ValueError, match="no usable AmbiQT examples .*broken-0: gold query 2 .*no such table: singer_country"
    ):
        prepare_ambiqt(only_broken, tmp_path / "out2", databases_dir=singer_db.parent.parent)


def test_prepare_math_one_file_per_benchmark(tmp_path):
    src = tmp_path / "math"
    src.mkdir()
    (src / "aime24.jsonl").write_text(json.dumps({"problem": "P1", "answer": "204", "id": 60}) + "\n")
    (src / "math500.jsonl").write_text(json.dumps({"problem": "P2", "solution": "\\boxed{5}"}) + "\n")
    (src / "train.json").write_text(json.dumps([{"question": "Q", "answer": "1"}] * 3))
    written = prepare_math(src, tmp_path / "out")
    assert sorted((w.path.name, w.rows, w.split) for w in written) == [
        ("math_aime24.parquet", 1, "test"),
        ("math_math500.parquet", 1, "test"),
        ("math_train.parquet", 3, "train"),
    ]
    aime = pq.read_table(tmp_path / "out" / "math_aime24.parquet")
    assert aime.schema.equals(MATH_RL_SCHEMA, check_metadata=False)
    row = aime.to_pylist()[0]
    assert row["data_source"] == "aime24" and row["ability"] == "math"
    assert row["reward_model"]["ground_truth"] == "204"
    assert row["extra_info"] == {
        "split": "test",
        "index": 0,
        "question_id": "60",
        "benchmark": "aime24",
        "question": "P1",
    }
    assert row["prompt"][0]["content"].startswith("P1\n") and "\\boxed{}" in row["prompt"][0]["content"]
    [only] = prepare_math(src, tmp_path / "out2", benchmarks=["math500"])
    assert only.path.name == "math_math500.parquet"
    with pytest.raises(FileNotFoundError, match=r"no file for math benchmark\(s\) \['amc23'\]"):
        prepare_math(src, tmp_path / "out3", benchmarks=["amc23"])
    with pytest.raises(ValueError, match="is a file: pass benchmark="):
        prepare_math(src / "train.json", tmp_path / "out4")
    [single] = prepare_math(src / "train.json", tmp_path / "out4", benchmark="train", limit=2)
    assert single.rows == 2 and single.split == "train"
    with pytest.raises(FileNotFoundError, match="no math benchmark files under"):
        prepare_math(tmp_path / "out4", tmp_path / "out5")


def test_sql_rows_validate_semantics_and_writer_refuses_empty(tmp_path, singer_db):
    ex = SQLExample("q1", "concert_singer", "Names?", ("SELECT name FROM singer",), singer_db)
    with pytest.raises(ValueError, match="semantics must be one of"):
        sql_rows([ex], data_source="x", split="dev", semantics="exact")
    with pytest.raises(ValueError, match="refusing to write an empty RL parquet"):
        write_rl_parquet([], tmp_path / "e.parquet", SQL_RL_SCHEMA)
    path = write_rl_parquet(
        sql_rows([ex], data_source="x", split="dev", semantics="spider"), tmp_path / "a.parquet", SQL_RL_SCHEMA
    )
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".parquet" or ".tmp-" in p.name] == ["a.parquet"]
    assert pq.read_table(path).num_rows == 1


def test_sql_and_math_files_of_different_sources_share_one_schema(bird_root, tmp_path):
    [bird] = prepare_bird(bird_root, tmp_path / "out")
    rows = math_rows([MathExample("m1", "P", "1", "aime25")], split="test")
    math_path = write_rl_parquet(rows, tmp_path / "out" / "m.parquet", MATH_RL_SCHEMA)
    import datasets

    loaded = datasets.load_dataset("parquet", data_files=[str(bird.path), str(bird.path)])["train"]
    assert len(loaded) == 4
    assert (
        datasets.load_dataset("parquet", data_files=str(math_path))["train"][0]["extra_info"]["benchmark"] == "aime25"
    )
