"""Geometry3K (``hiyouga/geometry3k``), a public multimodal math set, from local parquet files.

Input: the dataset's parquet files as downloaded by hand (``train-*.parquet``, ``test-*.parquet``
or ``train.parquet`` / ``test.parquet``), columns ``images`` (a list of ``{"bytes", "path"}``),
``problem`` (text with one ``<image>`` per picture, or none: then the picture goes first) and
``answer``. Output rows: verl's multimodal RL rows (``prompt`` with the ``<image>`` placeholders,
``images`` kept as PNG/JPEG bytes), scored as math (``extra_info.benchmark = geo3k``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

GEO3K_SOURCE = "hiyouga/geometry3k"
GEO3K_INSTRUCTION = (
    " You FIRST think about the reasoning process as an internal monologue and then provide the final "
    "answer. The final answer MUST BE put in \\boxed{}."
)


def find_geo3k_files(root: str | Path, split: str) -> list[Path]:
    root = Path(root)
    if root.is_file():
        return [root]
    files = sorted(
        {*root.glob(f"{split}-*.parquet"), *root.glob(f"{split}.parquet"), *root.glob(f"data/{split}-*.parquet")}
    )
    if not files:
        raise FileNotFoundError(f"{root}: no {split}-*.parquet or {split}.parquet (hiyouga/geometry3k's files)")
    return files


def _image_bytes(image: Any, where: str) -> bytes:
    if isinstance(image, dict) and image.get("bytes"):
        return bytes(image["bytes"])
    if isinstance(image, dict) and image.get("path") and Path(image["path"]).is_file():
        return Path(image["path"]).read_bytes()
    raise ValueError(f"{where}: an image needs 'bytes' (or a readable 'path')")


def geo3k_rows(files: Sequence[Path], split: str, limit: int | None = None) -> list[dict[str, Any]]:
    import pandas as pd

    rows: list[dict[str, Any]] = []
    for path in files:
        frame = pd.read_parquet(path)
        missing = {"images", "problem", "answer"} - set(frame.columns)
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)} (expected hiyouga/geometry3k's)")
        for index, record in enumerate(frame.to_dict("records")):
            where = f"{path}: row {index}"
            images = [_image_bytes(img, where) for img in list(record["images"])]
            if not images:
                raise ValueError(f"{where}: no image")
            problem = str(record["problem"])
            if problem.count("<image>") != len(images):
                problem = "<image>" * len(images) + problem.replace("<image>", "")
            rows.append(
                {
                    "data_source": GEO3K_SOURCE,
                    "prompt": [{"role": "user", "content": problem + GEO3K_INSTRUCTION}],
                    "images": [{"bytes": data} for data in images],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(record["answer"])},
                    "extra_info": {"split": split, "index": len(rows), "benchmark": "geo3k", "question": problem},
                }
            )
            if limit is not None and len(rows) >= limit:
                return rows
    return rows
