"""verl's real GRPO loop on CPU through ``python -m verl_replay.main`` (replay.strategy=none)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

REQUIRED_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "timing_s/step")
ROW_PROBE = Path(__file__).with_name("fresh_row_probe.py")


def _check_fresh_rows_carry_mrope_position_ids(probe: dict) -> None:
    """What verl's agent loop wrote to TransferQueue for the tiny Qwen3.5 (processor loaded):
    per row (4, L) int64 M-RoPE position ids, L = prompt + response tokens; for text the
    temporal/height/width rows repeat the token index (Qwen3.5's get_rope_index), like row 0."""
    fields = probe["fields"]
    position = fields["position_ids"]
    assert position["kind"] == "nested_tensor" and position["dtype"] == "torch.int64", position
    for row in range(probe["rows"]):
        length = len(probe["values"]["input_ids"][row])
        assert length == len(probe["values"]["prompts"][row]) + len(probe["values"]["responses"][row])
        assert position["row_shapes"][row] == [4, length]
        assert probe["values"]["position_ids"][row] == [list(range(length))] * 4
    # the processor's (empty for text) multimodal inputs travel with every row
    assert fields["multi_modal_inputs"]["kind"] == "non_tensor" and fields["multi_modal_inputs"]["item_types"] == ["dict"]


def test_grpo_loop_runs_and_updates_the_actor(run_main, tiny_assets, tmp_path):
    probe_path = tmp_path / "fresh_rows.json"
    run = run_main(
        "trainer.total_training_steps=3",
        "trainer.save_freq=3",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        # verl's own sampler plus a read-back of the first training batch from TransferQueue
        f"trainer.v1.sampler.custom_sampler.path={ROW_PROBE}",
        "trainer.v1.sampler.custom_sampler.name=FreshRowProbe",
        f"+trainer.v1.sampler.sampler_kwargs.row_probe_path={probe_path}",
        experiment="grpo",
    )
    _check_fresh_rows_carry_mrope_position_ids(json.loads(probe_path.read_text()))
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


def test_tiny_sql_run_learns(run_main):
    """``python -m verl_replay.main tiny_task=sql`` with its defaults: responses fit the gold
    queries, some answers are right, so groups disagree and the policy gradient is not zero."""
    metrics = run_main("tiny_task=sql", experiment="sql").metrics
    assert len(metrics) == 3
    assert max(step["response_length/max"] for step in metrics) <= 96
    assert max(step["critic/score/mean"] for step in metrics) > 0, [step["critic/score/mean"] for step in metrics]
    assert sum(step["actor/grad_norm"] for step in metrics) > 0
    assert all(step["training/rollout_probs_diff_max"] < 1e-3 for step in metrics)


def test_invalid_replay_value_fails_at_startup_naming_the_key(run_main):
    run = run_main("replay.tau=-1", experiment="bad", check=False, timeout=120)
    assert run.returncode != 0
    assert "replay.tau" in run.output and "Ray" not in run.output.split("replay.tau")[0][-2000:]
    run = run_main("replay.strategy=headroom", experiment="bad2", check=False, timeout=120)
    assert run.returncode != 0 and "replay.strategy must be one of" in run.output
