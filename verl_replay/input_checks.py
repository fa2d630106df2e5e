"""Start-up checks of a training run's inputs, in the driver, before Ray starts.

A wrong path used to surface 20 s later as a 60-line Ray traceback from a worker. Each check
here raises :class:`PreflightError` with one line naming the config key, the path and what to
change. Checked: the data files (exist, are parquet, have the prompt column), the SQLite
database every SQL row names (exists, is an SQLite file), the model directory (has a
``config.json``), the tokenizer (loads), the EliteReplay archive file (exists).

Paths with a URL scheme (``hdfs://``, ``s3://``) and models given as hub ids (``org/name`` that
is not a local path) are left to verl. Imports pyarrow and transformers lazily; never verl.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "PreflightError",
    "check_archive_file",
    "check_data_files",
    "check_model_dir",
    "check_sql_databases",
    "check_tokenizer",
    "is_hub_id",
    "is_remote",
]

SQLITE_MAGIC = b"SQLite format 3\x00"
_SQL_SOURCES = frozenset({"bird", "spider", "ambiqt", "tiny_sql"})  # verl_replay.rewards' SQL names
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PreflightError(ValueError):
    """A run input that cannot work; the message is one line naming the key and the path."""


def is_remote(path: str) -> bool:
    return "://" in path


def is_hub_id(path: str) -> bool:
    """``org/name`` that is not a local path: transformers / vLLM resolve it from the hub cache."""
    return bool(_HUB_ID.match(path)) and not Path(path).exists() and not Path(path.split("/")[0]).exists()


def as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    return [os.fspath(v) for v in value]


# ---------------------------------------------------------------------------- data


def check_data_files(key: str, value: Any, *, prompt_key: str = "prompt") -> list[Path]:
    """Every file of ``key`` (a path or a list) exists and is a parquet file with ``prompt_key``."""
    files = as_list(value)
    if not files:
        raise PreflightError(f"{key} is empty: give a parquet file (python -m verl_replay.data prepare ...)")
    local = []
    for name in files:
        if is_remote(name):
            continue
        path = Path(name).expanduser()
        if not path.is_file():
            what = "is a directory, not a parquet file" if path.is_dir() else "does not exist"
            raise PreflightError(f"{key}: {path} {what} (python -m verl_replay.data prepare ... writes one)")
        columns = _parquet_columns(key, path)
        if prompt_key not in columns:
            raise PreflightError(
                f"{key}: {path} has no '{prompt_key}' column (data.prompt_key); columns: {', '.join(columns)}"
            )
        local.append(path)
    return local


def _parquet_columns(key: str, path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(path).names)
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError subclasses for non-parquet bytes
        raise PreflightError(f"{key}: {path} is not a readable parquet file ({error})") from None


def check_sql_databases(key: str, files: Iterable[Path]) -> int:
    """The SQLite file of every SQL row (``extra_info.db_path``) exists; returns how many distinct.

    A row is SQL when its ``data_source`` is one the SQL reward handles (bird, spider, ambiqt,
    tiny_sql, sql*) or when it names a ``db_path``; a SQL row without one cannot be scored.
    """
    checked: set[str] = set()
    for path in files:
        for row, source, info in _sql_rows(path):
            db_path = info.get("db_path")
            if not db_path:
                raise PreflightError(
                    f"{key}: {path} row {row} (data_source {source!r}) has no extra_info.db_path: "
                    "the SQL reward needs the question's SQLite file"
                )
            db = Path(os.fspath(db_path))
            if not db.is_absolute() and info.get("db_root"):
                db = Path(os.fspath(info["db_root"])) / db
            if str(db) in checked:
                continue
            _check_sqlite(key, path, row, db)
            checked.add(str(db))
    return len(checked)


def _sql_rows(path: Path) -> Iterable[tuple[int, str, Mapping[str, Any]]]:
    import pyarrow.parquet as pq

    names = set(pq.read_schema(path).names)
    columns = [c for c in ("data_source", "extra_info") if c in names]
    if not columns:
        return
    table = pq.read_table(path, columns=columns).to_pydict()
    sources = table.get("data_source", [None] * _table_len(table))
    infos = table.get("extra_info", [None] * _table_len(table))
    for row, (source, info) in enumerate(zip(sources, infos, strict=True)):
        info = info if isinstance(info, Mapping) else {}
        name = str(source or "").lower()
        if name in _SQL_SOURCES or name.startswith("sql") or info.get("db_path"):
            yield row, str(source), info


def _table_len(table: Mapping[str, list]) -> int:
    return len(next(iter(table.values()))) if table else 0


def _check_sqlite(key: str, data_file: Path, row: int, db: Path) -> None:
    where = f"{key}: {data_file} row {row} names the database {db}"
    if not db.is_file():
        raise PreflightError(f"{where}, which does not exist (prepare the data where the databases are)")
    with open(db, "rb") as handle:
        if handle.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            raise PreflightError(f"{where}, which is not an SQLite database file")


# ---------------------------------------------------------------------------- model, tokenizer, archive


def check_model_dir(key: str, path: Optional[str]) -> Optional[Path]:
    """A local model directory with ``config.json``; None for a hub id (checked by its loader)."""
    if not path:
        raise PreflightError(f"{key} is required: a model directory (or a hub id such as Qwen/Qwen3.5-4B)")
    if is_remote(path) or is_hub_id(path):
        return None
    model = Path(path).expanduser()
    if not model.is_dir():
        what = "is a file, not a model directory" if model.exists() else "does not exist"
        raise PreflightError(f"{key}: {model} {what}")
    if not (model / "config.json").is_file():
        raise PreflightError(f"{key}: {model} has no config.json (not a Hugging Face model directory)")
    return model


def check_tokenizer(key: str, path: Optional[str], *, trust_remote_code: bool = False) -> Any:
    """Load the tokenizer verl will load; None for a hub id (not fetched here)."""
    if not path or is_remote(path) or is_hub_id(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(Path(path).expanduser()), trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers raises OSError / ValueError / others for unusable folders
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise PreflightError(f"{key}: no tokenizer loads from {path} ({first})") from None


def check_archive_file(key: str, path: Optional[str]) -> Path:
    if not path:
        raise PreflightError(f"{key} is required for this strategy (python -m verl_replay.elite.search writes one)")
    archive = Path(path).expanduser()
    if not archive.is_file():
        raise PreflightError(
            f"{key}: {archive} does not exist (python -m verl_replay.elite.search writes one; "
            f"for the tiny run: python -m verl_replay.elite.search --tiny --out {archive})"
        )
    return archive
