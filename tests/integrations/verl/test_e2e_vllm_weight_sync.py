"""verl's weight push into vLLM, proven from outside: after each global step's push the rollout engine
scores its sequences as the trainer's weights of that step do, and not as the step before's.

The run: GRPO on the split placement (verl's ``separate_async`` trainer, 2 update rounds per global
step, verl's vLLM server on vLLM's CPU build, the trainer's weights pushed every global step through
the CPU weight-sync engine), a learning rate that moves the
weights well past the engine's bf16 floor per step, and the update audit (``replay.audit_dir``),
which records the weights every optimiser step was taken at. Independent source: a plain
transformers forward (fp32) of each recorded weight version over the tokens vLLM sampled; vLLM's
own log-probs of those tokens (``rollout_log_probs``, what verl stores as the anchor) must match one
version within the engine floor, and that version must be far from its predecessor.

The control: the same run with a checkpoint engine that receives every push after the first and
drops it (``muted_push``): the engine then keeps the first weights, the rows of later steps match no
recent version, and the same checks fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from independent_checks import read_gradient_records, rows_log_probs, tiny_model
from replay_audit import FRESH, AuditedRow, read_audit
from split_checks import SPLIT_OVERRIDES

pytestmark = pytest.mark.e2e

# Mean |vLLM bf16 log-prob - transformers fp32 log-prob| per token of a row, at the weights vLLM
# holds: measured 0.005-0.007 on the tiny model (docs/cpu_stack.md); a row far above it was sampled
# from other weights.
ENGINE_FLOOR = 0.03
# The weights of the step before must be this many times further off than the matching version.
STALE_FACTOR = 3.0
STEPS = 4
LEARNING_RATE = 3e-3  # the tiny model moves ~0.1 nat per token per step: 20x the engine floor
MUTED_PUSH_DIR = str(Path(__file__).parent)  # muted_push.py, imported by the Ray workers


def _run(run_main, tmp_path: Path, *extra: str, experiment: str):
    audit = tmp_path / f"audit_{experiment}"
    run_main(
        *SPLIT_OVERRIDES,
        "replay.strategy=none",
        f"trainer.total_training_steps={STEPS}",
        f"actor_rollout_ref.actor.optim.lr={LEARNING_RATE}",
        f"replay.audit_dir={audit}",
        *extra,
        experiment=experiment,
    )
    return audit


def weight_versions(audit: Path) -> list[dict[str, torch.Tensor]]:
    """The trainer's weights after each global step, from the weights each optimiser step was taken
    at: version v = before the first optimiser step of global step v + 1 (v = 0: the base model)."""
    first_of_step: dict[int, dict[str, torch.Tensor]] = {}
    for record in read_gradient_records(audit):
        first_of_step.setdefault(int(record["replay_global_step"]), record["weights"])
    steps = sorted(first_of_step)
    assert steps == list(range(1, len(steps) + 1)), steps
    return [first_of_step[step] for step in steps]


def version_distances(audit: Path, model_dir: Path) -> tuple[list[AuditedRow], torch.Tensor]:
    """Fresh rows of the run and, per row, the mean |vLLM - fp32| per token under each recorded
    weight version: ``[rows, versions]``, version v = the weights after v optimiser steps."""
    rows = [row for row in read_audit(audit) if row.source == FRESH and row.rollout_log_probs is not None]
    assert rows, "no fresh row recorded vLLM's log-probs (rollout.calculate_log_probs)"
    pairs = [row.tokens for row in rows]
    versions = weight_versions(audit)
    distances = torch.empty(len(rows), len(versions))  # [R, V]
    with torch.no_grad():
        for v, weights in enumerate(versions):
            model = tiny_model(model_dir, weights, torch.float32)
            for r, (row, ours) in enumerate(zip(rows, rows_log_probs(model, pairs), strict=True)):
                distances[r, v] = (row.rollout_log_probs.float() - ours).abs().mean()
    return rows, distances


def check_pushes_reach_the_engine(rows: list[AuditedRow], distances: torch.Tensor) -> list[int]:
    """Each row matches one weight version within the floor, clearly apart from the version before
    it; the versions the engine sampled from advance with the global steps. Returns the matched
    version per row."""
    matched = distances.argmin(dim=1)  # [R]
    for r, row in enumerate(rows):
        v = int(matched[r])
        best = float(distances[r, v])
        assert best < ENGINE_FLOOR, (
            f"row of step {row.global_step}: no weight version within the floor ({best:.4f}); "
            f"distances {[round(float(d), 4) for d in distances[r]]}, vLLM's log-probs {row.rollout_log_probs.tolist()}"
        )
        if v > 0:
            stale = float(distances[r, v - 1])
            assert stale > STALE_FACTOR * best, (
                f"row of step {row.global_step}: version {v} ({best:.4f}) not apart from version {v - 1} ({stale:.4f})"
            )
        # rolled out before its own update, with weights at most one push old (separate_async)
        assert row.global_step - 2 <= v <= row.global_step - 1, (row.global_step, v)
    last_step = max(row.global_step for row in rows)
    assert max(int(v) for v in matched) >= last_step - 2 >= 1, "the engine never sampled from pushed weights"
    return [int(v) for v in matched]


def test_each_push_reaches_vllm(run_main, tiny_assets, tmp_path):
    audit = _run(run_main, tmp_path, experiment="weight_sync")
    rows, distances = version_distances(audit, tiny_assets.model_dir)
    matched = check_pushes_reach_the_engine(rows, distances)
    assert sorted(set(matched))[-1] >= 2


def test_a_push_that_does_nothing_fails_the_check(run_main, tiny_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [MUTED_PUSH_DIR, os.environ.get("PYTHONPATH")])))
    audit = _run(
        run_main,
        tmp_path,
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo_muted",
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=muted_push",
        experiment="muted",
    )
    rows, distances = version_distances(audit, tiny_assets.model_dir)
    with pytest.raises(AssertionError):
        check_pushes_reach_the_engine(rows, distances)
    # and why: every row was sampled from the first push's weights (the base model, version 0)
    assert set(distances.argmin(dim=1).tolist()) == {0}
