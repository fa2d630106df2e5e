"""CI smoke of ``python -m verl_replay.compare``: one seed, one arm (Headroom-Drift), two global
steps, through the real recipe and verl's separate_async trainer on CPU; checks the files the
harness writes and that a rerun skips the finished run. (Several arms and seeds are the same code
path, one run each: tests/compare/test_plan.py, test_report.py, test_collect.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 150

pytestmark = pytest.mark.e2e


def _compare(out, *extra, timeout=1500):
    cmd = [
        sys.executable,
        "-m",
        "verl_replay.compare",
        "--comparison",
        "headroom_drift",
        "--arms",
        "headroom_drift",
        "--seeds",
        "1",
        "--steps",
        "2",
        "--test-freq",
        "2",
        "--val-n",
        "2",
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def test_compare_smoke_writes_json_table_and_png(tmp_path):
    out = tmp_path / "cmp"
    run = _compare(out)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    doc = json.loads((out / "comparison.json").read_text())
    assert doc["profile"] == "tiny" and doc["seeds"] == [1] and doc["problems"] == []
    assert doc["tau"] == pytest.approx(0.0632455532)
    [comp] = doc["comparisons"]
    assert comp["comparison"] == "headroom_drift" and comp["val_n"] == 2
    [arm] = comp["arms"]
    assert arm["name"] == "headroom_drift"
    result = arm["runs"]["1"]
    assert result["steps"] == 2 and result["fresh_responses"] == 2 * 8 * 4
    assert [p["step"] for p in result["val_curve"]] == [0, 2]  # before training + test_freq
    assert all(0.0 <= p["mean"] <= p["best"] <= 1.0 for p in result["val_curve"])
    assert result["step_time_s"] > 0 and arm["summary"]["final_mean"]["n"] == 1
    assert (
        "TRAIN_PROMPTS=8" in result["command"]
        and (out / "runs" / "headroom_drift" / "headroom_drift" / "seed1").is_dir()
    )
    share = result["replay_token_share"]  # step 2 had a buffer to replay from
    assert share is not None and 0.0 <= share < 1.0
    table = (out / "table.md").read_text()
    assert "| Headroom-Drift b32+r16 (tau 0.0632) | 1 |" in table
    assert "Mean@2 (final)" in table and "Mean@2 (final)" in run.stdout  # the table is printed too
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(str(out / "curves.png")).shape[:2]
    assert width > 500 and height > 200
    # the same command again runs nothing: finished runs are skipped, the report is rewritten
    again = _compare(out)
    assert again.returncode == 0 and again.stderr.count("done earlier") == 1, again.stderr[-3000:]
    assert json.loads((out / "comparison.json").read_text())["comparisons"] == doc["comparisons"]
