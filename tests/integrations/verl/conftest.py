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
    """A frozen EliteReplay archive built by ``python -m verl_replay.elite.search`` on tiny SQL."""
    out = tmp_path_factory.mktemp("archive") / "tiny_sql.parquet"
    command = [
        sys.executable, "-m", "verl_replay.elite.search",
        "--data", str(tiny_assets.sql_train), "--model", str(tiny_assets.sql_model_dir), "--out", str(out),
        "--limit", "16", "--seeds-per-question", "8", "--mutations-per-question", "2", "--rounds", "1",
        "--max-new-tokens", "96", "--no-progress",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["counts"]["insertions"] > 0, summary
    return out
