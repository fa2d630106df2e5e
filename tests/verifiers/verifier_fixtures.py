"""Real SQLite fixtures for the verifier tests (imported by name: this folder is on sys.path)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path


def build_db(path: Path, *, journal_mode: str = "delete") -> Path:
    """A small real database: ``t`` (2000 rows, for cross joins), ``s`` (duplicates, ties),
    ``emp``/``dept`` (joins), ``raw`` (a TEXT value that is not valid UTF-8)."""
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA journal_mode={journal_mode}")
    conn.executescript(
        """
        CREATE TABLE t (a INTEGER PRIMARY KEY, b TEXT);
        CREATE TABLE s (x INTEGER, y TEXT);
        CREATE TABLE dept (id INTEGER PRIMARY KEY, name TEXT);
        CREATE TABLE emp (id INTEGER PRIMARY KEY, name TEXT, dept_id INTEGER, salary REAL);
        CREATE TABLE raw (id INTEGER, v TEXT);
        CREATE INDEX s_x ON s(x);
        CREATE VIEW big_earners AS SELECT name FROM emp WHERE salary > 100;
        """
    )
    conn.executemany("INSERT INTO t VALUES (?, ?)", [(i, f"row{i}") for i in range(2000)])
    conn.executemany("INSERT INTO s VALUES (?, ?)", [(1, "a"), (1, "a"), (2, "b"), (3, "c"), (3, "d")])
    conn.executemany("INSERT INTO dept VALUES (?, ?)", [(1, "eng"), (2, "ops")])
    conn.executemany(
        "INSERT INTO emp VALUES (?, ?, ?, ?)",
        [(1, "ann", 1, 120.0), (2, "bob", 1, 90.0), (3, "cid", 2, 150.0), (4, "dee", 2, 80.0)],
    )
    # latin-1 bytes stored as TEXT: Python's default text decoding would raise on them.
    conn.execute("INSERT INTO raw VALUES (1, CAST(X'636166E9' AS TEXT))")  # b'caf\xe9'
    conn.execute("INSERT INTO raw VALUES (2, CAST(X'6E61C3AF7665' AS TEXT))")  # 'naïve' UTF-8
    conn.commit()
    conn.close()
    return path


def fingerprint(db: Path) -> tuple[str, list[str]]:
    """(sha256 of the database file, sorted names of files in its directory)."""
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    return digest, sorted(os.listdir(db.parent))
