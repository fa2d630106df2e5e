"""Reader for a local BIRD download (https://bird-bench.github.io/); nothing is downloaded.

Expected layout (the official zips, unpacked), for ``split`` in ``train`` / ``dev``::

    <root>/<split>/<split>.json                            # or <root>/<split>_20240627/..., or <root>/<split>.json
    <root>/<split>/<split>_databases/<db_id>/<db_id>.sqlite

Each record of ``<split>.json`` needs ``db_id``, ``question`` and ``SQL`` (``sql`` accepted);
``evidence`` and ``question_id`` are optional (train has no ids: the record index is used),
``difficulty`` is kept in ``SQLExample.meta``. ``databases_dir`` overrides where the databases
are looked up (e.g. a ``dev_20240627`` download whose databases were unzipped elsewhere).
"""

from __future__ import annotations

from pathlib import Path

from verl_replay.data.schema import SQLExample, find_database, load_json_list, require_fields


def find_bird_split_dir(root: str | Path, split: str) -> Path:
    """The folder holding ``<split>.json``: ``<root>/<split>``, ``<root>/<split>_*`` or ``<root>``."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"BIRD root directory not found: {root}")
    candidates = [root / split, *sorted(p for p in root.glob(f"{split}_*") if p.is_dir()), root]
    for candidate in candidates:
        if (candidate / f"{split}.json").is_file():
            return candidate
    tried = ", ".join(str(c / f"{split}.json") for c in candidates)
    raise FileNotFoundError(f"BIRD {split} questions not found; looked for {tried}")


def load_bird(
    root: str | Path,
    split: str = "dev",
    *,
    databases_dir: str | Path | None = None,
    limit: int | None = None,
) -> list[SQLExample]:
    """BIRD examples of one split; every example's database must exist."""
    split_dir = find_bird_split_dir(root, split)
    questions = split_dir / f"{split}.json"
    db_dir = Path(databases_dir) if databases_dir is not None else split_dir / f"{split}_databases"
    if not db_dir.is_dir():
        raise FileNotFoundError(
            f"BIRD databases directory not found at {db_dir.absolute()}; unzip {split}_databases.zip there "
            f"or pass databases_dir / --databases-dir"
        )
    records = load_json_list(questions, what=f"BIRD {split} questions file")
    examples: list[SQLExample] = []
    db_paths: dict[str, Path] = {}
    for index, record in enumerate(records):
        if limit is not None and len(examples) >= limit:
            break
        if "SQL" not in record and "sql" in record:
            record = {**record, "SQL": record["sql"]}
        require_fields(record, ("db_id", "question", "SQL"), where=f"{questions} (record {index})")
        db_id = str(record["db_id"])
        if db_id not in db_paths:
            db_paths[db_id] = find_database(db_dir, db_id, dataset="BIRD")
        examples.append(
            SQLExample(
                question_id=str(record.get("question_id", index)),
                db_id=db_id,
                question=str(record["question"]).strip(),
                gold_sqls=(str(record["SQL"]).strip(),),
                db_path=db_paths[db_id],
                evidence=str(record.get("evidence") or "").strip(),
                meta={"difficulty": record["difficulty"]} if "difficulty" in record else {},
            )
        )
    return examples
