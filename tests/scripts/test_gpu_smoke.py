"""scripts/gpu_smoke.sh on a machine without a GPU: its training config composes and validates in
verl (SMOKE_DRY_RUN=1), and without a GPU it stops at once with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_smoke.sh"


def _run(env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DRY_RUN", "TINY")}
    full.update(env, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=timeout)


def test_smoke_config_composes_and_validates(tmp_path: Path) -> None:
    proc = _run({"SMOKE_DRY_RUN": "1", "OUTPUT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the smoke run's config composes and validates" in proc.stderr
    command = next(line for line in proc.stderr.splitlines() if "train (dry run):" in line)
    for override in (
        "platform=gpu",
        "trainer.v1.trainer_mode=sync",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=3",
        "replay.strategy=headroom_drift",
    ):
        assert override in command


def test_smoke_stops_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.version.cuda is not None and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = _run({"OUTPUT_DIR": str(tmp_path)}, timeout=120)
    assert proc.returncode == 1 and "FAILED: no GPU" in proc.stderr
    assert "no usable CUDA GPU" in proc.stderr
