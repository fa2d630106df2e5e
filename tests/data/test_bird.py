from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_replay.data.bird import find_bird_split_dir, load_bird

DDL = ["CREATE TABLE schools (cds TEXT PRIMARY KEY, county TEXT, enrollment INTEGER)"]
ROWS = {"schools": [("01", "Alameda", 300), ("02", "Fresno", 120)]}


def _dev_records() -> list[dict]:
    return [
        {
            "question_id": 7,
            "db_id": "california_schools",
            "question": "Which county has the largest school?",
            "evidence": "largest refers to MAX(enrollment)",
            "SQL": "SELECT county FROM schools ORDER BY enrollment DESC LIMIT 1",
            "difficulty": "simple",
        },
        {
            "question_id": 8,
            "db_id": "california_schools",
            "question": "How many schools?",
            "evidence": "",
            "SQL": "SELECT COUNT(*) FROM schools",
        },
    ]


def _bird_tree(root: Path, sqlite_factory, split_dir: str = "dev", split: str = "dev", records=None) -> Path:
    base = root / split_dir
    base.mkdir(parents=True)
    (base / f"{split}.json").write_text(json.dumps(records if records is not None else _dev_records()))
    sqlite_factory(base / f"{split}_databases" / "california_schools" / "california_schools.sqlite", DDL, ROWS)
    return base


def test_load_bird_dev(tmp_path, sqlite_factory):
    _bird_tree(tmp_path, sqlite_factory)
    examples = load_bird(tmp_path, "dev")
    assert [e.question_id for e in examples] == ["7", "8"]
    first = examples[0]
    assert first.db_id == "california_schools"
    assert first.evidence == "largest refers to MAX(enrollment)"
    assert first.gold_sqls == ("SELECT county FROM schools ORDER BY enrollment DESC LIMIT 1",)
    assert (
        first.db_path
        == (tmp_path / "dev" / "dev_databases" / "california_schools" / "california_schools.sqlite").absolute()
    )
    assert first.meta == {"difficulty": "simple"} and examples[1].meta == {}
    assert len(load_bird(tmp_path, "dev", limit=1)) == 1


def test_train_without_question_ids_uses_index(tmp_path, sqlite_factory):
    records = [{k: v for k, v in r.items() if k not in ("question_id", "evidence")} for r in _dev_records()]
    _bird_tree(tmp_path, sqlite_factory, "train", "train", records)
    examples = load_bird(tmp_path, "train")
    assert [e.question_id for e in examples] == ["0", "1"]
    assert examples[0].evidence == ""


def test_dated_release_folder_and_databases_override(tmp_path, sqlite_factory):
    base = tmp_path / "dev_20240627"
    base.mkdir()
    (base / "dev.json").write_text(json.dumps(_dev_records()))
    elsewhere = tmp_path / "unzipped"
    sqlite_factory(elsewhere / "california_schools" / "california_schools.sqlite", DDL, ROWS)
    assert find_bird_split_dir(tmp_path, "dev") == base
    with pytest.raises(FileNotFoundError, match="BIRD databases directory not found at .*dev_20240627/dev_databases"):
        load_bird(tmp_path, "dev")
    examples = load_bird(tmp_path, "dev", databases_dir=elsewhere)
    assert examples[0].db_path == (elsewhere / "california_schools" / "california_schools.sqlite").absolute()


def test_missing_database_names_db_id_and_expected_path(tmp_path, sqlite_factory):
    records = _dev_records() + [{"db_id": "financial", "question": "q?", "SQL": "SELECT 1"}]
    base = _bird_tree(tmp_path, sqlite_factory, records=records)
    expected = (base / "dev_databases" / "financial" / "financial.sqlite").absolute()
    with pytest.raises(FileNotFoundError) as err:
        load_bird(tmp_path, "dev")
    assert str(err.value) == f"BIRD database for db_id 'financial' not found at {expected}"


def test_missing_sql_column_is_named(tmp_path, sqlite_factory):
    records = [{"db_id": "california_schools", "question": "q?", "evidence": ""}]
    _bird_tree(tmp_path, sqlite_factory, records=records)
    with pytest.raises(KeyError, match=r"missing column\(s\) \['SQL'\] in .*dev.json \(record 0\)"):
        load_bird(tmp_path, "dev")


def test_missing_split_file_lists_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="BIRD train questions not found; looked for .*train/train.json"):
        load_bird(tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="BIRD root directory not found"):
        load_bird(tmp_path / "absent", "dev")


def test_questions_file_must_be_a_list(tmp_path, sqlite_factory):
    base = _bird_tree(tmp_path, sqlite_factory)
    (base / "dev.json").write_text(json.dumps({"questions": []}))
    with pytest.raises(ValueError, match="must be a JSON list of objects"):
        load_bird(tmp_path, "dev")
