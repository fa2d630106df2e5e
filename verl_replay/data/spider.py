"""Reader for a local Spider 1.0 download (https://yale-lily.github.io/spider); nothing is downloaded.

Expected layout (the official zip, unpacked; ``<root>/spider`` or ``<root>/spider_data`` also
accepted as the folder holding these files)::

    <root>/train_spider.json  <root>/train_others.json  <root>/dev.json  [<root>/test.json]
    <root>/database/<db_id>/<db_id>.sqlite             [<root>/test_database/<db_id>/<db_id>.sqlite]

Splits: ``train`` (train_spider.json), ``train_others``, ``train_all`` (both), ``dev``, ``test``.
Each record needs ``db_id``, ``question`` and ``query``. Spider has no question ids, so ids
are ``<split>-<index>``.
"""

from __future__ import annotations

from pathlib import Path

from verl_replay.data.schema import SQLExample, find_database, load_json_list, require_fields

SPIDER_SPLITS: dict[str, tuple[str, ...]] = {
    "train": ("train_spider.json",),
    "train_others": ("train_others.json",),
    "train_all": ("train_spider.json", "train_others.json"),
    "dev": ("dev.json",),
    "test": ("test.json",),
}


def find_spider_root(root: str | Path, split: str) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"Spider root directory not found: {root}")
    first = SPIDER_SPLITS[split][0]
    candidates = [root, root / "spider", root / "spider_data"]
    for candidate in candidates:
        if (candidate / first).is_file():
            return candidate
    tried = ", ".join(str(c / first) for c in candidates)
    raise FileNotFoundError(f"Spider {split} questions not found; looked for {tried}")


def load_spider(
    root: str | Path,
    split: str = "dev",
    *,
    databases_dir: str | Path | None = None,
    limit: int | None = None,
) -> list[SQLExample]:
    """Spider examples of one split; every example's database must exist."""
    if split not in SPIDER_SPLITS:
        raise ValueError(f"unknown Spider split '{split}'; expected one of {', '.join(SPIDER_SPLITS)}")
    base = find_spider_root(root, split)
    default_db = base / ("test_database" if split == "test" else "database")
    db_dir = Path(databases_dir) if databases_dir is not None else default_db
    if not db_dir.is_dir():
        raise FileNotFoundError(
            f"Spider databases directory not found at {db_dir.absolute()}; pass databases_dir / --databases-dir"
        )
    examples: list[SQLExample] = []
    db_paths: dict[str, Path] = {}
    index = 0
    for file_name in SPIDER_SPLITS[split]:
        questions = base / file_name
        for record_no, record in enumerate(load_json_list(questions, what=f"Spider {split} questions file")):
            if limit is not None and len(examples) >= limit:
                return examples
            require_fields(record, ("db_id", "question", "query"), where=f"{questions} (record {record_no})")
            db_id = str(record["db_id"])
            if db_id not in db_paths:
                db_paths[db_id] = find_database(db_dir, db_id, dataset="Spider")
            examples.append(
                SQLExample(
                    question_id=f"{split}-{index}",
                    db_id=db_id,
                    question=str(record["question"]).strip(),
                    gold_sqls=(str(record["query"]).strip(),),
                    db_path=db_paths[db_id],
                )
            )
            index += 1
    return examples
