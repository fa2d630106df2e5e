"""Geometry3K rows from local parquet files (a tiny fixture in the dataset's layout)."""

from __future__ import annotations

import io

import pandas as pd
import pytest

from verl_replay.data import __main__ as cli
from verl_replay.data.geo3k import GEO3K_SOURCE, find_geo3k_files, geo3k_rows


def _png(colour):
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def geo3k(tmp_path):
    root = tmp_path / "geometry3k" / "data"
    root.mkdir(parents=True)
    for split in ("train", "test"):
        frame = pd.DataFrame(
            {
                "images": [[{"bytes": _png("red"), "path": None}], [{"bytes": _png("blue"), "path": None}]],
                "problem": ["<image>Find x.", "What is the area?"],
                "answer": ["3", "12"],
            }
        )
        frame.to_parquet(root / f"{split}-00000-of-00001.parquet")
    return root


def test_prepare_geo3k_keeps_the_pictures_and_one_placeholder_per_picture(geo3k, tmp_path):
    out = tmp_path / "out"
    assert cli.main(["prepare", "geo3k", "--input", str(geo3k), "--output", str(out)]) == 0
    train = pd.read_parquet(out / "geo3k_train.parquet")
    assert list(train["data_source"]) == [GEO3K_SOURCE] * 2
    prompts = [p[0]["content"] for p in train["prompt"]]
    assert prompts[0].startswith("<image>Find x.") and prompts[1].startswith("<image>What is the area?")
    assert all(p.count("<image>") == 1 and "\\boxed{}" in p for p in prompts)
    assert train["images"][1][0]["bytes"] == _png("blue")
    assert list(train["reward_model"].map(lambda r: r["ground_truth"])) == ["3", "12"]
    assert set(train["extra_info"].map(lambda e: e["benchmark"])) == {"geo3k"}  # scored as math
    assert (out / "geo3k_test.parquet").is_file()


def test_geo3k_inputs_without_the_datasets_files_or_columns_are_refused(geo3k, tmp_path):
    with pytest.raises(FileNotFoundError, match="test-\\*.parquet"):
        find_geo3k_files(tmp_path, "test")
    bad = tmp_path / "train.parquet"
    pd.DataFrame({"problem": ["x"]}).to_parquet(bad)
    with pytest.raises(ValueError, match="missing column"):
        geo3k_rows([bad], "train")
    assert len(geo3k_rows(find_geo3k_files(geo3k, "train"), "train", limit=1)) == 1
