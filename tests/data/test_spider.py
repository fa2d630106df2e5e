from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_replay.data.spider import load_spider


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records))


def _record(question: str, query: str, db_id: str = "concert_singer") -> dict:
    return {"db_id": db_id, "question": question, "query": query, "query_toks": query.split()}


@pytest.fixture
def spider_root(tmp_path: Path, singer_db: Path) -> Path:
    root = tmp_path / "download" / "spider_data"
    db_dir = root / "database" / "concert_singer"
    db_dir.mkdir(parents=True)
    (db_dir / "concert_singer.sqlite").write_bytes(singer_db.read_bytes())
    _write(root / "train_spider.json", [_record("How many singers?", "SELECT count(*) FROM singer")])
    _write(root / "train_others.json", [_record("Oldest singer?", "SELECT name FROM singer ORDER BY age DESC LIMIT 1")])
    _write(root / "dev.json", [_record("Singers from France?", "SELECT name FROM singer WHERE country = 'France'")] * 3)
    return root


def test_load_spider_dev_and_subfolder_root(spider_root):
    examples = load_spider(spider_root.parent, "dev")  # <root>/spider_data is found
    assert len(examples) == 3
    assert [e.question_id for e in examples] == ["dev-0", "dev-1", "dev-2"]
    assert examples[0].gold_sqls == ("SELECT name FROM singer WHERE country = 'France'",)
    assert examples[0].db_path == (spider_root / "database" / "concert_singer" / "concert_singer.sqlite").absolute()
    assert examples[0].evidence == ""
    assert len(load_spider(spider_root, "dev", limit=2)) == 2


def test_train_all_concatenates_both_training_files(spider_root):
    examples = load_spider(spider_root, "train_all")
    assert [e.question for e in examples] == ["How many singers?", "Oldest singer?"]
    assert [e.question_id for e in examples] == ["train_all-0", "train_all-1"]
    assert [e.question for e in load_spider(spider_root, "train")] == ["How many singers?"]


def test_test_split_uses_test_database(spider_root, singer_db):
    _write(spider_root / "test.json", [_record("How many singers?", "SELECT count(*) FROM singer")])
    with pytest.raises(FileNotFoundError, match="Spider databases directory not found at .*test_database"):
        load_spider(spider_root, "test")
    examples = load_spider(spider_root, "test", databases_dir=spider_root / "database")
    assert len(examples) == 1


def test_errors_name_the_problem(spider_root):
    with pytest.raises(ValueError, match="unknown Spider split 'validation'"):
        load_spider(spider_root, "validation")
    _write(spider_root / "dev.json", [{"db_id": "concert_singer", "question": "q?"}])
    with pytest.raises(KeyError, match=r"missing column\(s\) \['query'\] in .*dev.json \(record 0\)"):
        load_spider(spider_root, "dev")
    _write(spider_root / "dev.json", [_record("q?", "SELECT 1", db_id="pets_1")])
    expected = (spider_root / "database" / "pets_1" / "pets_1.sqlite").absolute()
    with pytest.raises(FileNotFoundError) as err:
        load_spider(spider_root, "dev")
    assert str(err.value) == f"Spider database for db_id 'pets_1' not found at {expected}"
    with pytest.raises(FileNotFoundError, match="Spider train questions not found"):
        load_spider(spider_root / "database", "train")
