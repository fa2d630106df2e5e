"""verl v1 trainers with replay: ``PPOTrainerSync`` / ``PPOTrainerSeparateAsync`` plus hooks.

The replay strategies plug into verl's step pipeline (``PPOTrainer._step_once``: sample ->
reward -> balance -> old log-probs -> ref -> advantages -> actor update) by overriding the stage
methods around it, never ``fit()`` or ``_step_once`` itself:

- ``_balance_batch``: select and inject replay rows (they are then balanced with the fresh rows);
- ``_compute_old_log_prob``: replayed rows keep their stored generation-time anchor;
- ``_compute_advantage``: replayed rows keep their stored advantages;
- ``_update_actor``: mini-batch plan for the enlarged batch, then ingress of fresh groups;
- ``_compute_metrics``: verl's data metrics over fresh rows only (replay reported under replay/);
- ``_save_checkpoint`` / ``_load_checkpoint``: replay state saved with verl's checkpoints.

With ``replay.strategy=none`` no hook changes anything and the run is verl's own GRPO.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Iterator, Optional

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import DictConfig
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import agg_loss
from verl.trainer.ppo.v1 import PPOTrainerSeparateAsync, PPOTrainerSync
from verl.utils.debug.metrics import calculate_debug_metrics

from verl_replay.config import ReplayConfig
from verl_replay.integrations.verl.actor_loss import ReplayActorLoss
from verl_replay.integrations.verl.group_replay import GroupReplayController, PolicyScorer
from verl_replay.integrations.verl.rows import (
    REPLAY_GROUP_FIELD,
    REPLAY_SOURCE_FIELD,
    SOURCE_ELITE,
    SOURCE_FRESH,
    SOURCE_GROUP_REPLAY,
    split_rows,
)
from verl_replay.minibatch import plan_mini_batches, stratified_order

logger = logging.getLogger(__name__)

REPLAY_STATE_DIR = "replay"


def is_fresh(tag: dict) -> bool:
    return not tag.get("is_padding", False) and tag.get("replay_source", SOURCE_FRESH) == SOURCE_FRESH


def prefixed(stats: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{key}": float(value) for key, value in stats.items()}


class ReplayTrainerMixin:
    """Shared replay wiring for verl's v1 trainers (must precede the verl base in the MRO)."""

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        self.replay_config = ReplayConfig.from_mapping(config.get("replay"))
        self.group_replay: Optional[GroupReplayController] = None
        if self.replay_config.uses_group_buffer:
            self.group_replay = GroupReplayController(self.replay_config, anchor_field=self._anchor_field())
        self.elite_replay = None  # built with the tokenizer, before any worker starts
        self._mini_batch_groups: Optional[int] = None
        self._padded_rows = 0

    @property
    def _replay_active(self) -> bool:
        return self.group_replay is not None or self.elite_replay is not None

    # ------------------------------------------------------------------ setup

    def _init_tokenizer(self) -> None:
        super()._init_tokenizer()
        if self.replay_config.uses_elite:
            from verl_replay.integrations.verl.elite_replay import EliteReplayController

            train_files = self.config.data.train_files
            train_files = [train_files] if isinstance(train_files, str) else list(train_files)
            self.elite_replay = EliteReplayController(
                self.replay_config,
                tokenizer=self.tokenizer,
                train_files=train_files,
                max_prompt_length=int(self.config.data.max_prompt_length),
                max_response_length=int(self.config.data.max_response_length),
                chat_template_kwargs=self.config.data.get("apply_chat_template_kwargs", None),
            )

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        if not self.replay_config.uses_elite:
            return
        # The actor must count each mini-batch's elite rows (the NLL term's denominator).
        import ray
        from verl.trainer.ppo.utils import Role

        from verl_replay.integrations.verl.workers import ReplayActorRolloutRefWorker, ReplayDetachActorWorker

        worker_cls = ReplayActorRolloutRefWorker if self.trainer_mode == "sync" else ReplayDetachActorWorker
        for role in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef):
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(worker_cls)

    def _setup(self) -> None:
        super()._setup()
        if self.replay_config.uses_elite or self.replay_config.audit_dir:
            self.actor_rollout_wg.set_loss_fn(self._build_actor_loss())

    def _build_actor_loss(self) -> ReplayActorLoss:
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        from verl.trainer.distillation import is_distillation_enabled

        if is_distillation_enabled(self.config.get("distillation")):
            raise ValueError("verl_replay's actor loss does not compose with on-policy distillation")
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        actor_config.model_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.model, dataclass_type=HFModelConfig)
        return ReplayActorLoss(
            actor_config,
            elite=self.replay_config.uses_elite,
            mu=self.replay_config.elite.mu,
            audit_dir=self.replay_config.audit_dir,
        )

    # ------------------------------------------------------------------ helpers

    def _anchor_field(self) -> str:
        """l_gen: the trainer's old log-probs in sync mode, the rollout engine's otherwise (SPEC 1.4)."""
        if self.trainer_mode == "sync":
            return "old_log_probs"
        if not self.config.actor_rollout_ref.rollout.calculate_log_probs:
            raise ValueError(
                f"replay.strategy={self.replay_config.strategy} in trainer_mode={self.trainer_mode} anchors replayed "
                "groups to the rollout engine's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=True"
            )
        return "rollout_log_probs"

    def _actor_dp_size(self) -> int:
        worker_group = self.actor_rollout_wg
        if "actor" not in worker_group._dispatch_info:
            worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
        return max(worker_group._dispatch_info["actor"]) + 1

    def _micro_batch_rows(self, dp_size: int, *, training: bool) -> int:
        """Rows a batch must divide into: every data-parallel rank cuts its share into whole
        micro-batches (verl asserts it) unless dynamic batch sizes are on."""
        arr = self.config.actor_rollout_ref
        sizes = []
        if training and not arr.actor.use_dynamic_bsz:
            sizes.append(arr.actor.get("ppo_micro_batch_size_per_gpu") or 1)
        if not arr.rollout.get("log_prob_use_dynamic_bsz", False):
            sizes.append(arr.rollout.get("log_prob_micro_batch_size_per_gpu") or 1)
        if training and self.use_reference_policy and not arr.ref.get("log_prob_use_dynamic_bsz", False):
            sizes.append(arr.ref.get("log_prob_micro_batch_size_per_gpu") or 1)
        return dp_size * math.lcm(*[int(size) for size in sizes]) if sizes else dp_size

    def _rollout_correction_on(self) -> bool:
        corr = self.config.algorithm.get("rollout_correction", None)
        return corr is not None and not corr.get("bypass_mode", False) and bool(
            self.config.actor_rollout_ref.rollout.calculate_log_probs
        )

    @contextlib.contextmanager
    def _planned_mini_batch_size(self) -> Iterator[None]:
        """Use this update's mini-batch plan wherever verl reads ``ppo_mini_batch_size``."""
        if self._mini_batch_groups is None:
            yield
            return
        actor = self.config.actor_rollout_ref.actor
        configured = actor.ppo_mini_batch_size
        actor.ppo_mini_batch_size = self._mini_batch_groups
        try:
            yield
        finally:
            actor.ppo_mini_batch_size = configured

    # ------------------------------------------------------------------ injection + balancing

    def _balance_batch(self, batch: KVBatchMeta, metrics: dict, logging_prefix: str = "global_seqlen", keep_minibatch: bool = False):
        self._mini_batch_groups = None
        if not self._replay_active or logging_prefix != "global_seqlen":
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        batch = self._canonical_order(batch)
        fresh_keys = [key for key, tag in zip(batch.keys, batch.tags) if is_fresh(tag)]
        fresh_groups = len({key.rsplit("_", 2)[0] for key in fresh_keys})
        self._mark_fresh_rows(batch)
        dp_size = self._actor_dp_size()
        replay_groups = 0
        if self.group_replay is not None:
            scorer = PolicyScorer(
                compute_log_prob=self.actor_rollout_wg.compute_log_prob,
                row_multiple=self._micro_batch_rows(dp_size, training=False),
                temperature=self.config.actor_rollout_ref.rollout.temperature,
            )
            batch, stats = self.group_replay.inject(batch, scorer, step=self.global_steps)
            metrics.update(prefixed(stats, "replay/"))
            replay_groups = int(stats.get("accepted", 0))
        elite_rows = 0
        if self.elite_replay is not None and fresh_keys:
            template = split_rows(tq.kv_batch_get(keys=fresh_keys[:1], partition_id=batch.partition_id), 1)[0]
            batch, stats = self.elite_replay.inject(batch, template, step=self.global_steps)
            metrics.update(prefixed(stats, "replay/elite/"))
            elite_rows = int(stats["examples"])
        # Replayed groups add optimiser steps like a larger GRPO batch; elite rows join the existing
        # steps (EliteReplay mixes its NLL term into each update at a fixed weight).
        plan = plan_mini_batches(
            num_groups=fresh_groups + replay_groups,
            configured_groups=int(self.config.actor_rollout_ref.actor.ppo_mini_batch_size),
            rows_per_group=int(self.config.actor_rollout_ref.rollout.n),
            row_multiple=self._micro_batch_rows(dp_size, training=True),
            extra_rows=elite_rows,
        )
        self._mini_batch_groups = plan.groups_per_mini_batch
        self._padded_rows = plan.padded_groups * plan.rows_per_group
        metrics["replay/mini_batches"] = float(plan.num_mini_batches)
        self._token_share_metrics(batch, metrics)
        with self._planned_mini_batch_size():
            batch = super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        return self._spread_sources_over_mini_batches(batch, dp_size, plan.num_mini_batches)

    @staticmethod
    def _spread_sources_over_mini_batches(batch: KVBatchMeta, dp_size: int, num_mini_batches: int) -> KVBatchMeta:
        """Within each data-parallel rank's share (verl's balanced partition, kept as is), order the
        rows so every mini-batch gets its share of fresh, replayed, elite and padding rows."""
        per_rank = len(batch.keys) // dp_size
        order: list[int] = []
        for rank in range(dp_size):
            start = rank * per_rank
            categories = [
                3 if tag.get("is_padding", False) else int(tag.get("replay_source", SOURCE_FRESH))
                for tag in batch.tags[start : start + per_rank]
            ]
            order.extend(start + i for i in stratified_order(categories, num_mini_batches))
        batch.reorder(order)
        return batch

    def _get_required_batch_multiple(self, dp_size: int) -> int:
        # verl pads to a multiple of this: the plan's total (>= the real rows, < twice them) makes it
        # pad to exactly the planned number of mini-batches.
        if self._mini_batch_groups is not None:
            return self._padded_rows
        return super()._get_required_batch_multiple(dp_size)

    @staticmethod
    def _token_share_metrics(batch: KVBatchMeta, metrics: dict) -> None:
        """Share of the update's response tokens from each replay stream."""
        tokens = {SOURCE_FRESH: 0, SOURCE_GROUP_REPLAY: 0, SOURCE_ELITE: 0}
        for tag in batch.tags:
            if not tag.get("is_padding", False):
                tokens[tag.get("replay_source", SOURCE_FRESH)] += int(tag.get("response_len", 0))
        total = sum(tokens.values()) or 1
        metrics["replay/token_share"] = tokens[SOURCE_GROUP_REPLAY] / total
        metrics["replay/elite/token_share"] = tokens[SOURCE_ELITE] / total

    @staticmethod
    def _canonical_order(batch: KVBatchMeta) -> KVBatchMeta:
        """Fresh rows in an order set by their tokens, not by rollout completion order.

        TransferQueue hands rows over as they finish, so verl's balancing (and with it the
        micro-batches and the float summation order of the gradient) would change from run to run;
        replay decisions sit on thresholds (the drift gate), so a resumed run could then decide
        differently from the straight one.
        """
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"])
        prompts, responses = data["prompts"].unbind(0), data["responses"].unbind(0)
        order = sorted(range(len(batch.keys)), key=lambda i: (prompts[i].tolist(), responses[i].tolist(), i))
        batch.reorder(order)
        return batch

    def _mark_fresh_rows(self, batch: KVBatchMeta) -> None:
        """Every row of an update carries ``replay_source`` (0 fresh, 1 group replay, 2 elite)."""
        keys = list(batch.keys)
        fields = {
            REPLAY_SOURCE_FIELD: torch.full((len(keys),), SOURCE_FRESH, dtype=torch.int64),
            REPLAY_GROUP_FIELD: torch.full((len(keys),), -1, dtype=torch.int64),
        }
        tq.kv_batch_put(keys=keys, partition_id=batch.partition_id, fields=TensorDict(fields, batch_size=len(keys)))

    # ------------------------------------------------------------------ stored anchor / advantages

    def _compute_old_log_prob(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        batch = super()._compute_old_log_prob(batch, metrics)
        if not self._replay_active:
            return batch
        if any(not is_fresh(tag) and not tag.get("is_padding", False) for tag in batch.tags):
            self._fresh_log_prob_metrics(batch, metrics)
        if self.group_replay is not None:
            self.group_replay.restore_anchor(batch.partition_id, rollout_correction=self._rollout_correction_on())
        if self.elite_replay is not None and self.config.actor_rollout_ref.rollout.calculate_log_probs:
            self.elite_replay.neutralise_rollout_correction(batch.partition_id)
        return batch

    def _fresh_log_prob_metrics(self, batch: KVBatchMeta, metrics: dict) -> None:
        """verl's entropy and rollout-vs-actor diagnostics, recomputed over fresh rows only."""
        keys = [key for key, tag in zip(batch.keys, batch.tags) if is_fresh(tag)]
        if not keys:
            return
        fields = ["entropy", "old_log_probs", "response_mask", "responses"]
        calculate_log_probs = bool(self.config.actor_rollout_ref.rollout.calculate_log_probs)
        if calculate_log_probs:
            fields.append("rollout_log_probs")
        data = DataProto(batch=tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields).to_padded_tensor())
        actor_config = self.config.actor_rollout_ref.actor
        metrics["actor/entropy"] = agg_loss(
            loss_mat=data.batch["entropy"],
            loss_mask=data.batch["response_mask"],
            loss_agg_mode=actor_config.loss_agg_mode,
            loss_scale_factor=actor_config.loss_scale_factor,
        ).item()
        if calculate_log_probs:
            metrics.update(calculate_debug_metrics(data))

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        batch = super()._compute_advantage(batch, metrics)
        if self.group_replay is not None:
            self.group_replay.restore_advantages(batch.partition_id)
        if self.elite_replay is not None:
            self.elite_replay.zero_advantages(batch.partition_id)
        return batch

    # ------------------------------------------------------------------ update + ingress

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        with self._planned_mini_batch_size():
            batch = super()._update_actor(batch, metrics)
        # The loss reports its replay terms; verl prefixes every loss metric with actor/.
        for key in [k for k in metrics if k.startswith("actor/replay/")]:
            metrics[key[len("actor/"):]] = metrics.pop(key)
        if self.group_replay is not None:
            metrics.update(prefixed(self.group_replay.admit(batch, step=self.global_steps), "replay/"))
        if self.elite_replay is not None:
            self.elite_replay.end_update()
        return batch

    # ------------------------------------------------------------------ metrics

    def _compute_metrics(self, batch: KVBatchMeta, metrics, timing_raw, global_steps, epoch):
        if not self._replay_active:
            return super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        keep = [i for i, tag in enumerate(batch.tags) if tag.get("replay_source", SOURCE_FRESH) == SOURCE_FRESH]
        fresh = KVBatchMeta(
            keys=[batch.keys[i] for i in keep],
            tags=[batch.tags[i] for i in keep],
            partition_id=batch.partition_id,
            extra_info=batch.extra_info,
        )
        self._replay_score_metrics(batch, metrics)
        return super()._compute_metrics(fresh, metrics, timing_raw, global_steps, epoch)

    def _replay_score_metrics(self, batch: KVBatchMeta, metrics: dict) -> None:
        """Scores of the replayed rows as generated (they are kept out of critic/score)."""
        keys = [key for key, tag in zip(batch.keys, batch.tags) if tag.get("replay_source", 0) == SOURCE_GROUP_REPLAY]
        if not keys:
            return
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["rm_scores"])
        scores = np.array([float(row.sum()) for row in data["rm_scores"].unbind(0)])
        metrics["replay/score/mean"] = float(scores.mean())

    # ------------------------------------------------------------------ checkpoints

    def _replay_state_folder(self, global_step_folder: str) -> str:
        return os.path.join(global_step_folder, REPLAY_STATE_DIR)

    def _save_checkpoint(self) -> None:
        # Written before verl's own save, whose last act marks the checkpoint as the latest one:
        # a checkpoint is never "latest" without its replay state.
        folder = self._replay_state_folder(
            os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        )
        if self.group_replay is not None:
            self.group_replay.save(folder)
        if self.elite_replay is not None:
            self.elite_replay.save(folder)
        super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if not self._replay_active:
            return
        if self.global_steps <= 0:
            if self.group_replay is not None:
                self.group_replay.open_event_log(resume_from_step=0)
            return
        if self.config.trainer.resume_mode == "resume_path":
            folder = self.config.trainer.resume_from_path
        else:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
        folder = self._replay_state_folder(folder)
        if self.group_replay is not None:
            self.group_replay.load(folder, step=self.global_steps)
        if self.elite_replay is not None:
            self.elite_replay.load(folder)


class ReplaySyncTrainer(ReplayTrainerMixin, PPOTrainerSync):
    """Synchronous colocated trainer (``trainer.v1.trainer_mode=sync``) with replay."""


class ReplaySeparateAsyncTrainer(ReplayTrainerMixin, PPOTrainerSeparateAsync):
    """Split training/rollout placement (``trainer.v1.trainer_mode=separate_async``) with replay."""


_TRAINERS: dict[str, type] = {"sync": ReplaySyncTrainer, "separate_async": ReplaySeparateAsyncTrainer}


def replay_trainer_class(trainer_mode: str) -> type:
    try:
        return _TRAINERS[trainer_mode]
    except KeyError:
        raise ValueError(
            f"trainer.v1.trainer_mode={trainer_mode!r} is not supported by verl_replay; "
            f"use one of: {', '.join(_TRAINERS)}"
        ) from None
