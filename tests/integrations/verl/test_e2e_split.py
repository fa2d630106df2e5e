"""Replay on the headline recipes' path, scaled down: verl's ``separate_async`` trainer on CPU.

One training worker and one rollout worker (the hf rollout server), weights pushed over the
``cpu_gloo`` engine once per global step, 2 update rounds per global step. What is checked comes
from outside the replay code where it can: the event log against the metrics, the rows the real
update trained on (``replay.audit_dir``) against what verl itself put in the batch when those
tokens were fresh, verl's own rollout dump against ``critic/score`` (``split_checks``).
Headroom-Drift alone is checked the same way on the recipe itself (``TINY=1 bash
recipes/headroom_drift_math.sh``, tests/recipes/test_recipes.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from replay_audit import ELITE, read_audit
from split_checks import SPLIT_OVERRIDES as SPLIT
from split_checks import check_group_replay_run

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 240

pytestmark = pytest.mark.e2e


def test_naive_replay_on_the_split_placement(run_main, tmp_path):
    audit, dump = tmp_path / "audit", tmp_path / "rollouts"
    run = run_main(
        *SPLIT, "replay.strategy=naive", "replay.k_rep=2", "trainer.total_training_steps=3",
        f"replay.audit_dir={audit}", f"trainer.rollout_data_dir={dump}", experiment="naive_split",
    )
    check_group_replay_run(run.run_dir, run.metrics, audit, dump, steps=3, rollout_correction=False)


def test_headroom_drift_and_elite_on_the_split_placement(run_main, tiny_archive, tmp_path):
    audit, dump = tmp_path / "audit", tmp_path / "rollouts"
    run = run_main(
        *SPLIT, "tiny_task=sql", "replay.strategy=headroom_drift+elite", f"replay.elite.archive={tiny_archive}",
        "replay.elite.batch_size=4", "replay.k_rep=2", "replay.tau=1.0", "trainer.total_training_steps=3",
        f"replay.audit_dir={audit}", f"trainer.rollout_data_dir={dump}",
        "algorithm.rollout_correction.rollout_is=token", experiment="combined_split",
    )
    check_group_replay_run(run.run_dir, run.metrics, audit, dump, steps=3)
    for m in run.metrics:  # elite rows per global step, spread over its rounds, joining its optimiser steps
        assert m["replay/elite/examples"] == 4 and math.isfinite(m["replay/elite/nll"])
    elite = [row for row in read_audit(audit) if row.source == ELITE]
    assert len(elite) == 4 * 3
    for row in elite:
        assert torch.all(row.advantage == 0) and row.is_weights is not None and torch.all(row.is_weights == 1.0)

