"""The interface the trainer drives for each replay stream, once per global step.

A *global step* is one weight version: verl's ``separate_async`` trainer runs it as
``parameter_sync_step`` update rounds (``_step_once``), each on one fresh mini-batch; the
synchronous trainer has one round per step. Every replay stream follows the same life cycle:

1. ``begin_step`` (first round, before its balancing): choose what this global step replays,
   under the weights at its start; nothing admitted during the step is a candidate;
2. per round: ``inject`` writes the round's share of those rows into the round's partition,
   ``after_old_log_probs`` / ``after_advantages`` put back what replay keeps (stored anchor,
   stored or zero advantages), ``end_round`` forgets the round's keys;
3. ``end_step`` (after the last round): ingress and the step's ``replay/`` metrics, one value per
   global step (counts and seconds summed over the rounds, never averaged);
4. ``save`` / ``load`` with verl's checkpoints.

The trainer mixin (``trainer.py``) calls these hooks from verl's stage methods; the streams never
see verl's trainer.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from transfer_queue import KVBatchMeta


class InjectedRowMismatch(ValueError):
    """An injected row does not carry the fields, dtypes or shapes of the fresh rows it joins.

    TransferQueue returns only the fields every requested row has: a field missing on injected
    rows would silently vanish for the fresh rows too. Raised before anything is written.
    """


def split_over_rounds(count: int, rounds: int) -> list[int]:
    """How many of ``count`` items each of ``rounds`` rounds takes: shares differ by at most one,
    earlier rounds first (``split_over_rounds(5, 2) == [3, 2]``)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    base, extra = divmod(count, rounds)
    return [base + (1 if r < extra else 0) for r in range(rounds)]


def _layout(value: Any) -> tuple:
    """What must agree between an injected row and a fresh row for one field."""
    if isinstance(value, torch.Tensor):
        # leading dims of multi-row position ids (e.g. M-RoPE (4, L)) must match; lengths may not
        return ("tensor", value.dtype, value.dim(), tuple(value.shape[:-1]) if value.dim() > 1 else ())
    return ("object",)


def check_row_fields(rows: Sequence[Mapping[str, Any]], template: Mapping[str, Any], *, source: str) -> None:
    """Every row has exactly ``template``'s fields with the same dtype and shape layout."""
    expected = {name: _layout(value) for name, value in template.items()}
    for row in rows:
        missing = sorted(set(expected) - set(row))
        extra = sorted(set(row) - set(expected))
        if missing or extra:
            raise InjectedRowMismatch(
                f"{source} rows must carry exactly the fields of the fresh rows they join: "
                f"missing {missing or 'none'}, extra {extra or 'none'}"
            )
        for name, layout in expected.items():
            got = _layout(row[name])
            if got != layout:
                raise InjectedRowMismatch(
                    f"{source} row field {name!r} is {got[1:] or 'not a tensor'} but fresh rows have "
                    f"{layout[1:] or 'not a tensor'} (dtype, dims, leading shape)"
                )


@dataclass
class StepContext:
    """What a stream needs to know about the global step it serves."""

    step: int  # verl's global step (constant over its rounds)
    rounds: int  # update rounds in this global step
    scorer_factory: Optional[Callable[[], Any]] = None  # teacher-forced forwards of the current policy
    rows_per_group: int = 1  # GRPO group size (rollout.n)


class ReplayStream(ABC):
    """Base class of the replay streams (group replay, elite replay); see the module docstring."""

    @abstractmethod
    def begin_step(self, context: StepContext) -> None:
        """Choose this global step's replay rows (first round, before balancing)."""

    @abstractmethod
    def inject(self, round_index: int, batch: KVBatchMeta, template: Mapping[str, Any]) -> tuple[KVBatchMeta, int, int]:
        """Append this round's rows to ``batch`` (``template``: a fresh row of it, all fields).

        Returns the batch, the GRPO groups added (they add optimiser steps) and the other rows
        added (they join the existing optimiser steps).
        """

    def after_old_log_probs(self, partition_id: str, *, rollout_correction: bool, forwarded: bool) -> None:
        """After verl's old-log-prob stage; ``forwarded``: this round's replay rows went through its
        forward (else they hold zeros there)."""
        return None

    def after_ref_log_probs(self, partition_id: str) -> None:
        return None

    def after_advantages(self, partition_id: str) -> None:
        return None

    def end_round(self) -> None:
        return None

    @abstractmethod
    def end_step(self, batch: KVBatchMeta) -> dict[str, float]:
        """After the last round (``batch``: every row of the global step): the step's metrics."""

    @abstractmethod
    def save(self, folder: str | os.PathLike) -> None:
        """Write the stream's state into a checkpoint folder (atomically)."""

    @abstractmethod
    def load(self, folder: str | os.PathLike, step: int) -> bool:
        """Restore the state saved at global step ``step``; False if the folder holds none."""

    def close(self) -> None:
        return None
