"""SQLite schema text for prompts, and the example record shared by every SQL dataset.

`schema_text` is what BIRD, Spider, AmbiQT and the tiny SQL prompts all show the model: the
CREATE TABLE statements exactly as stored in ``sqlite_master`` (so keys and foreign keys are
visible), optionally followed by a few sample rows per table.

Databases are always opened read-only (``mode=ro`` URI + ``query_only``): preparing prompts must
never change a user's benchmark files.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Sample-row cells longer than this are cut: some BIRD columns hold whole documents.
_MAX_CELL_CHARS = 40


@dataclass(frozen=True)
class SQLExample:
    """One text-to-SQL question over one SQLite database.

    ``gold_sqls`` holds every accepted gold query: the single gold query for BIRD/Spider, the
    two interpretations for AmbiQT, the equivalent strategies for the tiny dataset. The first
    one is the canonical ``reward_model.ground_truth``.
    """

    question_id: str
    db_id: str
    question: str
    gold_sqls: tuple[str, ...]
    db_path: Path
    evidence: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def gold_sql(self) -> str:
        return self.gold_sqls[0]


def connect_readonly(db_path: str | Path) -> sqlite3.Connection:
    """Open an existing SQLite file read-only; raise FileNotFoundError naming the path if absent."""
    path = Path(db_path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"SQLite database not found at {path}")
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, check_same_thread=False)
    conn.execute("PRAGMA query_only = ON")
    return conn


def execute_readonly(
    db_path: str | Path, sql: str, *, timeout_s: float = 10.0, max_rows: int = 100_000
) -> list[tuple[Any, ...]]:
    """Run one query on a read-only connection with a deadline enforced inside SQLite.

    Used to check gold queries of datasets we build or load (trusted input, but a slow gold
    query must not stall data preparation). Raises ``sqlite3.Error`` on failure and
    ``TimeoutError`` past the deadline; returns at most ``max_rows`` rows.
    """
    conn = connect_readonly(db_path)
    deadline = time.monotonic() + timeout_s
    # A non-zero return from the progress handler interrupts the running statement.
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    try:
        cursor = conn.execute(sql)
        rows = cursor.fetchmany(max_rows)
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc) and time.monotonic() > deadline:
            raise TimeoutError(f"query exceeded {timeout_s} s on {db_path}: {sql[:200]}") from exc
        raise
    finally:
        conn.close()
    return [tuple(row) for row in rows]


def _quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _format_cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    text = str(value).replace("\n", " ")
    return text if len(text) <= _MAX_CELL_CHARS else text[: _MAX_CELL_CHARS - 3] + "..."


def _sample_rows_text(conn: sqlite3.Connection, table: str, n_rows: int) -> str:
    cursor = conn.execute(f"SELECT * FROM {_quote_identifier(table)} LIMIT {int(n_rows)}")
    columns = [d[0] for d in cursor.description]
    rows = cursor.fetchall()
    lines = [f"/* {len(rows)} example rows from {table}:", " | ".join(columns)]
    lines += [" | ".join(_format_cell(v) for v in row) for row in rows]
    return "\n".join(lines) + " */"


def table_names(db_path: str | Path) -> list[str]:
    """User tables of the database in creation order."""
    conn = connect_readonly(db_path)
    try:
        rows = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
        ).fetchall()
    finally:
        conn.close()
    return [r[0] for r in rows]


def schema_text(db_path: str | Path, *, with_sample_rows: int = 0) -> str:
    """CREATE TABLE statements of a SQLite database, in creation order, one blank line apart.

    ``with_sample_rows=k`` appends up to k rows of each table as a comment after its statement.
    Raises FileNotFoundError for a missing file and ValueError for a file that is not a
    SQLite database or has no tables.
    """
    if with_sample_rows < 0:
        raise ValueError(f"with_sample_rows must be >= 0, got {with_sample_rows}")
    conn = connect_readonly(db_path)
    try:
        try:
            entries: Sequence[tuple[str, str]] = conn.execute(
                "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL "
                "AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
            ).fetchall()
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"{db_path} is not a readable SQLite database: {exc}") from exc
        if not entries:
            raise ValueError(f"SQLite database {db_path} has no tables")
        blocks = []
        for name, sql in entries:
            # Stored DDL keeps the author's formatting; only trailing spaces are noise.
            block = "\n".join(line.rstrip() for line in sql.strip().splitlines())
            if with_sample_rows:
                block += "\n" + _sample_rows_text(conn, name, with_sample_rows)
            blocks.append(block)
    finally:
        conn.close()
    return "\n\n".join(blocks)


def find_database(databases_dir: str | Path, db_id: str, *, dataset: str) -> Path:
    """``<databases_dir>/<db_id>/<db_id>.sqlite`` (also one same-named folder deeper, as some
    zip extractions nest ``dev_databases/dev_databases/``); error names the expected path."""
    root = Path(databases_dir)
    path = root / db_id / f"{db_id}.sqlite"
    if path.is_file():
        return path.absolute()
    nested = root / root.name / db_id / f"{db_id}.sqlite"
    if nested.is_file():
        return nested.absolute()
    raise FileNotFoundError(f"{dataset} database for db_id '{db_id}' not found at {path.absolute()}")


def load_json_list(path: Path, *, what: str) -> list[dict[str, Any]]:
    """A JSON file holding a list of objects; errors name the file and what it should hold."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found at {path.absolute()}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} at {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{what} at {path} must be a JSON list of objects")
    return data


def require_fields(record: dict[str, Any], fields: Sequence[str], *, where: str) -> None:
    """Raise KeyError naming the missing column(s) and the record's location."""
    missing = [f for f in fields if record.get(f) in (None, "")]
    if missing:
        raise KeyError(f"missing column(s) {missing} in {where}; present: {sorted(record)}")
