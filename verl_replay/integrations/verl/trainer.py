"""verl v1 trainers with replay: ``PPOTrainerSync`` / ``PPOTrainerSeparateAsync`` plus hooks.

The replay streams (``streams.py``: group replay, elite replay) plug into verl's step without
copying ``fit()`` or ``_step_once``. A global step (one weight version; ``parameter_sync_step``
update rounds under ``separate_async``, one round in ``sync``) is the replay step:

- ``step`` (wraps verl's): after the last round, each stream's ``end_step`` (ingress) and the
  step's ``replay/`` metrics, added after verl's per-round metrics aggregation so counts and
  seconds are totals for the global step, not averages over rounds;
- ``_balance_batch``: in the first round each stream's ``begin_step`` (selection under the weights
  at the start of the global step); in every round the round's replay rows are injected and the
  round's mini-batch plan is made, then verl balances fresh and replay rows together;
- ``_compute_old_log_prob`` / ``_compute_advantage``: replayed rows get back their stored anchor
  and advantages (elite rows: IS weight 1, advantage 0);
- ``_update_actor``: the round's update with its mini-batch plan;
- ``_compute_metrics``: verl's data metrics over fresh rows only;
- ``_save_checkpoint`` / ``_load_checkpoint``: replay state saved with verl's checkpoints. verl's
  ``fit`` saves before it computes and logs the step's metrics; a run killed in between would
  resume after a step whose metrics line was never written. The save is therefore held until
  verl's logger has written the step's line (``_hold_checkpoints_until_logged``): a checkpoint is
  never marked latest before its step's metrics are on disk.

With ``replay.strategy=none`` no hook changes anything and the run is verl's own GRPO.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

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
from verl_replay.eval.sampling import sampled_validation_due, sampling_is_plain
from verl_replay.integrations.verl.actor_loss import AUDIT_ROUND_FIELD, AUDIT_STEP_FIELD, ReplayActorLoss
from verl_replay.integrations.verl.console import DriftFloorWatch
from verl_replay.integrations.verl.exact_eval import ExactAnswerEval, exact_questions, stop_token_ids
from verl_replay.integrations.verl.group_replay import GroupReplayStream, PolicyScorer
from verl_replay.integrations.verl.replay_state import STATE_DIR
from verl_replay.integrations.verl.rows import (
    REPLAY_GROUP_FIELD,
    REPLAY_SOURCE_FIELD,
    SOURCE_ELITE,
    SOURCE_FRESH,
    SOURCE_GROUP_REPLAY,
    is_fresh,
    rollout_counts,
    split_rows,
    tensor_bytes,
)
from verl_replay.integrations.verl.streams import ReplayStream, StepContext
from verl_replay.minibatch import plan_mini_batches, stratified_order

logger = logging.getLogger(__name__)

REPLAY_STATE_DIR = STATE_DIR  # replay_state.STATE_DIR, where the driver looks before Ray starts
# Metrics the actor loss reports (verl prefixes every loss metric with actor/).
LOSS_METRIC_PREFIX = "actor/replay/"


def prefixed(stats: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{key}": float(value) for key, value in stats.items()}


@dataclass
class _StepTotals:
    """What the rounds of one global step add up to."""

    optimizer_steps: int = 0
    tokens: dict[int, int] = field(default_factory=lambda: {SOURCE_FRESH: 0, SOURCE_GROUP_REPLAY: 0, SOURCE_ELITE: 0})
    replay_seconds: float = 0.0  # in replay's own code (the scan forward included)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.replay_seconds += time.perf_counter() - start

    def mark(self) -> tuple[float, int, dict[int, int]]:
        return self.replay_seconds, self.optimizer_steps, dict(self.tokens)

    def since(self, mark: tuple[float, int, dict[int, int]]) -> dict[str, float]:
        """What was added after ``mark`` (one round's share, for the event log's round record)."""
        seconds, steps, tokens = mark
        return {
            "optimizer_steps": float(self.optimizer_steps - steps),
            "tokens_fresh": float(self.tokens[SOURCE_FRESH] - tokens[SOURCE_FRESH]),
            "tokens_group_replay": float(self.tokens[SOURCE_GROUP_REPLAY] - tokens[SOURCE_GROUP_REPLAY]),
            "tokens_elite": float(self.tokens[SOURCE_ELITE] - tokens[SOURCE_ELITE]),
            "replay_seconds": self.replay_seconds - seconds,
        }

    def metrics(self, scan_forward_seconds: float, end_step_seconds: float) -> dict[str, float]:
        total = sum(self.tokens.values()) or 1
        return {
            "replay/optimizer_steps": float(self.optimizer_steps),
            "replay/token_share": self.tokens[SOURCE_GROUP_REPLAY] / total,
            "replay/elite/token_share": self.tokens[SOURCE_ELITE] / total,
            # replay's cost beyond the one forward it needs (the scan): bookkeeping, TransferQueue
            "replay/overhead_seconds": max(0.0, self.replay_seconds - scan_forward_seconds),
            # of which after the last round: ingress (and the elite stream's step end)
            "replay/end_step_seconds": end_step_seconds,
        }


class ReplayTrainerMixin:
    """Shared replay wiring for verl's v1 trainers (must precede the verl base in the MRO)."""

    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        self.replay_config = ReplayConfig.from_mapping(config.get("replay"))
        self.group_replay: Optional[GroupReplayStream] = None
        if self.replay_config.uses_group_buffer:
            self.group_replay = GroupReplayStream(
                self.replay_config, anchor_field=self._anchor_field(), measure_floor=not self._bypass_mode()
            )
        self.elite_replay = None  # built with the tokenizer, before any worker starts
        self._mini_batch_groups: Optional[int] = None
        self._padded_rows = 0
        self._planned_padding = 0  # padding rows the mini-batch plans of this step's rounds asked for
        self._totals = _StepTotals()
        self._row_template: Optional[dict[str, Any]] = None  # a fresh row of this global step
        self._held_checkpoint: Optional[int] = None  # the global step whose save waits for its metrics line
        self._held_save_seconds = 0.0  # how long the last held save took (reported with the next step)
        self._round_mark: Optional[tuple[float, int, dict[int, int]]] = None  # the totals when the round began
        self._floor_watch = DriftFloorWatch(self.replay_config.tau) if self.replay_config.uses_headroom_drift else None
        self._exact_eval: Optional[ExactAnswerEval] = None  # built with the tokenizer

    @property
    def _replay_active(self) -> bool:
        return self.group_replay is not None or self.elite_replay is not None

    @property
    def _streams(self) -> list[ReplayStream]:
        return [stream for stream in (self.group_replay, self.elite_replay) if stream is not None]

    # ------------------------------------------------------------------ setup

    def _init_tokenizer(self) -> None:
        super()._init_tokenizer()
        if self.group_replay is not None:  # image groups are stored as pictures, rebuilt with the processor
            self.group_replay.set_processor(getattr(self, "processor", None), self.tokenizer)
        if self.replay_config.uses_elite:
            from verl_replay.integrations.verl.elite_replay import EliteReplayStream

            train_files = self.config.data.train_files
            train_files = [train_files] if isinstance(train_files, str) else list(train_files)
            self.elite_replay = EliteReplayStream(
                self.replay_config,
                tokenizer=self.tokenizer,
                train_files=train_files,
                max_prompt_length=int(self.config.data.max_prompt_length),
                max_response_length=int(self.config.data.max_response_length),
                chat_template_kwargs=self.config.data.get("apply_chat_template_kwargs", None),
                has_rollout_log_probs=bool(self.config.actor_rollout_ref.rollout.calculate_log_probs),
            )
        self._exact_eval = self._build_exact_eval()

    def _build_exact_eval(self) -> Optional[ExactAnswerEval]:
        """The exact held-out metric's questions (``exact_eval``: auto / true / false)."""
        mode = str(self.config.get("exact_eval", "auto")).lower()
        if mode == "false":
            return None
        config = self.config
        unplain = sampling_is_plain(config.actor_rollout_ref.rollout.val_kwargs)
        files = config.data.val_files
        questions = []
        if unplain is None:
            questions = exact_questions(
                [files] if isinstance(files, str) else list(files),
                self.tokenizer,
                stop_ids=stop_token_ids(str(config.actor_rollout_ref.model.path), self.tokenizer),
                chat_template_kwargs=config.data.get("apply_chat_template_kwargs", None),
                prompt_key=str(config.data.get("prompt_key", "prompt")),
                max_prompt_length=int(config.data.max_prompt_length),
            )
        if not questions:
            why = unplain or "the validation set has no exact-answer question"
            if mode == "true":
                raise ValueError(f"exact_eval=true needs plain sampled validation of exact-answer questions: {why}")
            return None
        # M-RoPE models (a processor with get_rope_index) take (4, L) position ids, as verl's agent loop builds
        processor = getattr(self, "processor", None)
        position_rows = (4,) if getattr(processor, "get_rope_index", None) is not None else ()
        return ExactAnswerEval(questions, position_rows)

    def _validate(self) -> dict[str, float]:
        # sampled_val=ends: verl's sampled validation before training and at the last step, the
        # exact metric at every validation (a comparison reads the sampled metric only there)
        began = time.perf_counter()
        mode = str(self.config.get("sampled_val", "every")).lower()
        due = sampled_validation_due(mode, self.global_steps, self.total_training_steps, self._exact_eval is not None)
        metrics = super()._validate() if due else {}
        if self._exact_eval is not None:
            start = time.perf_counter()
            scorer = PolicyScorer(
                compute_log_prob=self.actor_rollout_wg.compute_log_prob,
                row_multiple=self._micro_batch_rows(self._actor_dp_size(), training=False),
                temperature=float(self.config.actor_rollout_ref.rollout.val_kwargs.temperature),
            )
            metrics.update(self._exact_eval.metrics(scorer))
            metrics["timing_s/exact_eval"] = time.perf_counter() - start
        # verl times the validations between steps (timing_s/testing) but not the one before training
        metrics["timing_s/validation"] = time.perf_counter() - began
        return metrics

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        config = self.replay_config
        if not (config.uses_elite or config.audit_dir or config.uses_group_buffer):
            return
        # The actor must count each mini-batch's elite rows (the NLL term's denominator), number
        # its optimiser steps (the audit records them) and report the CPU seconds of its forward
        # passes (the group buffer's scan cost).
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
        from verl.trainer.distillation import is_distillation_enabled
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        if is_distillation_enabled(self.config.get("distillation")):
            raise ValueError("verl_replay's actor loss does not compose with on-policy distillation")
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        actor_config.model_config = omega_conf_to_dataclass(
            self.config.actor_rollout_ref.model, dataclass_type=HFModelConfig
        )
        return ReplayActorLoss(
            actor_config,
            elite=self.replay_config.uses_elite,
            mu=self.replay_config.elite.mu,
            audit_dir=self.replay_config.audit_dir,
        )

    # ------------------------------------------------------------------ helpers

    def _anchor_field(self) -> str:
        """l_gen: the trainer's old log-probs in sync mode, the rollout engine's otherwise."""
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

    def _optimizer_step_groups(self) -> int:
        """GRPO groups per optimiser step of an update that carries replay.

        ``replay.ppo_mini_batch_size`` when set: under ``separate_async`` verl ties
        ``actor.ppo_mini_batch_size`` to the round's fresh prompts, so this is how a replay run
        keeps the optimiser-step size of its on-policy baseline.
        """
        configured = self.replay_config.ppo_mini_batch_size
        return int(configured if configured is not None else self.config.actor_rollout_ref.actor.ppo_mini_batch_size)

    def _bypass_mode(self) -> bool:
        """Rollout correction's bypass mode: verl copies the rollout log-probs into old_log_probs."""
        corr = self.config.algorithm.get("rollout_correction", None)
        return corr is not None and bool(corr.get("bypass_mode", False))

    def _rollout_correction_on(self) -> bool:
        corr = self.config.algorithm.get("rollout_correction", None)
        return (
            corr is not None
            and not corr.get("bypass_mode", False)
            and bool(self.config.actor_rollout_ref.rollout.calculate_log_probs)
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

    def _policy_scorer(self) -> PolicyScorer:
        return PolicyScorer(
            compute_log_prob=self.actor_rollout_wg.compute_log_prob,
            row_multiple=self._micro_batch_rows(self._actor_dp_size(), training=False),
            temperature=self.config.actor_rollout_ref.rollout.temperature,
        )

    # ------------------------------------------------------------------ the global step

    def step(self, metrics: dict, timing_raw: dict) -> KVBatchMeta:
        if not self._replay_active:
            self._planned_padding = 0
            batch = super().step(metrics, timing_raw)
            metrics.update(self._rollout_counts(batch))
            return batch
        self._hold_checkpoints_until_logged()
        if self._held_save_seconds:
            # the held save ran after the previous step's line: its time is reported with this step, as
            # verl would have put it into the previous one (verl's step timer adds to what is there)
            for name in ("save_checkpoint", "step"):
                timing_raw[name] = timing_raw.get(name, 0.0) + self._held_save_seconds
            self._held_save_seconds = 0.0
        self._totals = _StepTotals()
        self._planned_padding = 0
        batch = super().step(metrics, timing_raw)
        # verl's aggregator has merged the rounds' metrics by now; replay's are totals of the step.
        for key in [k for k in metrics if k.startswith(LOSS_METRIC_PREFIX)]:
            metrics[key[len("actor/") :]] = metrics.pop(key)
        before = self._totals.replay_seconds
        with self._totals.timed():
            if self.group_replay is not None:
                metrics.update(prefixed(self.group_replay.end_step(batch), "replay/"))
            if self.elite_replay is not None:
                metrics.update(prefixed(self.elite_replay.end_step(batch), "replay/elite/"))
        metrics.update(
            self._totals.metrics(
                scan_forward_seconds=metrics.get("replay/scan_forward_seconds", 0.0),
                end_step_seconds=self._totals.replay_seconds - before,
            )
        )
        metrics.update(self._rollout_counts(batch))
        warning = self._floor_watch.update(metrics) if self._floor_watch is not None else None
        if warning:
            logger.warning(warning)
        return batch

    def _rollout_counts(self, batch: KVBatchMeta) -> dict[str, int]:
        """Fresh rollouts expected, lost and padded this step (every round of it)."""
        expected = int(self.config.data.train_batch_size) * int(self.config.actor_rollout_ref.rollout.n)
        return rollout_counts(batch.tags, expected, planned_padding=self._planned_padding)

    def _begin_replay_step(self) -> None:
        context = StepContext(
            step=self.global_steps,
            rounds=int(self.parameter_sync_step),
            scorer_factory=self._policy_scorer,
            rows_per_group=int(self.config.actor_rollout_ref.rollout.n),
        )
        for stream in self._streams:
            stream.begin_step(context)

    # ------------------------------------------------------------------ injection + balancing

    def _balance_batch(
        self, batch: KVBatchMeta, metrics: dict, logging_prefix: str = "global_seqlen", keep_minibatch: bool = False
    ):
        self._mini_batch_groups = None
        if not self._replay_active or logging_prefix != "global_seqlen":
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        self._round_mark = self._totals.mark()
        with self._totals.timed():
            batch, fresh_groups, added_groups, extra_rows = self._inject_round(batch, int(self.local_trigger_step))
        dp_size = self._actor_dp_size()
        # Replayed groups add optimiser steps like a larger GRPO batch; elite rows join the existing
        # steps (EliteReplay mixes its NLL term into each update at a fixed weight).
        plan = plan_mini_batches(
            num_groups=fresh_groups + added_groups,
            configured_groups=self._optimizer_step_groups(),
            rows_per_group=int(self.config.actor_rollout_ref.rollout.n),
            row_multiple=self._micro_batch_rows(dp_size, training=True),
            extra_rows=extra_rows,
        )
        self._mini_batch_groups = plan.groups_per_mini_batch
        self._padded_rows = plan.padded_groups * plan.rows_per_group
        self._planned_padding += plan.padding_rows
        # verl's worker runs every mini-batch once per PPO epoch, one optimiser step each
        self._totals.optimizer_steps += plan.num_mini_batches * int(self.config.actor_rollout_ref.actor.ppo_epochs)
        for tag in batch.tags:
            if not tag.get("is_padding", False):
                self._totals.tokens[tag.get(REPLAY_SOURCE_FIELD, SOURCE_FRESH)] += int(tag.get("response_len", 0))
        with self._planned_mini_batch_size():
            batch = super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        return self._spread_sources_over_mini_batches(batch, dp_size, plan.num_mini_batches)

    def _inject_round(self, batch: KVBatchMeta, round_index: int) -> tuple[KVBatchMeta, int, int, int]:
        """The round's replay rows joined to its fresh rows: (batch, fresh groups, replayed groups
        added, other rows added). The first round opens the global step (selection)."""
        if round_index == 0:
            self._begin_replay_step()
        batch = self._canonical_order(batch)
        fresh_keys = [key for key, tag in zip(batch.keys, batch.tags, strict=True) if is_fresh(tag)]
        fresh_groups = len({key.rsplit("_", 2)[0] for key in fresh_keys})
        self._mark_fresh_rows(batch)
        if round_index == 0 or self._row_template is None:
            # the rounds of a global step come from one rollout pipeline: one layout, one fetch
            self._row_template = split_rows(tq.kv_batch_get(keys=fresh_keys[:1], partition_id=batch.partition_id), 1)[0]
        template = self._row_template
        added_groups = extra_rows = 0
        for stream in self._streams:
            batch, groups, rows = stream.inject(round_index, batch, template)
            added_groups += groups
            extra_rows += rows
        return batch, fresh_groups, added_groups, extra_rows

    @staticmethod
    def _spread_sources_over_mini_batches(batch: KVBatchMeta, dp_size: int, num_mini_batches: int) -> KVBatchMeta:
        """Within each data-parallel rank's share (verl's balanced partition, kept as is), order the
        rows so every mini-batch gets its share of fresh, replayed, elite and padding rows."""
        per_rank = len(batch.keys) // dp_size
        order: list[int] = []
        for rank in range(dp_size):
            start = rank * per_rank
            categories = [
                3 if tag.get("is_padding", False) else int(tag.get(REPLAY_SOURCE_FIELD, SOURCE_FRESH))
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
    def _canonical_order(batch: KVBatchMeta) -> KVBatchMeta:
        """Fresh rows in an order set by their tokens, not by rollout completion order.

        TransferQueue hands rows over as they finish, so verl's balancing (and with it the
        micro-batches and the float summation order of the gradient) would change from run to run;
        replay decisions sit on thresholds (the drift gate), so a resumed run could then decide
        differently from the straight one. The key is the tokens' raw bytes (exact and cheap).
        """
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"])
        prompts, responses = data["prompts"].unbind(0), data["responses"].unbind(0)
        keys = [(tensor_bytes(prompts[i]), tensor_bytes(responses[i]), i) for i in range(len(batch.keys))]
        batch.reorder([key[-1] for key in sorted(keys)])
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
        if not self._replay_active:
            return super()._compute_old_log_prob(batch, metrics)
        forward = self._forward_rows(batch)
        if forward is batch:
            batch = super()._compute_old_log_prob(batch, metrics)
            if self._has_replay_rows(batch):
                with self._totals.timed():
                    self._fresh_log_prob_metrics(batch, metrics)
        else:
            # Replayed rows keep their stored anchor and elite rows need none: only fresh rows go
            # through the forward (verl's entropy and rollout-vs-actor metrics are then theirs alone).
            super()._compute_old_log_prob(forward, metrics)
        with self._totals.timed():
            if forward is not batch:
                self._fill_skipped_rows(batch, forward, ("old_log_probs", "entropy"), covered=self._group_replay_keys())
            for stream in self._streams:
                stream.after_old_log_probs(
                    batch.partition_id, rollout_correction=self._rollout_correction_on(), forwarded=forward is batch
                )
        return batch

    def _compute_ref_log_prob(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        if not self._replay_active:
            return super()._compute_ref_log_prob(batch, metrics)
        forward = self._forward_rows(batch)
        if forward is batch:
            batch = super()._compute_ref_log_prob(batch, metrics)
        else:
            super()._compute_ref_log_prob(forward, metrics)
        with self._totals.timed():
            if forward is not batch:
                self._fill_skipped_rows(batch, forward, ("ref_log_prob",), covered=self._group_replay_keys())
            for stream in self._streams:
                stream.after_ref_log_probs(batch.partition_id)
        return batch

    def _group_replay_keys(self) -> set[str]:
        """This round's replayed rows: the group stream writes every skipped field of theirs itself
        (stored anchor with its entropy placeholder, stored reference log-probs)."""
        return set(self.group_replay.replayed_keys) if self.group_replay is not None else set()

    @staticmethod
    def _has_replay_rows(batch: KVBatchMeta) -> bool:
        return any(not is_fresh(tag) and not tag.get("is_padding", False) for tag in batch.tags)

    def _forward_rows(self, batch: KVBatchMeta) -> KVBatchMeta:
        """The rows whose log-probs are needed: the fresh ones (plus padding rows where the
        data-parallel dispatch needs them). ``batch`` itself when there is nothing to skip."""
        if self.replay_config.recompute_replayed_log_probs or not self._has_replay_rows(batch):
            return batch
        multiple = self._micro_batch_rows(self._actor_dp_size(), training=False)
        fresh = [i for i, tag in enumerate(batch.tags) if is_fresh(tag)]
        padding = [i for i, tag in enumerate(batch.tags) if tag.get("is_padding", False)]
        short = (-len(fresh)) % multiple
        if short > len(padding):
            return batch
        keep = sorted(fresh + padding[:short])
        return KVBatchMeta(
            keys=[batch.keys[i] for i in keep],
            tags=[batch.tags[i] for i in keep],
            partition_id=batch.partition_id,
            extra_info=batch.extra_info,
        )

    @staticmethod
    def _fill_skipped_rows(
        batch: KVBatchMeta,
        forward: KVBatchMeta,
        fields: tuple[str, ...],
        covered: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """Zeros of each row's response length for the rows left out of a forward: every row must
        carry every field (TransferQueue drops a field that some rows lack). The replay streams then
        write what those rows keep (the stored anchor, the stored reference log-probs); rows in
        ``covered`` get all of ``fields`` from a stream's write, so they are left to it."""
        computed = set(forward.keys) | set(covered)
        skipped = [(key, tag) for key, tag in zip(batch.keys, batch.tags, strict=True) if key not in computed]
        if not skipped:
            return
        lengths = [int(tag["response_len"]) for _, tag in skipped]  # the tags know them: no fetch
        values = {
            name: torch.nested.as_nested_tensor(
                [torch.zeros(n, dtype=torch.float32) for n in lengths], layout=torch.jagged
            )
            for name in fields
        }
        skipped = [key for key, _ in skipped]
        tq.kv_batch_put(
            keys=skipped, partition_id=batch.partition_id, fields=TensorDict(values, batch_size=len(skipped))
        )

    def _fresh_log_prob_metrics(self, batch: KVBatchMeta, metrics: dict) -> None:
        """verl's entropy and rollout-vs-actor diagnostics, recomputed over fresh rows only."""
        keys = [key for key, tag in zip(batch.keys, batch.tags, strict=True) if is_fresh(tag)]
        if not keys:
            return
        fields = ["entropy", "old_log_probs", "response_mask", "responses"]
        calculate_log_probs = bool(self.config.actor_rollout_ref.rollout.calculate_log_probs)
        if calculate_log_probs:
            fields.append("rollout_log_probs")
        data = DataProto(
            batch=tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields).to_padded_tensor()
        )
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
        if not self._replay_active:
            return super()._compute_advantage(batch, metrics)
        with self._totals.timed():
            fresh_rollout_corr = self._fresh_rollout_corr_metrics(batch)
        batch = super()._compute_advantage(batch, metrics)
        metrics.update(fresh_rollout_corr)
        with self._totals.timed():
            for stream in self._streams:
                stream.after_advantages(batch.partition_id)
        return batch

    def _fresh_rollout_corr_metrics(self, batch: KVBatchMeta) -> dict[str, float]:
        """verl's ``rollout_corr/*`` metrics over the fresh rows only: replayed and elite
        rows have IS weight 1 and no off-policy gap, so over the whole batch they dilute them."""
        corr = self.config.algorithm.get("rollout_correction", None)
        if (
            corr is None
            or corr.get("bypass_mode", False)
            or not self.config.actor_rollout_ref.rollout.calculate_log_probs
        ):
            return {}
        keys = [key for key, tag in zip(batch.keys, batch.tags, strict=True) if is_fresh(tag)]
        if not keys or len(keys) == sum(not tag.get("is_padding", False) for tag in batch.tags):
            return {}  # no replay rows in this round: verl's own numbers are the fresh ones
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

        fields = ["old_log_probs", "rollout_log_probs", "response_mask"]
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields).to_padded_tensor()
        _, _, fresh_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=data["old_log_probs"],  # [B_fresh, T]
            rollout_log_prob=data["rollout_log_probs"],
            response_mask=data["response_mask"],
            rollout_is=corr.get("rollout_is", None),
            rollout_is_threshold=corr.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=corr.get("rollout_is_batch_normalize", False),
            rollout_rs=corr.get("rollout_rs", None),
            rollout_rs_threshold=corr.get("rollout_rs_threshold", None),
        )
        return {key: float(value) for key, value in fresh_metrics.items()}

    # ------------------------------------------------------------------ update

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        if self.replay_config.audit_dir:
            # the audit records which global step and round each micro-batch trained in
            batch.extra_info.update({AUDIT_STEP_FIELD: int(self.global_steps), AUDIT_ROUND_FIELD: self._round()})
        with self._planned_mini_batch_size():
            batch = super()._update_actor(batch, metrics)
        for stream in self._streams:
            stream.end_round()
        if self.group_replay is not None and self._round_mark is not None:
            self.group_replay.log_round(self._round(), self._totals.since(self._round_mark))
        self._round_mark = None
        return batch

    # ------------------------------------------------------------------ metrics

    def _compute_metrics(self, batch: KVBatchMeta, metrics, timing_raw, global_steps, epoch):
        if not self._replay_active:
            return super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        keep = [i for i, tag in enumerate(batch.tags) if tag.get(REPLAY_SOURCE_FIELD, SOURCE_FRESH) == SOURCE_FRESH]
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
        keys = [
            key
            for key, tag in zip(batch.keys, batch.tags, strict=True)
            if tag.get(REPLAY_SOURCE_FIELD, 0) == SOURCE_GROUP_REPLAY
        ]
        if not keys:
            return
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["rm_scores"])
        scores = np.array([float(row.sum()) for row in data["rm_scores"].unbind(0)])
        metrics["replay/score/mean"] = float(scores.mean())

    # ------------------------------------------------------------------ checkpoints

    def _replay_state_folder(self, global_step_folder: str) -> str:
        return os.path.join(global_step_folder, REPLAY_STATE_DIR)

    def _replay_identity(self) -> dict:
        """What the stored state's meaning depends on besides the replay settings."""
        from verl_replay.elite.archive_io import hf_tokenizer_fingerprint

        identity = {
            "trainer_mode": self.trainer_mode,
            "anchor_field": self.group_replay.anchor_field if self.group_replay is not None else None,
            "tokenizer_fingerprint": hf_tokenizer_fingerprint(self.tokenizer),
        }
        if self.elite_replay is not None:
            identity["elite_archive_sha256"] = (self.elite_replay.archive.manifest or {}).get("content_sha256")
        return identity

    def _round(self) -> int:
        return int(getattr(self, "local_trigger_step", 0))

    def _hold_checkpoints_until_logged(self) -> None:
        """Make verl's logger save a held checkpoint right after it writes that step's metrics line.

        verl's ``fit`` runs, per global step: ``step``, ``_save_checkpoint`` (which marks the
        checkpoint latest), the weight push, validation, ``_compute_metrics``, ``logger.log``. A
        kill between the save and the log loses the checkpointed step's metrics line for good (the
        resumed run starts after it). ``_save_checkpoint`` therefore only notes the step while
        ``fit`` runs, and the wrapped ``log`` saves it once the line is written: the state saved is
        the same (nothing between the two changes the weights, the buffer or the data order; the
        TransferQueue snapshot then also holds the rollouts generated meanwhile, which a resume
        restores like any other finished rollout). The save's seconds go into the next step's
        ``timing_s/save_checkpoint`` and ``timing_s/step``. Called from ``step``, after ``fit`` made
        the logger; a no-op when it is already wrapped.
        """
        tracker = getattr(self, "logger", None)
        if tracker is None or getattr(tracker, "_verl_replay_holds_checkpoints", False):
            return
        log = tracker.log

        def log_then_save(*args: Any, **kwargs: Any) -> Any:
            result = log(*args, **kwargs)
            step = kwargs.get("step", args[1] if len(args) > 1 else None)
            if self._held_checkpoint is not None and step == self._held_checkpoint:
                self._held_checkpoint = None
                started = time.perf_counter()
                self._save_checkpoint_now()
                self._held_save_seconds += time.perf_counter() - started
            return result

        tracker.log = log_then_save
        tracker._verl_replay_holds_checkpoints = True

    def _save_checkpoint(self) -> None:
        tracker = getattr(self, "logger", None)
        if self._replay_active and getattr(tracker, "_verl_replay_holds_checkpoints", False):
            self._held_checkpoint = int(self.global_steps)  # saved once the step's metrics line is written
            return
        self._save_checkpoint_now()

    def _save_checkpoint_now(self) -> None:
        from verl_replay.integrations.verl.replay_state import (
            decision_settings,
            prune_orphaned_states,
            write_state_manifest,
        )

        # Written before verl's own save, whose last act marks the checkpoint as the latest one:
        # a checkpoint is never "latest" without its replay state (the manifest is written last).
        folder = self._replay_state_folder(
            os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        )
        if self._replay_active:
            for stream in self._streams:
                stream.save(folder)
            write_state_manifest(
                folder,
                step=self.global_steps,
                identity=self._replay_identity(),
                settings=decision_settings(self.replay_config),
            )
        super()._save_checkpoint()
        if self._replay_active:
            for removed in prune_orphaned_states(
                self.config.trainer.default_local_dir, REPLAY_STATE_DIR, keep_step=self.global_steps
            ):
                logger.info("removed the replay state of pruned checkpoint %s", removed.parent)

    def _load_checkpoint(self) -> None:
        from verl_replay.integrations.verl.replay_state import ReplayStateError, check_state_manifest, decision_settings

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
        found = check_state_manifest(
            folder,
            step=self.global_steps,
            identity=self._replay_identity(),
            settings=decision_settings(self.replay_config),
        )
        if not found:
            if not self.replay_config.allow_missing_state:
                raise ReplayStateError(
                    f"resuming from global step {self.global_steps}, but {folder} holds no replay state (buffer, "
                    "sampler): the replay streams would restart empty. "
                    "Set replay.allow_missing_state=true to accept that"
                )
            logger.warning("no replay state in %s: replay restarts empty (replay.allow_missing_state=true)", folder)
            if self.group_replay is not None:
                self.group_replay.open_event_log(resume_from_step=self.global_steps)
            return
        for stream in self._streams:
            stream.load(folder, step=self.global_steps)


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
