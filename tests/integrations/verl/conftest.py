"""Helpers of the verl integration tests live in uniquely named modules on ``sys.path``
(``replay_audit``: reading what the real actor update trained on)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def tiny_archive(tmp_path_factory, tiny_assets):
    """A frozen EliteReplay archive built by ``python -m verl_replay.elite.search`` on tiny SQL,
    once per test session: the xdist workers share it (built under a lock in their common temp dir)."""
    import os

    from verl_replay.data.tiny_assets import _exclusive_lock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's temp root, common to its workers
    folder = shared / "tiny_archive"
    out = folder / "tiny_sql.parquet"
    with _exclusive_lock(folder / ".lock"):  # the tiny assets' own build lock (it makes the folder)
        if not (folder / "summary.json").exists():
            summary = _search_archive(tiny_assets, out)
            (folder / "summary.json").write_text(json.dumps(summary))
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["counts"]["insertions"] > 0, summary
    return out


def _search_archive(tiny_assets, out: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "verl_replay.elite.search",
        "--data",
        str(tiny_assets.sql_train),
        "--model",
        str(tiny_assets.sql_model_dir),
        "--out",
        str(out),
        "--limit",
        "16",
        "--seeds-per-question",
        "8",
        "--mutations-per-question",
        "2",
        "--rounds",
        "1",
        "--max-new-tokens",
        "96",
        "--no-progress",
        "--json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
