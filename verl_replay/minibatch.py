"""Mini-batch plan for an update that carries replayed groups on top of the fresh batch.

verl splits an update into mini-batches of ``ppo_mini_batch_size`` groups (x n rows) and pads the
batch with synthetic rows up to a multiple of that size. Appending K replayed groups to G fresh
groups would then either leave a short last mini-batch full of padding, whose few real rows get a
whole optimiser step's weight, or need an extra padding-only step. The plan keeps the number of
optimiser steps verl would take for the enlarged batch, ``ceil((G + K) / m)``, and spreads the
groups evenly over them, so padding is at most one group per mini-batch and never fills one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MiniBatchPlan:
    num_groups: int  # real groups in the update (fresh + replayed)
    num_mini_batches: int  # optimiser steps of the update (per PPO epoch)
    groups_per_mini_batch: int  # the ppo_mini_batch_size to use for this update
    padded_groups: int  # num_mini_batches * groups_per_mini_batch

    @property
    def padding_groups(self) -> int:
        return self.padded_groups - self.num_groups


def plan_mini_batches(num_groups: int, configured_groups: int, rows_per_group: int, row_multiple: int) -> MiniBatchPlan:
    """Even split of ``num_groups`` groups into ``ceil(num_groups / configured_groups)`` mini-batches.

    ``groups_per_mini_batch * rows_per_group`` must divide by ``row_multiple``: the data-parallel
    size times the per-GPU micro-batch size (each rank takes an equal share of every mini-batch
    and cuts it into whole micro-batches; just the data-parallel size with dynamic batch sizes).
    The group count is rounded up to the next value that satisfies it; the configured size
    satisfies it already (verl requires it), so the result never exceeds it.
    """
    for name, value in (("num_groups", num_groups), ("configured_groups", configured_groups),
                        ("rows_per_group", rows_per_group), ("row_multiple", row_multiple)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    num_mini_batches = math.ceil(num_groups / configured_groups)
    groups = math.ceil(num_groups / num_mini_batches)
    while (groups * rows_per_group) % row_multiple != 0 and groups < configured_groups:
        groups += 1
    if (groups * rows_per_group) % row_multiple != 0:
        raise ValueError(
            f"ppo_mini_batch_size={configured_groups} groups x {rows_per_group} rows does not divide into "
            f"{row_multiple} (data-parallel size x micro-batch size per GPU)"
        )
    return MiniBatchPlan(num_groups, num_mini_batches, groups, num_mini_batches * groups)


def stratified_order(categories: list[int]) -> list[int]:
    """A permutation spreading each category evenly along the sequence.

    verl cuts each data-parallel rank's rows into consecutive mini-batches. Ordering the rows so
    that every category (fresh, replayed, elite, padding) sits at evenly spaced positions gives
    every mini-batch its proportional share of each, so no optimiser step is made of replay or
    padding rows alone. Row k of a category with c rows is placed at fractional position
    (k + 1/2) / c; ties keep category order. Returns indices into ``categories``.
    """
    by_category: dict[int, list[int]] = {}
    for index, category in enumerate(categories):
        by_category.setdefault(category, []).append(index)
    keyed = []
    for category, members in sorted(by_category.items()):
        count = len(members)
        keyed.extend(((k + 0.5) / count, category, index) for k, index in enumerate(members))
    return [index for _, _, index in sorted(keyed)]
