"""Settings that would let replayed or elite rows change what fresh rows train on (SPEC 1.7).

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
