"""verl's real GRPO loop on CPU through ``python -m verl_replay.main`` (replay.strategy=none)."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

REQUIRED_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "timing_s/step")


def check_console(run, steps: int) -> None:
    """A start line, one compact line per step, the done line last; no traceback, no warning."""
    lines = run.output.splitlines()
    assert len(lines) <= 20, run.output  # ~6 today; verl's own output was ~1,150 lines
    assert lines[0].startswith("verl_replay: strategy=") and str(run.run_dir.name) in lines[0]
    step_lines = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in step_lines] == [f"step {i}/{steps}" for i in range(1, steps + 1)]
    assert all("score " in line and "pg_loss " in line and "grad_norm " in line for line in step_lines)
    assert lines[-1].startswith(f"verl_replay: done ({steps} steps, ") and "metrics.jsonl" in lines[-1]
    assert "Traceback" not in run.output and "warn" not in run.output.lower()


def test_grpo_loop_runs_and_updates_the_actor(run_main, tiny_assets, tmp_path):
    run = run_main(
        "trainer.total_training_steps=3",
        "trainer.save_freq=3",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        experiment="grpo",
    )
    check_console(run, steps=3)
    # its own folder, named after the experiment; nothing written outside outputs/
    assert run.run_dir.parent == tmp_path / "outputs" / "verl_replay" and run.run_dir.name.startswith("grpo-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    assert {"config.yaml", "verl.log", "metrics.jsonl", "checkpoints"} <= {p.name for p in run.run_dir.iterdir()}
    config = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    assert config["run_dir"] == str(run.run_dir) and config["trainer"]["logger"] == ["file"]
    assert "(ReplayTaskRunner pid=" in run.log and "_target_" not in run.log  # worker logs, no config dump

    metrics = run.metrics
    assert [m["training/global_step"] for m in metrics] == [1, 2, 3]
    for step in metrics:
        for key in REQUIRED_METRICS:
            assert key in step and math.isfinite(step[key]), (key, step.get(key))
        # rollout (hf server) and actor (FSDP2) log-probs of the same tokens agree
        assert step["training/rollout_probs_diff_max"] < 1e-3
    assert any(step["actor/grad_norm"] > 0 for step in metrics)

    before = load_file(str(tiny_assets.model_dir / "model.safetensors"))
    after = load_file(str(run.run_dir / "checkpoints" / "global_step_3" / "actor" / "huggingface" / "model.safetensors"))
    assert set(after) <= set(before) | {"lm_head.weight"}
    changed = [name for name in after if name in before and not torch.equal(before[name], after[name])]
    assert changed, "the actor's weights did not change after three GRPO updates"
    assert all(torch.isfinite(t).all() for t in after.values())

