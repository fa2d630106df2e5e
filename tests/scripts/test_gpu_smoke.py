"""scripts/gpu_smoke.sh on a machine without a GPU: the plan it picks for 1, 2 and 4 GPUs
(SMOKE_DRY_RUN=1, SMOKE_GPUS=N), the one-GPU runs' configs compose and validate in verl, and
without a GPU a real run stops at once with the reason."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_smoke.sh"


def _run(env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DRY_RUN", "TINY", "MODEL_PATH")}
    full.update(env, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=timeout)


def _plan(tmp_path: Path, gpus: int, **env: str) -> dict[str, str]:
    proc = _run({"SMOKE_DRY_RUN": "1", "SMOKE_GPUS": str(gpus), "OUTPUT_DIR": str(tmp_path), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = dict(re.findall(r"^\[gpu_smoke\] stage (\w+): (.*)$", proc.stderr, re.MULTILINE))
    assert stages, proc.stderr
    return stages


def test_one_gpu_runs_both_strategies_in_sync_mode_with_flash_attention(tmp_path: Path) -> None:
    stages = _plan(tmp_path, 1)
    assert list(stages) == ["preflight", "headroom_drift_sync", "elite_search", "elite_sync"]
    for name in ("headroom_drift_sync", "elite_sync"):
        for override in (
            "platform=gpu",
            "trainer.v1.trainer_mode=sync",
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2",
            "actor_rollout_ref.model.use_remove_padding=True",
        ):
            assert override in stages[name], (name, override)
    assert "replay.strategy=headroom_drift" in stages["headroom_drift_sync"]
    assert "replay.strategy=elite" in stages["elite_sync"]
    archive = tmp_path / "elite_replay_sql" / "archive" / "elite_archive.parquet"
    assert f"replay.elite.archive={archive}" in stages["elite_sync"]  # what the search stage writes
    assert "STAGES=search" in stages["elite_search"] and "recipes/elite_replay_qwen4b.sh" in stages["elite_search"]


@pytest.mark.parametrize("gpus", [2, 4])
def test_two_or_more_gpus_run_both_recipes_split_at_tiny_shapes(tmp_path: Path, gpus: int) -> None:
    stages = _plan(tmp_path, gpus)
    assert list(stages) == ["headroom_drift_split", "elite_split"]  # no model at MODEL_PATH: no paper stage
    for name, recipe in (("headroom_drift_split", "headroom_drift_math.sh"), ("elite_split", "elite_replay_qwen4b.sh")):
        command = stages[name]
        assert f"recipes/{recipe}" in command and "TINY=1" not in command  # the GPU path, not the CPU profile
        for setting in (f"GPUS_PER_NODE={gpus}", "TRAIN_GPUS=1", "ROLLOUT_GPUS=1", "TRAIN_PROMPTS=4", "GROUP_SIZE=4"):
            assert setting in command, (name, setting)
    assert "STAGES=search,train" in stages["elite_split"]


def test_four_gpus_with_a_model_add_the_real_recipes(tmp_path: Path) -> None:
    model = tmp_path / "Qwen3.5-4B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    stages = _plan(tmp_path, 4, MODEL_PATH=str(model))
    assert list(stages) == ["headroom_drift_split", "elite_split", "headroom_drift_paper", "elite_paper"]
    for name in ("headroom_drift_paper", "elite_paper"):
        assert f"MODEL_PATH={model}" in stages[name] and "TOTAL_STEPS=2" in stages[name]
        assert "TRAIN_GPUS" not in stages[name]  # the recipes' own 2 + 2 placement
        assert stages[name].rstrip().endswith("trainer.save_freq=-1")


def test_one_gpu_configs_compose_and_validate(tmp_path: Path) -> None:
    proc = _run({"SMOKE_DRY_RUN": "1", "SMOKE_COMPOSE": "1", "SMOKE_GPUS": "1", "OUTPUT_DIR": str(tmp_path)}, 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the two training runs (dry_run=true) and the search stage's recipe (DRY_RUN=1)
    assert proc.stderr.count("composes and validates") == 3


def test_smoke_stops_without_a_gpu(tmp_path: Path) -> None:
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    proc = _run({"OUTPUT_DIR": str(tmp_path)}, timeout=120)
    assert proc.returncode == 1 and "FAILED: no GPU" in proc.stderr
