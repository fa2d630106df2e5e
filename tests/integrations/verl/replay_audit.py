"""Reading what the real actor update trained on (``replay.audit_dir`` records, one per micro-batch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

FRESH, GROUP_REPLAY, ELITE = 0, 1, 2


@dataclass(frozen=True)
class AuditedRow:
    """One row of one micro-batch as the update saw it."""

    optimizer_step: int
    global_step: int  # the global step of the update (-1: not recorded)
    round: int  # its update round within the global step (-1: not recorded)
    source: int
    group_id: int
    tokens: tuple[tuple[int, ...], tuple[int, ...]]  # (prompt, valid response tokens)
    old_log_probs: torch.Tensor  # [valid]
    advantage: torch.Tensor  # [valid]
    rollout_log_probs: Optional[torch.Tensor]  # [valid]
    is_weights: Optional[torch.Tensor]  # [valid]


def read_audit(directory: Path) -> list[AuditedRow]:
    rows = []
    for path in sorted(Path(directory).glob("*.pt")):
        record = torch.load(path)
        step = int(record.get("replay_optimizer_step", -1))
        global_step, round_index = int(record.get("replay_global_step", -1)), int(record.get("replay_round", -1))
        for i in range(record["responses"].shape[0]):
            valid = int(record["response_mask"][i].sum())
            if valid == 0:  # verl's synthetic padding rows
                continue
            rows.append(
                AuditedRow(
                    optimizer_step=step,
                    global_step=global_step,
                    round=round_index,
                    source=int(record["replay_source"][i]),
                    group_id=int(record["replay_group_id"][i]),
                    tokens=(tuple(record["prompts"][i].tolist()), tuple(record["responses"][i][:valid].tolist())),
                    old_log_probs=record["old_log_probs"][i][:valid],
                    advantage=record["advantages"][i][:valid],
                    rollout_log_probs=record["rollout_log_probs"][i][:valid] if "rollout_log_probs" in record else None,
                    is_weights=record["rollout_is_weights"][i][:valid] if "rollout_is_weights" in record else None,
                )
            )
    return rows


def first_fresh_occurrences(rows: list[AuditedRow]) -> dict[tuple, list[AuditedRow]]:
    """Fresh rows by their tokens: what verl itself put in the batch when those tokens were new."""
    found: dict[tuple, list[AuditedRow]] = {}
    for row in rows:
        if row.source == FRESH:
            found.setdefault(row.tokens, []).append(row)
    return found


def rows_per_optimizer_step(rows: list[AuditedRow]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for row in rows:
        counts[row.optimizer_step] = counts.get(row.optimizer_step, 0) + 1
    return counts
