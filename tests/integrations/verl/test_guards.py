"""Settings that would let replay change the fresh stream are refused before Ray starts."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from verl_replay.integrations.verl.guards import (
    BATCH_WIDE_ADVANTAGE_ESTIMATORS,
    GROUP_LOCAL_ADVANTAGE_ESTIMATORS,
    MICRO_BATCH_WIDE_POLICY_LOSSES,
    ROW_COUNTING_POLICY_LOSSES,
    ROW_LOCAL_POLICY_LOSSES,
    ReplayIncompatibleSetting,
    check_replay_compatible,
)


def config(loss_mode: str = "vanilla", loss_agg_mode: str = "token-mean", **algorithm):
    base = {
        "adv_estimator": "grpo",
        "use_kl_in_reward": False,
        "rollout_correction": {"rollout_is_batch_normalize": False},
    }
    actor = {"policy_loss": {"loss_mode": loss_mode}, "loss_agg_mode": loss_agg_mode}
    return OmegaConf.create({"algorithm": {**base, **algorithm}, "actor_rollout_ref": {"actor": actor}})


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


# ---------------------------------------------------------------------------- policy losses


@pytest.mark.parametrize("loss_mode", sorted(MICRO_BATCH_WIDE_POLICY_LOSSES) + ["my_custom_loss"])
@pytest.mark.parametrize("strategy", ["headroom_drift", "naive", "elite", "headroom_drift+elite"])
def test_micro_batch_wide_policy_losses_are_refused(loss_mode, strategy):
    with pytest.raises(ReplayIncompatibleSetting, match=f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} "):
        check_replay_compatible(config(loss_mode=loss_mode), strategy)
    check_replay_compatible(config(loss_mode=loss_mode), "none")


@pytest.mark.parametrize("loss_mode", sorted(ROW_LOCAL_POLICY_LOSSES))
def test_row_local_policy_losses_are_allowed(loss_mode):
    check_replay_compatible(config(loss_mode=loss_mode), "headroom_drift")
    if loss_mode in ROW_COUNTING_POLICY_LOSSES:  # they count elite rows in their denominator
        with pytest.raises(ReplayIncompatibleSetting, match=f"loss_mode={loss_mode} .*elite rows"):
            check_replay_compatible(config(loss_mode=loss_mode), "headroom_drift+elite")
    else:
        check_replay_compatible(config(loss_mode=loss_mode), "elite")


def test_elite_needs_token_mean_before_ray_starts():
    with pytest.raises(ReplayIncompatibleSetting, match="actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum"):
        check_replay_compatible(config(loss_agg_mode="seq-mean-token-sum"), "elite_iid")
    check_replay_compatible(config(loss_agg_mode="seq-mean-token-sum"), "headroom_drift")


def test_every_registered_policy_loss_is_classified():
    """A verl upgrade that registers a loss must be looked at: row-local or not."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    assert set(POLICY_LOSS_REGISTRY) == set(ROW_LOCAL_POLICY_LOSSES) | set(MICRO_BATCH_WIDE_POLICY_LOSSES)
    assert not set(ROW_LOCAL_POLICY_LOSSES) & set(MICRO_BATCH_WIDE_POLICY_LOSSES)


def _rows(seed: int, count: int, *, advantage=None, log_prob_shift: float = 0.0):
    """[count, 5] old / current log-probs, advantages and a response mask (first row shorter)."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(count, 5, generator=generator) * 2 + log_prob_shift
    current = old + 0.1 * torch.randn(count, 5, generator=generator)
    adv = torch.randn(count, 1, generator=generator) if advantage is None else torch.full((count, 1), advantage)
    mask = torch.ones(count, 5)
    mask[0, -2:] = 0
    return old, current, adv.expand(count, 5).clone(), mask


def _fresh_row_gradient(loss_mode: str, parts) -> torch.Tensor:
    """The gradient of verl's own policy loss with respect to the first part's log-probs."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    actor = FSDPActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        policy_loss=PolicyLossConfig(
            loss_mode=loss_mode, clip_cov_ratio=0.5, clip_cov_ub=40.0, kl_cov_ratio=0.25, dro_beta=0.1
        ),
    )
    old, current, adv, mask = (torch.cat(tensors) for tensors in zip(*parts, strict=True))
    current = current.requires_grad_(True)
    torch.manual_seed(0)  # clip_cov draws the tokens it clips
    loss, _ = get_policy_loss_fn(loss_mode)(old, current, adv, mask, loss_agg_mode="token-sum", config=actor)
    loss.backward()
    return current.grad[: parts[0][0].shape[0]]


@pytest.mark.parametrize("loss_mode", sorted(ROW_LOCAL_POLICY_LOSSES) + sorted(MICRO_BATCH_WIDE_POLICY_LOSSES))
def test_the_classification_is_what_verls_losses_do(loss_mode):
    """Appending replayed rows (other advantages, far lower log-probs) to a micro-batch: a row-local loss
    gives the fresh rows the same gradient up to one batch-size factor; clip_cov and kl_cov change which
    fresh tokens they clip or penalise, so the fresh rows' gradient changes direction."""
    import torch

    fresh = _rows(1, 6)
    replayed = _rows(2, 4, advantage=-4.0, log_prob_shift=-8.0)
    alone = _fresh_row_gradient(loss_mode, [fresh]).flatten()
    mixed = _fresh_row_gradient(loss_mode, [fresh, replayed]).flatten()
    scale = float(mixed @ alone / (alone @ alone))
    proportional = torch.allclose(mixed, scale * alone, rtol=1e-5, atol=1e-7)
    assert proportional == (loss_mode in ROW_LOCAL_POLICY_LOSSES), (loss_mode, scale)
