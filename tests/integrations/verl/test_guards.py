"""Settings that would let replay change the fresh stream are refused before Ray starts."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl_replay.integrations.verl.guards import (
    BATCH_WIDE_ADVANTAGE_ESTIMATORS,
    GROUP_LOCAL_ADVANTAGE_ESTIMATORS,
    ReplayIncompatibleSetting,
    check_replay_compatible,
)


def config(**algorithm):
    base = {
        "adv_estimator": "grpo",
        "use_kl_in_reward": False,
        "rollout_correction": {"rollout_is_batch_normalize": False},
    }
    return OmegaConf.create({"algorithm": {**base, **algorithm}})


@pytest.mark.parametrize("estimator", sorted(BATCH_WIDE_ADVANTAGE_ESTIMATORS) + ["my_custom_estimator"])
def test_batch_wide_advantage_estimators_are_refused(estimator):
    with pytest.raises(ReplayIncompatibleSetting, match=f"algorithm.adv_estimator={estimator}"):
        check_replay_compatible(config(adv_estimator=estimator), "headroom_drift")


@pytest.mark.parametrize("estimator", GROUP_LOCAL_ADVANTAGE_ESTIMATORS)
def test_group_local_estimators_are_allowed(estimator):
    check_replay_compatible(config(adv_estimator=estimator), "elite")


def test_kl_in_reward_and_is_batch_normalisation_are_refused():
    with pytest.raises(ReplayIncompatibleSetting, match="algorithm.use_kl_in_reward=True.*use_kl_loss"):
        check_replay_compatible(config(use_kl_in_reward=True), "naive")
    with pytest.raises(ReplayIncompatibleSetting, match="rollout_is_batch_normalize=True"):
        check_replay_compatible(config(rollout_correction={"rollout_is_batch_normalize": True}), "headroom_drift+elite")


def test_no_replay_no_restriction():
    check_replay_compatible(config(adv_estimator="gae", use_kl_in_reward=True), "none")


def test_every_verl_estimator_is_classified():
    """A verl upgrade that adds an estimator must be looked at: group-local or not."""
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    known = set(GROUP_LOCAL_ADVANTAGE_ESTIMATORS) | set(BATCH_WIDE_ADVANTAGE_ESTIMATORS)
    assert {e.value for e in AdvantageEstimator} <= known


def test_batch_whitening_really_moves_fresh_advantages():
    """Why reinforce_plus_plus is refused: the same fresh rows get other advantages once rows are added."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import (
        compute_grpo_outcome_advantage,
        compute_reinforce_plus_plus_outcome_advantage,
    )

    mask = torch.ones(4, 3)
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    index = np.array(["a", "a", "b", "b"], dtype=object)
    more_rewards = torch.cat([rewards, torch.tensor([[0, 0, 1.0]] * 2)])
    more_index = np.concatenate([index, np.array(["r", "r"], dtype=object)])
    from types import SimpleNamespace

    algo = SimpleNamespace(gamma=1.0)
    fresh, _ = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=algo)
    mixed, _ = compute_reinforce_plus_plus_outcome_advantage(more_rewards, torch.ones(6, 3), config=algo)
    assert not torch.allclose(fresh, mixed[:4])
    fresh, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    mixed, _ = compute_grpo_outcome_advantage(more_rewards, torch.ones(6, 3), more_index)
    torch.testing.assert_close(fresh, mixed[:4], rtol=0, atol=0)
