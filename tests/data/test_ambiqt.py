from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_replay.data.ambiqt import ambiqt_files, load_ambiqt


@pytest.fixture
def db_dir(singer_db: Path) -> Path:
    return singer_db.parent.parent


def _ambiqt_record(**overrides) -> dict:
    record = {
        "db_id": "concert_singer",
        "question": "Show the name and age of every singer.",
        "query1": "select name, age from singer",
        "query2": "select t1.name, t1.age from singer as t1 join concert as t2 on t1.singer_id = t2.singer_id",
        "orig_query": "select name, age from singer",
    }
    record.update(overrides)
    return record


def test_query1_query2_records_from_benchmark_folder(tmp_path, db_dir):
    bench = tmp_path / "benchmark"
    (bench / "tbl-split").mkdir(parents=True)
    (bench / "col-synonyms").mkdir()
    (bench / "tbl-split" / "validation.json").write_text(json.dumps([_ambiqt_record(), _ambiqt_record()]))
    (bench / "col-synonyms" / "validation.json").write_text(json.dumps([_ambiqt_record()]))
    (bench / "col-synonyms" / "train.json").write_text(json.dumps([_ambiqt_record()] * 5))
    assert [p.parent.name for p in ambiqt_files(bench)] == ["col-synonyms", "tbl-split"]
    loaded = load_ambiqt(bench, db_dir)
    assert [e.question_id for e in loaded.examples] == ["col-synonyms-0", "tbl-split-0", "tbl-split-1"]
    first = loaded.examples[0]
    assert first.gold_sqls == (_ambiqt_record()["query1"], _ambiqt_record()["query2"])
    assert first.gold_sql == _ambiqt_record()["query1"]
    assert first.meta == {"category": "col-synonyms"}
    assert loaded.skipped == []
    assert len(load_ambiqt(bench, db_dir, split="train").examples) == 5


def test_jsonl_with_gold_queries_list_and_ids(tmp_path, db_dir):
    path = tmp_path / "ambiqt.jsonl"
    record = {
        "id": "q-1",
        "db_id": "concert_singer",
        "question": "Ages?",
        "category": "tbl-agg",
        "gold_queries": ["select age from singer", "select avg(age) from singer", "select age from singer"],
    }
    path.write_text(json.dumps(record) + "\n\n")
    loaded = load_ambiqt(path, db_dir)
    assert loaded.examples[0].question_id == "q-1"
    assert loaded.examples[0].gold_sqls == ("select age from singer", "select avg(age) from singer")
    assert loaded.examples[0].meta == {"category": "tbl-agg"}


def test_examples_whose_gold_sql_fails_are_skipped_with_reason(tmp_path, db_dir):
    path = tmp_path / "a.json"
    broken = _ambiqt_record(query2="select t2.country from singer_country as t2")  # table only in AmbiQT's schema
    path.write_text(json.dumps([_ambiqt_record(), broken]))
    loaded = load_ambiqt(path, db_dir)
    assert len(loaded.examples) == 1
    assert loaded.skipped[0][0] == "a-1"
    assert "gold query 2 does not execute" in loaded.skipped[0][1] and "singer_country" in loaded.skipped[0][1]
    assert len(load_ambiqt(path, db_dir, check_executable=False).examples) == 2


def test_record_errors(tmp_path, db_dir):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([_ambiqt_record(query2="select name, age from singer")]))
    with pytest.raises(ValueError, match="needs two distinct gold queries"):
        load_ambiqt(path, db_dir)
    path.write_text(json.dumps([{"db_id": "concert_singer", "question": "q?", "query": "select 1"}]))
    with pytest.raises(KeyError, match="expected a 'gold_queries' list or 'query1'\\+'query2'"):
        load_ambiqt(path, db_dir)
    path.write_text(json.dumps([_ambiqt_record(db_id="car_1")]))
    with pytest.raises(FileNotFoundError, match="AmbiQT database for db_id 'car_1' not found at .*car_1/car_1.sqlite"):
        load_ambiqt(path, db_dir)
    path.write_text(json.dumps([_ambiqt_record(question="")]))
    with pytest.raises(KeyError, match=r"missing column\(s\) \['question'\]"):
        load_ambiqt(path, db_dir)
    with pytest.raises(FileNotFoundError, match="no AmbiQT validation files under"):
        ambiqt_files(db_dir)  # a folder without <category>/validation.json
    with pytest.raises(FileNotFoundError, match="AmbiQT databases directory not found"):
        load_ambiqt(path, tmp_path / "no_dbs")
