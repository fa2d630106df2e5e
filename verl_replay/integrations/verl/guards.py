"""Settings that would let replayed or elite rows change what fresh rows train on.

Replay appends rows to verl's batch; every stage that normalises over the whole batch would then
mix them into the fresh rows' numbers. These settings are refused at start-up, in the driver before
Ray starts, with the key named; ``replay.strategy=none`` is never restricted.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

# verl 0.9.1 estimators whose advantages depend only on the rows of their own group (uid): a
# replayed group (its own uid) or an elite row (a group of one) cannot move a fresh group's values.
GROUP_LOCAL_ADVANTAGE_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo")
# What the others do with the batch, for the message.
BATCH_WIDE_ADVANTAGE_ESTIMATORS = {
    "gae": "whitens advantages over the batch (and needs critic values of replayed rows)",
    "gdpo": "whitens advantages over the batch",
    "reinforce_plus_plus": "whitens returns over the batch",
    "reinforce_plus_plus_baseline": "whitens scores over the batch",
    "remax": "needs a greedy reward baseline that replayed rows do not have",
    "gpg": "scales advantages by the batch's count of non-zero rewards",
    "optimal_token_baseline": "weights by the current policy's token statistics, which replayed rows skip",
    "tir_optimal_token_baseline": "weights by the current policy's token statistics, which replayed rows skip",
}


# verl 0.9.1's registered policy losses (``core_algos.py``, ``register_policy_loss``), read one by one.
# Supported: each token's (or each response's) loss depends only on its own row, so replayed rows
# change what fresh rows train on only as a larger batch does (the ``loss_agg_mode`` normaliser
# counts their tokens or responses, by design).
ROW_LOCAL_POLICY_LOSSES = {
    "vanilla": "PPO clip, per token",
    "dppo_tv": "per-token trust-region mask from that token's probabilities",
    "dppo_kl": "per-token trust-region mask from that token's binary KL",
    "gspo": "per-response sequence ratio",
    "sapo": "per-token soft gate",
    "gpg": "per-token -log p * A",
    "geo_mean": "per-response geometric-mean ratio (averaged over the micro-batch's rows)",
    "dro": "per-token quadratic penalty",
    "cispo": "per-token clipped, detached IS weight",
    "bypass_mode": "per-token IS weight / rejection against the rollout log-probs (set by rollout correction)",
}
# Refused while replay is on: the statistic that picks or reweights tokens spans the micro-batch.
MICRO_BATCH_WIDE_POLICY_LOSSES = {
    "clip_cov": "picks the tokens it leaves unclipped from the micro-batch-wide covariance of advantages and "
    "log-probs (centred on micro-batch means, a count proportional to the micro-batch's tokens)",
    "kl_cov": "applies its KL penalty to the top tokens by the micro-batch-wide covariance of advantages and log-probs",
}


# EliteReplay mixes its NLL term into the GRPO loss normalised by the GRPO tokens alone: losses that
# aggregate by rows whatever loss_agg_mode says would count the elite rows in their denominator.
ROW_COUNTING_POLICY_LOSSES = {
    "sapo": "always aggregates seq-mean-token-mean, over every row of the mini-batch",
    "geo_mean": "averages over every row of the micro-batch",
}
ELITE_STRATEGIES = ("elite", "elite_iid", "headroom_drift+elite")


class ReplayIncompatibleSetting(ValueError):
    """A verl setting that would leak replayed rows into the fresh stream; the message names it."""


def _get(config: DictConfig, key: str, default: Any = None) -> Any:
    value = OmegaConf.select(config, key, default=default)
    return default if value is None else value


def check_replay_compatible(config: DictConfig, strategy: str) -> None:
    """Refuse, naming the key, every setting that would average replayed rows into fresh ones."""
    if strategy == "none":
        return
    estimator = str(_get(config, "algorithm.adv_estimator", "grpo"))
    if estimator not in GROUP_LOCAL_ADVANTAGE_ESTIMATORS:
        why = BATCH_WIDE_ADVANTAGE_ESTIMATORS.get(estimator, "is not known to compute advantages per group")
        raise ReplayIncompatibleSetting(
            f"algorithm.adv_estimator={estimator} {why}, so replayed rows would change the fresh rows' advantages; "
            f"with replay.strategy={strategy} use one of: {', '.join(GROUP_LOCAL_ADVANTAGE_ESTIMATORS)}"
        )
    loss_mode = str(_get(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"))
    if loss_mode not in ROW_LOCAL_POLICY_LOSSES:
        why = MICRO_BATCH_WIDE_POLICY_LOSSES.get(
            loss_mode, "is not known to compute each row's loss from that row alone"
        )
        raise ReplayIncompatibleSetting(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} {why}, so replayed rows would change which "
            f"fresh tokens it trains on; with replay.strategy={strategy} use one of: "
            f"{', '.join(ROW_LOCAL_POLICY_LOSSES)}"
        )
    if strategy in ELITE_STRATEGIES:
        if loss_mode in ROW_COUNTING_POLICY_LOSSES:
            raise ReplayIncompatibleSetting(
                f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} {ROW_COUNTING_POLICY_LOSSES[loss_mode]}, "
                f"elite rows included, so with replay.strategy={strategy} they would dilute the GRPO term; use one of: "
                f"{', '.join(m for m in ROW_LOCAL_POLICY_LOSSES if m not in ROW_COUNTING_POLICY_LOSSES)}"
            )
        agg = str(_get(config, "actor_rollout_ref.actor.loss_agg_mode", "token-mean"))
        if agg != "token-mean":
            raise ReplayIncompatibleSetting(
                f"actor_rollout_ref.actor.loss_agg_mode={agg}: EliteReplay's mixed loss normalises the GRPO term by "
                f"its own tokens; with replay.strategy={strategy} set it to token-mean"
            )
    if bool(_get(config, "algorithm.use_kl_in_reward", False)):
        raise ReplayIncompatibleSetting(
            "algorithm.use_kl_in_reward=True: its KL controller averages over every row of the batch, replayed rows "
            f"included; with replay.strategy={strategy} use actor_rollout_ref.actor.use_kl_loss=True instead"
        )
    if bool(_get(config, "algorithm.rollout_correction.rollout_is_batch_normalize", False)):
        raise ReplayIncompatibleSetting(
            "algorithm.rollout_correction.rollout_is_batch_normalize=True normalises the IS weights over the whole "
            f"batch, replayed rows included; with replay.strategy={strategy} set it to False"
        )
