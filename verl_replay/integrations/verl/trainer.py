"""verl v1 trainers with replay: ``PPOTrainerSync`` / ``PPOTrainerSeparateAsync`` plus hooks.

The replay strategies plug into verl's step pipeline (``PPOTrainer._step_once``) by overriding
the smallest stage methods around it, never ``fit()`` or ``_step_once`` itself. With
``replay.strategy=none`` no hook changes anything and the run is verl's own GRPO.
"""

from __future__ import annotations

from omegaconf import DictConfig
from verl.trainer.ppo.v1 import PPOTrainerSeparateAsync, PPOTrainerSync

from verl_replay.config import ReplayConfig


class ReplayTrainerMixin:
    """Shared replay wiring for verl's v1 trainers (must precede the verl base in the MRO)."""

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        self.replay_config = ReplayConfig.from_mapping(config.get("replay"))


class ReplaySyncTrainer(ReplayTrainerMixin, PPOTrainerSync):
    """Synchronous colocated trainer (``trainer.v1.trainer_mode=sync``) with replay."""


class ReplaySeparateAsyncTrainer(ReplayTrainerMixin, PPOTrainerSeparateAsync):
    """Split training/rollout placement (``trainer.v1.trainer_mode=separate_async``) with replay."""


_TRAINERS = {"sync": ReplaySyncTrainer, "separate_async": ReplaySeparateAsyncTrainer}


def replay_trainer_class(trainer_mode: str) -> type:
    try:
        return _TRAINERS[trainer_mode]
    except KeyError:
        raise ValueError(
            f"trainer.v1.trainer_mode={trainer_mode!r} is not supported by verl_replay; "
            f"use one of: {', '.join(_TRAINERS)}"
        ) from None

