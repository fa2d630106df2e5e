"""Headroom-Drift (and naive) group replay inside verl's v1 step, over TransferQueue.

Per update (one ``_step_once``), driven by the trainer hooks in ``trainer.py``:

1. ``inject`` (before balancing): ``buffer.select`` scans stored groups with teacher-forced
   forwards of the current policy (``actor_rollout_wg.compute_log_prob`` on chunks written to a
   scratch TransferQueue partition, padded to the data-parallel size) and the accepted groups are
   written into the step's partition as new rows with fresh uids.
2. ``restore_anchor`` (after old log-probs): replayed rows get their stored l_gen as
   ``old_log_probs`` — the PPO ratio stays anchored to the generating policy.
3. ``restore_advantages`` (after advantages): replayed rows get their stored advantages back;
   they are never re-normalised against fresh groups.
4. ``admit`` (after the actor update): fresh groups whose answers disagree enter the buffer.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.utils.tensordict_utils import list_of_dict_to_tensordict
from verl.workers.utils.padding import response_from_nested

from verl_replay.config import ReplayConfig
from verl_replay.headroom_drift.buffer import HeadroomDriftBuffer, NaiveReplayBuffer, ReplayGroup
from verl_replay.headroom_drift.events import ReplayEventLog
from verl_replay.integrations.verl.rows import (
    REPLAY_GROUP_FIELD,
    REPLAY_SOURCE_FIELD,
    SOURCE_GROUP_REPLAY,
    GroupNotReplayable,
    group_keys_by_uid,
    group_to_rows,
    row_key,
    row_tag,
    rows_to_group,
    split_rows,
)

logger = logging.getLogger(__name__)

SCAN_PARTITION = "replay_scan"
BUFFER_FILE = "group_buffer.pt"


def nested(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def build_buffer(config: ReplayConfig) -> HeadroomDriftBuffer | NaiveReplayBuffer:
    if config.strategy == "naive":
        return NaiveReplayBuffer(capacity=config.capacity, k_rep=config.k_rep, ingress=config.ingress,
                                 weighting=config.weighting)
    return HeadroomDriftBuffer(
        capacity=config.capacity,
        k_rep=config.k_rep,
        tau=config.tau,
        weighting=config.weighting,
        drift_norm=config.drift_norm,
        scan_chunk_groups=config.scan_chunk_groups,
        max_scan_groups=config.max_scan_groups,
        ingress=config.ingress,
    )


class PolicyScorer:
    """Teacher-forced log-probs of stored groups under the current actor (the scan's forward).

    ``compute_log_prob`` is the same worker call verl uses for ``old_log_probs``; the rows go
    through a scratch TransferQueue partition exactly like a training batch, padded with copies
    of the chunk's first row to ``row_multiple`` (data-parallel size x log-prob micro-batch size).
    """

    def __init__(self, compute_log_prob: Callable[[KVBatchMeta], Any], row_multiple: int, temperature: float):
        self.compute_log_prob = compute_log_prob
        self.row_multiple = row_multiple
        self.temperature = temperature
        self._calls = 0

    def __call__(self, groups: list[ReplayGroup]) -> list[torch.Tensor]:
        self._calls += 1
        rows, owners = [], []
        for position, group in enumerate(groups):
            group_rows = group_to_rows(group, uid=f"scan{self._calls}g{group.group_id}", global_steps=0)
            rows.extend(group_rows)
            owners.extend([position] * len(group_rows))
        real = len(rows)
        rows.extend(dict(rows[0]) for _ in range((-real) % self.row_multiple))
        keys = [row_key(f"scan{self._calls}p{i}", 0) for i in range(len(rows))]
        tags = [row_tag(row, global_steps=0) for row in rows]
        tq.kv_batch_put(keys=keys, partition_id=SCAN_PARTITION, fields=list_of_dict_to_tensordict(rows), tags=tags)
        try:
            meta = KVBatchMeta(
                keys=keys,
                tags=tags,
                partition_id=SCAN_PARTITION,
                extra_info={"temperature": self.temperature, "calculate_entropy": False, "compute_loss": False},
            )
            self.compute_log_prob(meta)
            data = tq.kv_batch_get(keys=keys[:real], partition_id=SCAN_PARTITION, select_fields=["log_probs", "response_mask"])
            per_row = response_from_nested(data["log_probs"], data["response_mask"]).unbind(0)
        finally:
            tq.kv_clear(keys=keys, partition_id=SCAN_PARTITION)
        outputs: list[list[torch.Tensor]] = [[] for _ in groups]
        for owner, log_probs in zip(owners, per_row, strict=True):
            outputs[owner].append(log_probs.float())
        return [torch.cat(parts) for parts in outputs]


class GroupReplayController:
    """Owns the group buffer and its event log; moves groups between the buffer and verl rows."""

    def __init__(self, config: ReplayConfig, *, anchor_field: str) -> None:
        self.config = config
        self.anchor_field = anchor_field
        self.buffer = build_buffer(config)
        self.event_log: Optional[ReplayEventLog] = None
        # key -> (group, response index) for the replayed rows of the current update
        self._replayed: dict[str, tuple[ReplayGroup, int]] = {}
        self._step_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ event log / state

    def open_event_log(self, resume_from_step: Optional[int] = None) -> None:
        if self.config.event_log and self.event_log is None:
            self.event_log = ReplayEventLog(self.config.event_log, resume_from_step=resume_from_step)

    def save(self, folder: str | os.PathLike) -> None:
        path = Path(folder) / BUFFER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.buffer.save(path)

    def load(self, folder: str | os.PathLike, step: int) -> bool:
        path = Path(folder) / BUFFER_FILE
        if not path.exists():
            logger.warning("no replay buffer state at %s: the buffer starts empty", path)
            return False
        self.buffer.load(path)
        self.open_event_log(resume_from_step=step)
        return True

    # ------------------------------------------------------------------ 1. selection + injection

    def inject(self, batch: KVBatchMeta, scorer: Optional[PolicyScorer], step: int) -> tuple[KVBatchMeta, dict[str, float]]:
        """Select replay groups for ``step`` and append their rows to ``batch``."""
        self.open_event_log()
        start = time.perf_counter()
        result = self.buffer.select(step, scorer)
        self._replayed = {}
        keys, tags, rows = [], [], []
        for group in result.groups:
            uid = f"replay-g{group.group_id}-s{step}"
            for index, row in enumerate(group_to_rows(group, uid=uid, global_steps=step)):
                row[REPLAY_SOURCE_FIELD] = torch.tensor(SOURCE_GROUP_REPLAY, dtype=torch.int64)
                row[REPLAY_GROUP_FIELD] = torch.tensor(group.group_id, dtype=torch.int64)
                key = row_key(uid, index)
                keys.append(key)
                tags.append(row_tag(row, global_steps=step, replay_source=SOURCE_GROUP_REPLAY,
                                    replay_group_id=group.group_id, birth_step=group.birth_step))
                rows.append(row)
                self._replayed[key] = (group, index)
        if rows:
            tq.kv_batch_put(keys=keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(rows), tags=tags)
        if self.event_log is not None:
            self.event_log.log_selection(result)
        stats = dict(result.stats)
        stats["inject_seconds"] = time.perf_counter() - start - stats.get("select_seconds", 0.0)
        stats["replay_rows"] = float(len(rows))
        self._step_stats = stats
        merged = KVBatchMeta(
            keys=list(batch.keys) + keys,
            tags=list(batch.tags) + tags,
            partition_id=batch.partition_id,
            extra_info=batch.extra_info,
        )
        return merged, stats

    @property
    def replayed_keys(self) -> list[str]:
        return list(self._replayed)

    # ------------------------------------------------------------------ 2./3. stored anchor and advantages

    def restore_anchor(self, partition_id: str, rollout_correction: bool) -> None:
        """Replayed rows: ``old_log_probs`` (and rollout log-probs) are the stored l_gen."""
        if not self._replayed:
            return
        keys = list(self._replayed)
        anchors = [self._response_slice(group, index, group.gen_log_probs) for group, index in self._replayed.values()]
        fields = {"old_log_probs": nested(anchors)}
        if rollout_correction:
            fields["rollout_log_probs"] = nested([a.clone() for a in anchors])
        tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=TensorDict(fields, batch_size=len(keys)))

    def restore_advantages(self, partition_id: str) -> None:
        """Replayed rows: token-level advantages/returns are the stored A_i on valid tokens."""
        if not self._replayed:
            return
        keys = list(self._replayed)
        values = []
        for group, index in self._replayed.values():
            mask = self._response_slice(group, index, group.response_mask).float()
            values.append(mask * group.advantages[index])
        fields = {"advantages": nested(values), "returns": nested([v.clone() for v in values])}
        tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=TensorDict(fields, batch_size=len(keys)))

    @staticmethod
    def _response_slice(group: ReplayGroup, index: int, flat: torch.Tensor) -> torch.Tensor:
        offsets = group.response_offsets()
        return flat[int(offsets[index]) : int(offsets[index + 1])].clone()

    # ------------------------------------------------------------------ 4. ingress

    def admit(self, batch: KVBatchMeta, step: int) -> dict[str, float]:
        """After the update: turn the fresh groups of this update into buffer candidates."""
        fresh = [
            (key, tag) for key, tag in zip(batch.keys, batch.tags, strict=True)
            if not tag.get("is_padding", False) and tag.get("replay_source", 0) == 0
        ]
        stats: dict[str, float] = {"skipped_ingress": 0.0}
        groups: list[ReplayGroup] = []
        if fresh:
            keys = [key for key, _ in fresh]
            data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id)
            rows = split_rows(data, len(keys))
            for uid, members in self._canonical_groups(keys, rows):
                if any(index != 0 for _, index, _ in members):
                    stats["skipped_ingress"] += 1  # multi-output agent sessions are not replayable
                    continue
                try:
                    groups.append(rows_to_group([rows[pos] for _, _, pos in members], anchor_field=self.anchor_field,
                                                require_acc=self.config.ingress == "answer_disagree"))
                except GroupNotReplayable as reason:
                    if "acc" in str(reason):
                        raise
                    logger.info("group %s not replayable: %s", uid, reason)
                    stats["skipped_ingress"] += 1
        admitted = self.buffer.admit(groups, step)
        if self.event_log is not None:
            self.event_log.log_admit(admitted)
            self.event_log.log_step(step, {**self._step_stats, **{k: v for k, v in admitted.items() if k != "events"}})
        stats.update({k: float(v) for k, v in admitted.items() if k != "events"})
        self._replayed = {}
        return stats

    @staticmethod
    def _canonical_groups(keys: list[str], rows: list[dict[str, Any]]) -> list[tuple[str, list[tuple[int, int, int]]]]:
        """Groups in a run-independent order, each group's responses sorted by their tokens.

        TransferQueue returns rows in completion order and uids are random, so without this a
        rerun (or a resumed run) would number the same groups differently and break ties of the
        ranking differently. A group is a set of responses: its order carries no meaning.
        """

        def response_key(member: tuple[int, int, int]) -> tuple:
            return tuple(torch.as_tensor(rows[member[2]]["responses"]).tolist())

        def group_key(item: tuple[str, list[tuple[int, int, int]]]) -> tuple:
            uid, members = item
            first = rows[members[0][2]]
            return (str(first.get("index", "")), tuple(torch.as_tensor(first["prompts"]).tolist()), uid)

        grouped = [(uid, sorted(members, key=response_key)) for uid, members in group_keys_by_uid(keys).items()]
        return sorted(grouped, key=group_key)

    def close(self) -> None:
        if self.event_log is not None:
            self.event_log.close()
