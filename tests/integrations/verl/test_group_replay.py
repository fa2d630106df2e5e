"""The group stream's per-step bookkeeping that needs no Ray: generating versions from verl's
trajectory tags, and the drift floor of one fresh group against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from verl_replay.config import ReplayConfig
from verl_replay.integrations.verl.group_replay import GroupReplayStream, generating_versions


def test_a_groups_generating_version_is_its_oldest_rows():
    keys = ["u1_0_0", "u1_1_0", "u2_0_0", "u2_1_0", "u_3_0_0"]
    tags = [
        {"min_global_steps": 3, "max_global_steps": 4},  # a response generated across a weight update
        {"min_global_steps": 2, "max_global_steps": 2},
        {"min_global_steps": None},  # untagged: the weights the step started from
        {},
        {"min_global_steps": 5},
    ]
    assert generating_versions(keys, tags, step=7) == {"u1": 2, "u2": 6, "u_3": 5}


def _rows():
    # two responses: 3 and 2 tokens, the last token of the first masked out
    return [
        {
            "old_log_probs": torch.tensor([-1.0, -2.0, -0.5]),
            "rollout_log_probs": torch.tensor([-1.1, -1.7, -9.0]),
            "response_mask": torch.tensor([1, 1, 0]),
        },
        {
            "old_log_probs": torch.tensor([-0.2, -0.3]),
            "rollout_log_probs": torch.tensor([-0.2, -0.7]),
            "response_mask": torch.tensor([1, 1]),
        },
    ]


def test_the_drift_floor_is_the_gates_statistic_over_a_fresh_group():
    diffs = [0.1, -0.3, 0.0, 0.4]  # valid tokens only: old - rollout
    hd = GroupReplayStream(ReplayConfig.from_mapping({"strategy": "headroom_drift"}), anchor_field="rollout_log_probs")
    assert hd.measure_floor
    assert hd._fresh_drift(_rows()) == pytest.approx(math.sqrt(sum(d * d for d in diffs) / 4), rel=1e-6)
    l1 = GroupReplayStream(
        ReplayConfig.from_mapping({"strategy": "headroom_drift", "drift_norm": "l1"}), anchor_field="rollout_log_probs"
    )
    assert l1._fresh_drift(_rows()) == pytest.approx(sum(abs(d) for d in diffs) / 4, rel=1e-6)


@pytest.mark.parametrize(
    "strategy, anchor, bypass",
    [
        ("headroom_drift", "old_log_probs", False),  # synchronous: the anchor is the trainer's own
        ("headroom_drift", "rollout_log_probs", True),  # bypass mode: verl copies the rollout log-probs
        ("naive", "rollout_log_probs", False),  # no gate
    ],
)
def test_the_floor_is_not_measured_where_it_means_nothing(strategy, anchor, bypass):
    stream = GroupReplayStream(
        ReplayConfig.from_mapping({"strategy": strategy}), anchor_field=anchor, measure_floor=not bypass
    )
    assert not stream.measure_floor and stream._fresh_drift(_rows()) == 0.0
