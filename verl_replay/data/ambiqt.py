"""Reader for AmbiQT (Bhaskar et al., EMNLP 2023): questions with TWO gold SQL interpretations.

Accepted input (local files only):

- a ``.json`` file (list of objects) or ``.jsonl`` file (one object per line), or
- AmbiQT's ``benchmark/`` folder: every ``<category>/<split>.json`` in it is read
  (categories ``col-synonyms``, ``tbl-synonyms``, ``tbl-split``, ``tbl-agg``).

Each record needs ``question`` and ``db_id`` and two distinct gold queries, taken from the
first present of: ``gold_queries`` / ``gold_sqls`` / ``queries`` (a list, at least 2 entries),
or the pair ``query1`` + ``query2`` (AmbiQT's own names), or ``sql1`` + ``sql2``. Optional:
``question_id`` / ``id`` (default ``<category>-<index>``), ``category`` (default: the
folder name).

Databases: ``<databases_dir>/<db_id>/<db_id>.sqlite``. AmbiQT rewrites Spider schemas (synonym
column/table names, split tables, precomputed aggregates), so its gold queries run only
against databases materialised with those changes. With ``check_executable=True`` (default)
each gold query is executed read-only and examples whose queries fail are skipped and reported
(``AmbiQTLoad.skipped``), so the coverage metric only sees questions both interpretations of
which are checkable.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_replay.data.schema import SQLExample, execute_readonly, find_database, require_fields

AMBIQT_CATEGORIES = ("col-synonyms", "tbl-synonyms", "tbl-split", "tbl-agg")


@dataclass
class AmbiQTLoad:
    examples: list[SQLExample] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (question_id, reason)


def _gold_queries(record: dict[str, Any], where: str) -> tuple[str, ...]:
    for key in ("gold_queries", "gold_sqls", "queries"):
        if isinstance(record.get(key), list):
            queries = [str(q).strip() for q in record[key] if str(q).strip()]
            break
    else:
        for first, second in (("query1", "query2"), ("sql1", "sql2")):
            if record.get(first) and record.get(second):
                queries = [str(record[first]).strip(), str(record[second]).strip()]
                break
        else:
            raise KeyError(
                f"no gold queries in {where}: expected a 'gold_queries' list or 'query1'+'query2'; "
                f"present: {sorted(record)}"
            )
    distinct = list(dict.fromkeys(queries))
    if len(distinct) < 2:
        raise ValueError(f"AmbiQT record {where} needs two distinct gold queries, got {queries}")
    return tuple(distinct)


def _read_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix.lower() == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"AmbiQT file {path} must hold a JSON list of objects")
    return data


def ambiqt_files(input_path: str | Path, split: str = "validation") -> list[Path]:
    """The JSON/JSONL files to read: the file itself, or ``<category>/<split>.json`` in a folder."""
    path = Path(input_path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"AmbiQT input not found: {path}")
    files = sorted(path.glob(f"*/{split}.json")) + sorted(path.glob(f"*/{split}.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"no AmbiQT {split} files under {path}; expected <category>/{split}.json for categories "
            f"{', '.join(AMBIQT_CATEGORIES)}, or pass a .json/.jsonl file"
        )
    return files


def _check(db_path: Path, queries: tuple[str, ...]) -> str | None:
    for n, sql in enumerate(queries, 1):
        try:
            execute_readonly(db_path, sql, timeout_s=10.0, max_rows=1)
        except (sqlite3.Error, TimeoutError) as exc:
            return f"gold query {n} does not execute on {db_path}: {exc}"
    return None


def load_ambiqt(
    input_path: str | Path,
    databases_dir: str | Path,
    *,
    split: str = "validation",
    limit: int | None = None,
    check_executable: bool = True,
) -> AmbiQTLoad:
    """AmbiQT examples (``gold_sqls`` = both interpretations) plus the skipped ones with reasons."""
    db_dir = Path(databases_dir)
    if not db_dir.is_dir():
        raise FileNotFoundError(f"AmbiQT databases directory not found at {db_dir.absolute()}")
    result = AmbiQTLoad()
    db_paths: dict[str, Path] = {}
    for path in ambiqt_files(input_path, split):
        category_default = path.parent.name if path.parent.name in AMBIQT_CATEGORIES else path.stem
        for index, record in enumerate(_read_file(path)):
            if limit is not None and len(result.examples) >= limit:
                return result
            where = f"{path} (record {index})"
            if not isinstance(record, dict):
                raise ValueError(f"{where} is not a JSON object")
            require_fields(record, ("question", "db_id"), where=where)
            queries = _gold_queries(record, where)
            category = str(record.get("category") or category_default)
            question_id = str(record.get("question_id", record.get("id", f"{category}-{index}")))
            db_id = str(record["db_id"])
            if db_id not in db_paths:
                db_paths[db_id] = find_database(db_dir, db_id, dataset="AmbiQT")
            if check_executable:
                reason = _check(db_paths[db_id], queries)
                if reason is not None:
                    result.skipped.append((question_id, reason))
                    continue
            result.examples.append(
                SQLExample(
                    question_id=question_id,
                    db_id=db_id,
                    question=str(record["question"]).strip(),
                    gold_sqls=queries,
                    db_path=db_paths[db_id],
                    meta={"category": category},
                )
            )
    return result
