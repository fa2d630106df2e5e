from __future__ import annotations

import sqlite3

import pytest

from verl_replay.data.schema import (
    connect_readonly,
    execute_readonly,
    find_database,
    schema_text,
    table_names,
)


def test_schema_text_is_create_statements_in_creation_order(singer_db):
    text = schema_text(singer_db)
    assert text == (
        "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER)\n\n"
        "CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, singer_id INTEGER REFERENCES singer(singer_id), "
        "year INTEGER)"
    )
    assert table_names(singer_db) == ["singer", "concert"]


def test_schema_text_with_sample_rows(singer_db):
    text = schema_text(singer_db, with_sample_rows=2)
    assert (
        "/* 2 example rows from singer:\nsinger_id | name | country | age\n1 | Joe | France | 40\n2 | Ann | Peru | "
        "29 */" in text
    )
    assert "/* 2 example rows from concert:" in text


def test_sample_rows_cut_long_cells_and_show_null(tmp_path, sqlite_factory):
    db = sqlite_factory(tmp_path / "d.sqlite", ["CREATE TABLE t (a TEXT, b TEXT)"], {"t": [("x" * 100, None)]})
    text = schema_text(db, with_sample_rows=1)
    assert "x" * 37 + "... | NULL" in text and "x" * 38 not in text


def test_missing_and_invalid_databases_raise_clear_errors(tmp_path):
    missing = tmp_path / "nope.sqlite"
    with pytest.raises(FileNotFoundError, match="SQLite database not found at .*nope.sqlite"):
        schema_text(missing)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 50)
    with pytest.raises(ValueError, match="not a readable SQLite database"):
        schema_text(junk)
    empty = tmp_path / "empty.sqlite"
    sqlite3.connect(empty).close()
    with pytest.raises(ValueError, match="has no tables"):
        schema_text(empty)
    with pytest.raises(ValueError, match="with_sample_rows"):
        schema_text(empty, with_sample_rows=-1)


def test_connections_are_read_only(singer_db):
    before = singer_db.read_bytes()
    conn = connect_readonly(singer_db)
    with pytest.raises(sqlite3.OperationalError):
        conn.execute("DELETE FROM singer")
    conn.close()
    with pytest.raises(sqlite3.OperationalError):
        execute_readonly(singer_db, "DROP TABLE singer")
    assert singer_db.read_bytes() == before


def test_execute_readonly_returns_rows_caps_and_times_out(singer_db):
    assert execute_readonly(singer_db, "SELECT name FROM singer WHERE country = 'France' ORDER BY name") == [
        ("Bo",),
        ("Joe",),
    ]
    assert len(execute_readonly(singer_db, "SELECT * FROM singer", max_rows=2)) == 2
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    with pytest.raises(TimeoutError, match="exceeded 0.2 s"):
        execute_readonly(singer_db, endless, timeout_s=0.2)


def test_find_database_layouts_and_error(tmp_path, sqlite_factory):
    ddl = ["CREATE TABLE t (a INTEGER)"]
    flat = sqlite_factory(tmp_path / "dbs" / "a" / "a.sqlite", ddl, {"t": [(1,)]})
    assert find_database(tmp_path / "dbs", "a", dataset="X") == flat.absolute()
    nested = sqlite_factory(tmp_path / "dev_databases" / "dev_databases" / "b" / "b.sqlite", ddl, {"t": [(1,)]})
    assert find_database(tmp_path / "dev_databases", "b", dataset="X") == nested.absolute()
    expected = (tmp_path / "dbs" / "zzz" / "zzz.sqlite").absolute()
    with pytest.raises(FileNotFoundError) as err:
        find_database(tmp_path / "dbs", "zzz", dataset="BIRD")
    assert str(err.value) == f"BIRD database for db_id 'zzz' not found at {expected}"
