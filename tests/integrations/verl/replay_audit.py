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
        for i in range(record["responses"].shape[0]):
            valid = int(record["response_mask"][i].sum())
            if valid == 0:  # verl's synthetic padding rows
                continue
            rows.append(
                AuditedRow(
                    optimizer_step=step,
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
