"""verl's real GRPO loop on CPU through ``python -m verl_replay.main`` (replay.strategy=none).

The run is the tiny text-to-SQL task with its defaults (``tiny_task=sql``): its responses fit the
gold queries and some answers are right, so groups disagree and the policy gradient is not zero;
the step-3 checkpoint favours the first batch's right answers over the wrong ones.
``replay.strategy=none`` is verl's own GRPO: the run is repeated with verl's own entry point
(``python -m verl.trainer.main_ppo``) on the same config, composed once through our Hydra config
(cpu_tiny profile), resolved, and given to verl without our keys; both must log the same metrics.
verl's synchronous trainer is used: under ``separate_async`` which fresh groups a round trains on
depends on which rollouts finish first, so two runs of verl itself already differ step by step (the
replay hooks are the same mixin on both).
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from reproducible_rollout import HF_ROLLOUT
from safetensors.torch import load_file

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 200

pytestmark = pytest.mark.e2e

REQUIRED_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "timing_s/step")
ROW_PROBE = Path(__file__).with_name("fresh_row_probe.py")

OURS_ONLY = (
    "replay",
    "dry_run",
    "run_dir",
    "tiny_task",
    "tiny_response_length",
    "verbose",
    "output_root",
    "exact_eval",
)
# rollout- and update-determined metrics (timings and throughput depend on the machine's load)
COMPARED = (
    "critic/score/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "training/rollout_probs_diff_mean",
)


def _composed_config(overrides: tuple[str, ...]) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import verl_replay.main
    from verl_replay.main import register_resolvers

    register_resolvers()
    config_dir = str(Path(verl_replay.main.__file__).parent / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="replay_trainer", overrides=list(overrides))
    return OmegaConf.to_container(config, resolve=True)


def run_verls_own_entry_point(tmp_path: Path, overrides: tuple[str, ...]) -> list[dict]:
    """``python -m verl.trainer.main_ppo`` on our composed config without our keys; its metrics."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = _composed_config(overrides)
    for key in OURS_ONLY:
        config.pop(key)
    config["trainer"]["default_local_dir"] = str(tmp_path / "verl_checkpoints")
    (tmp_path / "verl_config").mkdir()
    (tmp_path / "verl_config" / "run.yaml").write_text(yaml.safe_dump(config))
    verl_metrics = tmp_path / "verl_metrics.jsonl"
    # RAY_worker_niceness as verl_replay.main sets it on CPU (Ray's 15 lets a loaded machine starve the run)
    env = dict(
        os.environ,
        VERL_PLATFORM="cpu",
        VERL_FILE_LOGGER_PATH=str(verl_metrics),
        PYTHONUNBUFFERED="1",
        RAY_worker_niceness="0",
    )
    command = [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={tmp_path / 'verl_config'}",
        "--config-name=run",
        "hydra.run.dir=" + str(tmp_path / "hydra"),
        "hydra.output_subdir=null",
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return [json.loads(line)["data"] for line in verl_metrics.read_text().splitlines() if line.strip()]


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
    assert fields["multi_modal_inputs"]["kind"] == "non_tensor" and fields["multi_modal_inputs"]["item_types"] == [
        "dict"
    ]


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


def test_grpo_loop_runs_updates_the_actor_and_matches_verls_own(run_main, tiny_assets, tmp_path):
    probe_path = tmp_path / "fresh_rows.json"
    overrides = (
        *HF_ROLLOUT,  # compared with verl's own entry point, run for run
        "tiny_task=sql",
        "trainer.total_training_steps=3",
        "trainer.save_freq=3",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        # verl's own sampler plus a read-back of the first training batch from TransferQueue
        f"trainer.v1.sampler.custom_sampler.path={ROW_PROBE}",
        "trainer.v1.sampler.custom_sampler.name=FreshRowProbe",
        f"+trainer.v1.sampler.sampler_kwargs.row_probe_path={probe_path}",
    )
    run = run_main(*overrides, "replay.strategy=none", experiment="grpo")  # the defaults of tiny_task=sql
    _check_fresh_rows_carry_mrope_position_ids(json.loads(probe_path.read_text()))
    check_console(run, steps=3)
    # its own folder, named after the experiment; nothing written outside outputs/
    assert run.run_dir.parent == tmp_path / "outputs" / "verl_replay" and run.run_dir.name.startswith("grpo-")
    assert sorted(p.name for p in tmp_path.iterdir() if p != probe_path) == ["outputs"]
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
    check_tiny_sql_signal(metrics)
    trained_dir = run.run_dir / "checkpoints" / "global_step_3" / "actor" / "huggingface"
    check_update_favours_rewarded_answers(
        json.loads(probe_path.read_text()), tiny_assets, trained_dir, metrics[0]["critic/score/mean"]
    )

    before = load_file(str(tiny_assets.sql_model_dir / "model.safetensors"))
    after = load_file(str(trained_dir / "model.safetensors"))
    assert set(after) <= set(before) | {"lm_head.weight"}
    changed = [name for name in after if name in before and not torch.equal(before[name], after[name])]
    assert changed, "the actor's weights did not change after three GRPO updates"
    assert all(torch.isfinite(t).all() for t in after.values())

    # the same run through verl's own entry point: the same metrics
    theirs = run_verls_own_entry_point(tmp_path / "verl", overrides)
    assert [m["training/global_step"] for m in theirs] == [1, 2, 3]
    for mine, verls in zip(metrics, theirs, strict=True):
        assert not any(key.startswith("replay/") for key in mine)
        for key in COMPARED:
            assert math.isclose(mine[key], verls[key], rel_tol=1e-5, abs_tol=1e-7), (key, mine[key], verls[key])


def check_tiny_sql_signal(metrics: list[dict]) -> None:
    """The tiny SQL run's defaults give GRPO a signal: responses fit the gold queries, some answers
    are right, so groups disagree and the policy gradient is not zero. (That its reward *rises* over
    3 steps is not asserted: on this 0.2M-parameter model the gain of a few GRPO steps was measured
    below the sampling noise, ~0.02 in accuracy, at every learning rate that does not collapse it.)"""
    assert len(metrics) == 3
    assert max(step["response_length/max"] for step in metrics) <= 96
    assert max(step["critic/score/mean"] for step in metrics) > 0, [step["critic/score/mean"] for step in metrics]
    assert sum(step["actor/grad_norm"] for step in metrics) > 0


_SQL_BLOCK = re.compile(r"```sql\n(.*?)(?:```|\Z)", re.DOTALL)


def _reward_by_sqlite(text: str, golds: list[str], db_path: str) -> float:
    """1.0 when the response's last ```sql block (closed or cut off by the length limit) returns the
    same set of rows as one of the gold queries (the BIRD rule the tiny task scores by), else 0.0;
    executed with ``sqlite3`` alone on a read-only connection, under an operation budget."""
    blocks = _SQL_BLOCK.findall(text)
    if not blocks:
        return 0.0
    predicted = blocks[-1].strip().rstrip(";").strip()
    connection = sqlite3.connect(f"{Path(db_path).absolute().as_uri()}?mode=ro", uri=True)
    budget = iter(range(10_000))  # progress calls of 1,000 VM steps each: 10M steps, then interrupt
    connection.set_progress_handler(lambda: next(budget, None) is None, 1000)
    try:
        try:
            answer = set(connection.execute(predicted).fetchall())
        except (sqlite3.Error, sqlite3.Warning):
            return 0.0
        return float(any(answer == set(connection.execute(gold).fetchall()) for gold in golds))
    finally:
        connection.close()


def _sequence_log_probs(model_dir: Path, rows: list[tuple[list[int], list[int]]]) -> list[float]:
    """Sum of the response tokens' log-probs (temperature 1, as sampled) under a checkpoint."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    out = []
    with torch.no_grad():
        for prompt, response in rows:
            ids = torch.tensor([prompt + response])  # [1, P + R]
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
            out.append(float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).sum()))
    return out


def check_update_favours_rewarded_answers(probe: dict, tiny_assets, trained_dir: Path, step1_score: float) -> None:
    """The tiny SQL run learns in the sense a few GRPO steps can show on a 0.2M-parameter model: the
    trained policy moves probability toward the first batch's rewarded answers, relative to the
    wrong ones of the same question (sequence log-prob gain of right minus wrong answers > 1 nat).
    Rewards are recomputed here without ``verl_replay``, by executing each decoded answer with
    ``sqlite3`` on a read-only connection to the task's database, and their mean must be the run's
    own step-1 score (the probe batch is step 1's); the log-probs come from independent forwards of
    the warm start and of the step-3 checkpoint. A sign error in the advantages, a zero gradient or
    a broken reward would each fail it."""
    import pandas as pd
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.sql_model_dir)
    rows_by_prompt = {}
    for _, row in pd.read_parquet(tiny_assets.sql_train).iterrows():
        prompt = tokenizer.apply_chat_template(
            [dict(m) for m in row["prompt"]], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        extra = dict(row["extra_info"], gold_sqls=list(row["extra_info"]["gold_sqls"]))
        rows_by_prompt[tuple(prompt)] = (row["reward_model"]["ground_truth"], extra)
    prompts, responses = probe["values"]["prompts"], probe["values"]["responses"]
    rewards = []
    for prompt, response in zip(prompts, responses, strict=True):
        gold, extra = rows_by_prompt[tuple(prompt)]
        text = tokenizer.decode(response, skip_special_tokens=True)
        golds = [gold] + [g for g in extra["gold_sqls"] if g != gold]
        rewards.append(_reward_by_sqlite(text, golds, extra["db_path"]))
    assert sum(rewards) / len(rewards) == pytest.approx(step1_score, abs=1e-9), rewards
    rows = list(zip(prompts, responses, strict=True))
    gain = [
        a - b
        for a, b in zip(
            _sequence_log_probs(trained_dir, rows), _sequence_log_probs(tiny_assets.sql_model_dir, rows), strict=True
        )
    ]
    groups: dict[tuple, list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(index)
    margins, wrong_gain = [], []  # per question whose answers disagree: mean gain of right - of wrong answers
    for members in groups.values():
        right = [gain[i] for i in members if rewards[i] > 0]
        wrong = [gain[i] for i in members if rewards[i] == 0]
        if right and wrong:
            margins.append(sum(right) / len(right) - sum(wrong) / len(wrong))
            wrong_gain.extend(wrong)
    report = {"rewards": rewards, "gain": [round(g, 4) for g in gain], "margins": margins}
    assert margins, f"no question of the first batch had both right and wrong answers: {report}"
    # Measured (seed 1): one such question, margin 8.4 nats; its right answers were already likely
    # (gain -0.007), its wrong ones lost 8.4 nats.
    assert sum(margins) / len(margins) > 1.0, report
    assert sum(wrong_gain) / len(wrong_gain) < 0, report  # the wrong answers became less likely
