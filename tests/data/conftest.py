"""Shared fixtures for tests/data: one tiny-asset build per session and small SQLite files."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest


def make_db(path: Path, ddl: Sequence[str], rows: dict[str, list[tuple[Any, ...]]]) -> Path:
    """Create a real SQLite file with the given CREATE statements and rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    for statement in ddl:
        conn.execute(statement)
    for table, table_rows in rows.items():
        marks = ", ".join("?" * len(table_rows[0]))
        conn.executemany(f"INSERT INTO {table} VALUES ({marks})", table_rows)
    conn.commit()
    conn.close()
    return path


SINGER_DDL = (
    "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER)",
    "CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, singer_id INTEGER REFERENCES singer(singer_id), year "
    "INTEGER)",
)
SINGER_ROWS = {
    "singer": [(1, "Joe", "France", 40), (2, "Ann", "Peru", 29), (3, "Bo", "France", 33)],
    "concert": [(1, 1, 2014), (2, 2, 2015), (3, 1, 2015)],
}


@pytest.fixture
def singer_db(tmp_path: Path) -> Path:
    return make_db(tmp_path / "concert_singer" / "concert_singer.sqlite", SINGER_DDL, SINGER_ROWS)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from verl_replay.data.tiny_assets import build_tiny_assets

    # Two warm-start steps: these tests check the build, not what the warm start teaches.
    return build_tiny_assets(tmp_path_factory.mktemp("tiny") / "assets", seed=0, warm_start_steps={"math": 2, "sql": 2})


@pytest.fixture
def sqlite_factory():
    """``sqlite_factory(path, ddl, rows)`` creates a SQLite file (conftest helpers are not importable
    under --import-mode=importlib, so tests get the helper through this fixture)."""
    return make_db
