"""Headroom-Drift (and naive) group replay inside verl's v1 global step, over TransferQueue.

Driven by the trainer hooks in ``trainer.py`` through the :class:`ReplayStream` interface
(``streams.py``), once per global step (SPEC 1.3-1.6):

1. ``begin_step`` (first round, before balancing): ``buffer.select`` ranks the groups admitted
   before this global step and scans them with teacher-forced forwards of the current policy
   (``actor_rollout_wg.compute_log_prob`` on chunks written to a scratch TransferQueue
   partition); the accepted groups (<= K_rep, each once) are spread over the step's rounds;
2. ``inject`` (each round): the round's share is written into its partition as new rows with
   fresh uids and exactly the fields of the round's fresh rows;
3. ``after_old_log_probs`` / ``after_advantages``: replayed rows get their stored l_gen as
   ``old_log_probs`` (the PPO ratio stays anchored to the generating policy) and their stored
   advantages (never re-normalised against fresh groups);
4. ``end_step`` (after the last round): the global step's fresh groups whose answers disagree
   enter the buffer.
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
from verl_replay.headroom_drift.buffer import (
    HeadroomDriftBuffer,
    NaiveReplayBuffer,
    ReplayGroup,
    SelectionResult,
    scan_chunk_multiple,
)
from verl_replay.headroom_drift.events import ReplayEventLog
from verl_replay.integrations.verl.rows import (
    REF_LOG_PROBS_META,
    REPLAY_GROUP_FIELD,
    REPLAY_SOURCE_FIELD,
    SOURCE_GROUP_REPLAY,
    GroupNotReplayable,
    correctness_bit,
    group_keys_by_uid,
    group_to_rows,
    is_fresh,
    row_key,
    row_tag,
    rows_to_group,
    split_rows,
    tensor_bytes,
)
from verl_replay.integrations.verl.streams import ReplayStream, StepContext, check_row_fields, split_over_rounds

logger = logging.getLogger(__name__)

SCAN_PARTITION = "replay_scan"
BUFFER_FILE = "group_buffer.pt"
# What ingress needs of every fresh row to decide (the rest is fetched for admitted groups only).
INGRESS_DECISION_FIELDS = ("prompts", "responses", "advantages", "response_mask", "extra_fields", "rm_scores")


def nested(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def build_buffer(config: ReplayConfig) -> HeadroomDriftBuffer | NaiveReplayBuffer:
    if config.strategy == "naive":
        return NaiveReplayBuffer(
            capacity=config.capacity, k_rep=config.k_rep, ingress=config.ingress, weighting=config.weighting
        )
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
        self.forward_rows = 0  # rows through the scan forward, padding included

    def __call__(self, groups: list[ReplayGroup]) -> list[torch.Tensor]:
        self._calls += 1
        rows, owners = [], []
        for position, group in enumerate(groups):
            group_rows = group_to_rows(group, uid=f"scan{self._calls}g{group.group_id}", global_steps=0)
            rows.extend(group_rows)
            owners.extend([position] * len(group_rows))
        real = len(rows)
        rows.extend(dict(rows[0]) for _ in range((-real) % self.row_multiple))
        self.forward_rows += len(rows)
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
            data = tq.kv_batch_get(
                keys=keys[:real], partition_id=SCAN_PARTITION, select_fields=["log_probs", "response_mask"]
            )
            per_row = response_from_nested(data["log_probs"], data["response_mask"]).unbind(0)
        finally:
            tq.kv_clear(keys=keys, partition_id=SCAN_PARTITION)
        outputs: list[list[torch.Tensor]] = [[] for _ in groups]
        for owner, log_probs in zip(owners, per_row, strict=True):
            outputs[owner].append(log_probs.float())
        return [torch.cat(parts) for parts in outputs]


class GroupReplayStream(ReplayStream):
    """Owns the group buffer and its event log; moves groups between the buffer and verl rows."""

    def __init__(self, config: ReplayConfig, *, anchor_field: str) -> None:
        self.config = config
        self.anchor_field = anchor_field
        self.buffer = build_buffer(config)
        self.event_log: Optional[ReplayEventLog] = None
        self._step = -1
        self._by_round: list[list[ReplayGroup]] = []
        # key -> (group, response index) for the replayed rows of the current round
        self._replayed: dict[str, tuple[ReplayGroup, int]] = {}
        self._stats: dict[str, float] = {}

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
            raise FileNotFoundError(f"{path}: the checkpoint's replay state has no group buffer")
        # The decision settings were checked against the state's manifest; settings that cannot
        # change a decision (chunk sizes) may differ, so this run's configuration wins.
        self.buffer.load(path, strict=False)
        self.open_event_log(resume_from_step=step)
        return True

    def close(self) -> None:
        if self.event_log is not None:
            self.event_log.close()

    # ------------------------------------------------------------------ 1. selection

    def begin_step(self, context: StepContext) -> None:
        self.open_event_log()
        self._step = context.step
        scorer = context.scorer_factory() if isinstance(self.buffer, HeadroomDriftBuffer) else None
        # scan chunks sized to what can still be accepted, in whole data-parallel row multiples
        multiple = scan_chunk_multiple(context.rows_per_group, scorer.row_multiple) if scorer is not None else 1
        result = self.buffer.select(context.step, scorer, chunk_multiple=multiple)
        shares = split_over_rounds(len(result.groups), context.rounds)
        self._by_round, start = [], 0
        for share in shares:
            self._by_round.append(result.groups[start : start + share])
            start += share
        self._log_selection(result)
        self._stats = dict(result.stats)
        self._stats.update(
            inject_seconds=0.0,
            replay_rows=0.0,
            scan_forward_rows=float(getattr(scorer, "forward_rows", 0)),
        )

    def _log_selection(self, result: SelectionResult) -> None:
        if self.event_log is None:
            return
        round_of = {group.group_id: r for r, groups in enumerate(self._by_round) for group in groups}
        records = result.events()
        for record in records:
            if record["accepted"]:
                record["round"] = round_of[record["group_id"]]
        self.event_log.extend(records)

    # ------------------------------------------------------------------ 2. injection

    def inject(self, round_index: int, batch: KVBatchMeta, template: dict[str, Any]) -> tuple[KVBatchMeta, int, int]:
        """Append this round's share of the accepted groups to ``batch`` as new rows."""
        start = time.perf_counter()
        groups = self._by_round[round_index] if round_index < len(self._by_round) else []
        self._replayed = {}
        keys, tags, rows = [], [], []
        for group in groups:
            uid = f"replay-g{group.group_id}-s{self._step}"
            for index, row in enumerate(group_to_rows(group, uid=uid, global_steps=self._step)):
                row[REPLAY_SOURCE_FIELD] = torch.tensor(SOURCE_GROUP_REPLAY, dtype=torch.int64)
                row[REPLAY_GROUP_FIELD] = torch.tensor(group.group_id, dtype=torch.int64)
                key = row_key(uid, index)
                keys.append(key)
                tags.append(
                    row_tag(
                        row,
                        global_steps=self._step,
                        replay_source=SOURCE_GROUP_REPLAY,
                        replay_group_id=group.group_id,
                        birth_step=group.birth_step,
                    )
                )
                rows.append(row)
                self._replayed[key] = (group, index)
        if rows:
            check_row_fields(rows, template, source="replayed group")
            tq.kv_batch_put(
                keys=keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(rows), tags=tags
            )
        self._stats["inject_seconds"] += time.perf_counter() - start
        self._stats["replay_rows"] += float(len(rows))
        merged = KVBatchMeta(
            keys=list(batch.keys) + keys,
            tags=list(batch.tags) + tags,
            partition_id=batch.partition_id,
            extra_info=batch.extra_info,
        )
        return merged, len(groups), 0

    @property
    def replayed_keys(self) -> list[str]:
        return list(self._replayed)

    # ------------------------------------------------------------------ 3. stored anchor and advantages

    def after_old_log_probs(self, partition_id: str, *, rollout_correction: bool, forwarded: bool = True) -> None:
        """Replayed rows: ``old_log_probs`` (and rollout log-probs) are the stored l_gen. Left out
        of the forward (``forwarded=False``), they get their ``entropy`` placeholder (zeros) in the
        same write: every row must carry every field, and one write per round is enough."""
        if not self._replayed:
            return
        keys = list(self._replayed)
        anchors = self._per_row(lambda group: group.gen_log_probs)
        fields = {"old_log_probs": nested(anchors)}
        if not forwarded:
            fields["entropy"] = nested([torch.zeros(a.shape, dtype=torch.float32) for a in anchors])
        if rollout_correction:
            fields["rollout_log_probs"] = nested([a.clone() for a in anchors])
        tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=TensorDict(fields, batch_size=len(keys)))

    def after_ref_log_probs(self, partition_id: str) -> None:
        """Replayed rows: the reference log-probs stored at ingress (the reference model is frozen)."""
        if not self._replayed:
            return

        def stored_reference(group: ReplayGroup) -> torch.Tensor:
            stored = group.meta.get(REF_LOG_PROBS_META)
            if stored is None:
                raise ValueError(
                    f"replayed group {group.group_id} was admitted without reference log-probs, but this run computes "
                    "them (actor_rollout_ref.actor.use_kl_loss=True); resume with the KL setting it was stored under"
                )
            return stored

        refs = self._per_row(stored_reference)
        keys = list(self._replayed)
        tq.kv_batch_put(
            keys=keys,
            partition_id=partition_id,
            fields=TensorDict({"ref_log_prob": nested(refs)}, batch_size=len(keys)),
        )

    def after_advantages(self, partition_id: str) -> None:
        """Replayed rows: token-level advantages/returns are the stored A_i on valid tokens."""
        if not self._replayed:
            return
        keys = list(self._replayed)
        masks = self._per_row(lambda group: group.response_mask)
        advantages = {id(group): group.advantages for group, _ in self._replayed.values()}
        values = [
            mask.float() * advantages[id(group)][index]
            for mask, (group, index) in zip(masks, self._replayed.values(), strict=True)
        ]
        fields = {"advantages": nested(values), "returns": nested([v.clone() for v in values])}
        tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=TensorDict(fields, batch_size=len(keys)))

    def end_round(self) -> None:
        self._replayed = {}

    def _per_row(self, flat_of: Callable[[ReplayGroup], torch.Tensor]) -> list[torch.Tensor]:
        """``flat_of(group)`` cut into the replayed rows' responses, in row order; each group's
        field is decoded from its packed storage once."""
        decoded: dict[int, tuple[torch.Tensor, list[int]]] = {}
        out = []
        for group, index in self._replayed.values():
            if id(group) not in decoded:
                decoded[id(group)] = (flat_of(group), group.response_offsets().tolist())
            flat, offsets = decoded[id(group)]
            out.append(flat[offsets[index] : offsets[index + 1]].clone())
        return out

    # ------------------------------------------------------------------ 4. ingress

    def end_step(self, batch: KVBatchMeta) -> dict[str, float]:
        """After the global step's last round: its fresh groups become buffer candidates."""
        fresh_keys = [key for key, tag in zip(batch.keys, batch.tags, strict=True) if is_fresh(tag)]
        groups, skipped = self._ingress_groups(fresh_keys, batch.partition_id)
        admitted = self.buffer.admit(groups, self._step)
        counts = {k: float(v) for k, v in admitted.items() if k != "events"}
        if self.event_log is not None:
            self.event_log.log_admit(admitted)
            self.event_log.log_step(self._step, {**self._stats, **counts, "skipped_ingress": float(skipped)})
        stats = {**self._stats, **counts, "skipped_ingress": float(skipped)}
        self._by_round, self._replayed, self._stats = [], {}, {}
        return stats

    def _ingress_groups(self, keys: list[str], partition_id: str) -> tuple[list[ReplayGroup], int]:
        """The fresh groups that pass ingress, as ``ReplayGroup``s in a run-independent order.

        Deciding needs a few fields of every fresh row; only the groups that pass are fetched in
        full (every field, so a replayed row can carry exactly what a fresh row has).
        """
        if not keys:
            return [], 0
        decision = split_rows(
            tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=list(INGRESS_DECISION_FIELDS)),
            len(keys),
        )
        skipped = 0
        chosen: list[tuple[tuple, list[int]]] = []
        for uid, members in group_keys_by_uid(keys).items():
            if any(index != 0 for _, index, _ in members):
                skipped += 1  # multi-output agent sessions are not replayable
                continue
            positions = [position for _, _, position in members]
            if not self._passes_ingress([decision[p] for p in positions]):
                continue
            prompt = tensor_bytes(decision[positions[0]]["prompts"])
            responses = sorted(tensor_bytes(decision[p]["responses"]) for p in positions)
            chosen.append(((prompt, tuple(responses), uid), positions))
        chosen.sort(key=lambda item: item[0])  # a group is a set of responses: order carries no meaning
        full_keys = [keys[p] for _, positions in chosen for p in positions]
        full = (
            split_rows(tq.kv_batch_get(keys=full_keys, partition_id=partition_id), len(full_keys)) if full_keys else []
        )
        groups, start = [], 0
        for group_key, positions in chosen:
            members = full[start : start + len(positions)]
            start += len(positions)
            members.sort(key=lambda row: tensor_bytes(row["responses"]))
            try:
                groups.append(
                    rows_to_group(
                        members, anchor_field=self.anchor_field, require_acc=self.config.ingress == "answer_disagree"
                    )
                )
            except GroupNotReplayable as reason:
                logger.info("group %s not replayable: %s", group_key[-1], reason)
                skipped += 1
        return groups, skipped

    def _passes_ingress(self, rows: list[dict[str, Any]]) -> bool:
        """SPEC 1.4 on the decision fields: disagreeing answers (or a non-zero advantage), never a
        group whose advantages are all zero."""
        advantages = [
            float(torch.as_tensor(r["advantages"]).float().abs().max())
            if torch.as_tensor(r["advantages"]).numel()
            else 0.0
            for r in rows
        ]
        if not any(a > 0 for a in advantages):
            return False
        if self.config.ingress != "answer_disagree":
            return True
        correct = sum(correctness_bit(row) for row in rows)
        return 0 < correct < len(rows)
