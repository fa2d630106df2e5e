"""Mini-batch plan for an update that carries replayed rows on top of the fresh batch.

verl splits an update into mini-batches of ``ppo_mini_batch_size`` groups (x n rows) and pads the
batch with synthetic rows up to a multiple of that size. Appending K replayed groups to G fresh
groups would then either leave a short last mini-batch full of padding, whose few real rows get a
whole optimiser step's weight, or need an extra padding-only step. The plan keeps the number of
optimiser steps verl would take for the enlarged GRPO batch, ``ceil((G + K) / m)``, and spreads the
groups evenly over them, so padding is at most one group per mini-batch and never fills one.

Rows that are not GRPO groups (EliteReplay's archive rows, ``extra_rows``) add no optimiser step:
EliteReplay's loss is a fixed-weight mix inside each step, so those rows are spread over the same
steps, each mini-batch growing by its share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MiniBatchPlan:
    num_groups: int  # real GRPO groups in the update (fresh + replayed)
    extra_rows: int  # real rows that are not GRPO groups (elite rows)
    rows_per_group: int
    num_mini_batches: int  # optimiser steps of the update (per PPO epoch)
    groups_per_mini_batch: int  # the ppo_mini_batch_size to use for this update (x rows_per_group rows)
    padded_groups: int  # num_mini_batches * groups_per_mini_batch

    @property
    def padding_rows(self) -> int:
        return self.padded_groups * self.rows_per_group - self.num_groups * self.rows_per_group - self.extra_rows


def plan_mini_batches(
    num_groups: int, configured_groups: int, rows_per_group: int, row_multiple: int, *, extra_rows: int = 0
) -> MiniBatchPlan:
    """``ceil(num_groups / configured_groups)`` mini-batches holding all groups and extra rows.

    ``groups_per_mini_batch * rows_per_group`` must divide by ``row_multiple``: the data-parallel
    size times the per-GPU micro-batch size (each rank takes an equal share of every mini-batch
    and cuts it into whole micro-batches; just the data-parallel size with dynamic batch sizes).
    The size is rounded up to the next value that satisfies it. Without extra rows the result
    never exceeds the configured size, which satisfies it already (verl requires it).
    """
    for name, value in (
        ("num_groups", num_groups),
        ("configured_groups", configured_groups),
        ("rows_per_group", rows_per_group),
        ("row_multiple", row_multiple),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(extra_rows, int) or extra_rows < 0:
        raise ValueError(f"extra_rows must be a non-negative integer, got {extra_rows!r}")
    if (configured_groups * rows_per_group) % row_multiple != 0:
        raise ValueError(
            f"ppo_mini_batch_size={configured_groups} groups x {rows_per_group} rows does not divide into "
            f"{row_multiple} (data-parallel size x micro-batch size per GPU)"
        )
    num_mini_batches = math.ceil(num_groups / configured_groups)
    real_rows = num_groups * rows_per_group + extra_rows
    groups = math.ceil(real_rows / (num_mini_batches * rows_per_group))
    while (groups * rows_per_group) % row_multiple != 0:
        groups += 1
    return MiniBatchPlan(num_groups, extra_rows, rows_per_group, num_mini_batches, groups, num_mini_batches * groups)


def stratified_order(categories: list[int], num_slices: int) -> list[int]:
    """A permutation of rows cut into ``num_slices`` equal consecutive slices (mini-batches) in
    which each category gets an even share of every slice.

    verl cuts each data-parallel rank's rows into consecutive mini-batches. Categories are placed
    in ascending order (0 = fresh GRPO rows first, padding last), each row into the slice holding
    the fewest rows of its category (then the fewest rows), so the first category is split
    exactly evenly (shares differ by at most one) and later ones as evenly as the remaining room
    allows. With fresh rows first, no optimiser step is made of replay or padding rows alone
    whenever there are at least as many fresh rows as slices. Returns indices into ``categories``.
    """
    if num_slices < 1 or len(categories) % num_slices:
        raise ValueError(f"{len(categories)} rows do not cut into {num_slices} equal slices")
    capacity = len(categories) // num_slices
    slices: list[list[int]] = [[] for _ in range(num_slices)]
    for category in sorted(set(categories)):
        in_slice = [0] * num_slices
        for index, row_category in enumerate(categories):
            if row_category != category:
                continue
            target = min(
                (s for s in range(num_slices) if len(slices[s]) < capacity),
                key=lambda s: (in_slice[s], len(slices[s]), s),
            )
            slices[target].append(index)
            in_slice[target] += 1
    return [index for members in slices for index in sorted(members)]
