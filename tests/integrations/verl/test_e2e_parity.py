"""``replay.strategy=none`` is verl's own GRPO: our entry point against verl's, on one config.

The config is composed once through ``verl_replay.main``'s Hydra config (cpu_tiny profile),
resolved, and given to verl's own ``python -m verl.trainer.main_ppo`` as its config file without our
keys. Both runs must log the same metrics. verl's synchronous trainer is used: under
``separate_async`` which fresh groups a round trains on depends on which rollouts finish first, so two
runs of verl itself already differ step by step (the replay hooks are the same mixin on both).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.e2e

OURS_ONLY = ("replay", "dry_run", "run_dir", "tiny_task")
# rollout- and update-determined metrics (timings and throughput depend on the machine's load)
COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
            "training/rollout_probs_diff_mean")
OVERRIDES = ("trainer.total_training_steps=2",)


def _composed_config(overrides: tuple[str, ...]) -> dict:
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import verl_replay.main
    from verl_replay.main import register_resolvers

    register_resolvers()
    config_dir = str(Path(verl_replay.main.__file__).parent / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="replay_trainer", overrides=list(overrides))
    return OmegaConf.to_container(config, resolve=True)


def _metrics(path) -> list[dict]:
    return [json.loads(line)["data"] for line in path.read_text().splitlines() if line.strip()]


def test_strategy_none_gives_verls_own_metrics(tmp_path, run_main):
    ours = run_main(*OVERRIDES, "replay.strategy=none", experiment="ours")

    config = _composed_config(OVERRIDES)
    for key in OURS_ONLY:
        config.pop(key)
    config["trainer"]["default_local_dir"] = str(tmp_path / "verl_checkpoints")
    (tmp_path / "verl_config").mkdir()
    (tmp_path / "verl_config" / "run.yaml").write_text(yaml.safe_dump(config))
    verl_metrics = tmp_path / "verl_metrics.jsonl"
    env = dict(os.environ, VERL_PLATFORM="cpu", VERL_FILE_LOGGER_PATH=str(verl_metrics), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={tmp_path / 'verl_config'}",
               "--config-name=run", "hydra.run.dir=" + str(tmp_path / "hydra"), "hydra.output_subdir=null"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]

    theirs = _metrics(verl_metrics)
    assert [m["training/global_step"] for m in theirs] == [m["training/global_step"] for m in ours.metrics] == [1, 2]
    for mine, verls in zip(ours.metrics, theirs):
        assert not any(key.startswith("replay/") for key in mine)
        for key in COMPARED:
            assert math.isclose(mine[key], verls[key], rel_tol=1e-5, abs_tol=1e-7), (key, mine[key], verls[key])
