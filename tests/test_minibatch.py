import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_replay.minibatch import plan_mini_batches, stratified_order


def test_replay_adds_optimiser_steps_like_a_larger_batch():
    # b256 + r128 with mini-batches of 8 groups x 8: verl would take 6 steps for 48 groups
    plan = plan_mini_batches(num_groups=48, configured_groups=8, rows_per_group=8, row_multiple=2)
    assert (plan.num_mini_batches, plan.groups_per_mini_batch, plan.padding_rows) == (6, 8, 0)


def test_partial_fill_is_spread_not_padded_into_a_short_step():
    # 4 fresh + 1 replayed group, configured 4 groups per step: 2 steps of 3 groups, 1 group padding
    plan = plan_mini_batches(num_groups=5, configured_groups=4, rows_per_group=4, row_multiple=4)
    assert (plan.num_mini_batches, plan.groups_per_mini_batch, plan.padding_rows) == (2, 3, 4)


def test_rounds_up_to_micro_batch_multiple():
    plan = plan_mini_batches(num_groups=5, configured_groups=4, rows_per_group=4, row_multiple=8)
    assert plan.groups_per_mini_batch == 4 and plan.num_mini_batches == 2


def test_elite_rows_join_the_existing_steps():
    # one round of 8 fresh groups x 8 (one mini-batch) plus 32 elite rows: still one optimiser step
    plan = plan_mini_batches(num_groups=8, configured_groups=8, rows_per_group=8, row_multiple=2, extra_rows=32)
    assert (plan.num_mini_batches, plan.groups_per_mini_batch, plan.padding_rows) == (1, 12, 0)
    # 4 fresh groups x 4 and 4 elite rows over 2 steps of 12 rows (verl needs 8-row multiples: 2 x 16)
    plan = plan_mini_batches(num_groups=4, configured_groups=2, rows_per_group=4, row_multiple=8, extra_rows=4)
    assert (plan.num_mini_batches, plan.groups_per_mini_batch, plan.padding_rows) == (2, 4, 12)


def test_invalid_configuration_names_the_problem():
    with pytest.raises(ValueError, match="does not divide"):
        plan_mini_batches(num_groups=5, configured_groups=3, rows_per_group=1, row_multiple=4)
    with pytest.raises(ValueError, match="num_groups"):
        plan_mini_batches(num_groups=0, configured_groups=3, rows_per_group=1, row_multiple=1)
    with pytest.raises(ValueError, match="extra_rows"):
        plan_mini_batches(num_groups=1, configured_groups=3, rows_per_group=1, row_multiple=1, extra_rows=-1)


@settings(max_examples=300, deadline=None)
@given(
    num_groups=st.integers(1, 300),
    configured=st.integers(1, 64),
    rows=st.integers(1, 16),
    dp=st.sampled_from([1, 2, 4, 8]),
    micro=st.sampled_from([1, 2, 4]),
    extra=st.integers(0, 200),
)
def test_plan_never_has_a_step_without_real_rows(num_groups, configured, rows, dp, micro, extra):
    row_multiple = dp * micro
    if (configured * rows) % row_multiple:
        return  # verl refuses such a configuration itself
    plan = plan_mini_batches(num_groups, configured, rows, row_multiple, extra_rows=extra)
    # extra (elite) rows never change the number of optimiser steps
    assert plan.num_mini_batches == math.ceil(num_groups / configured)
    if extra == 0:
        assert plan.groups_per_mini_batch <= configured
    assert (plan.groups_per_mini_batch * rows) % row_multiple == 0
    assert plan.padding_rows >= 0
    # the smallest valid mini-batch that holds every real row
    real = num_groups * rows + extra
    for smaller in range(1, plan.groups_per_mini_batch):
        assert smaller * rows * plan.num_mini_batches < real or (smaller * rows) % row_multiple != 0


@settings(max_examples=300, deadline=None)
@given(data=st.data(), slices=st.integers(1, 8), size=st.integers(1, 16))
def test_stratified_order_spreads_fresh_rows_exactly(data, slices, size):
    categories = data.draw(st.lists(st.integers(0, 3), min_size=slices * size, max_size=slices * size))
    order = stratified_order(categories, slices)
    assert sorted(order) == list(range(len(categories)))
    arranged = [categories[i] for i in order]
    fresh = categories.count(min(categories))
    shares = [arranged[s * size : (s + 1) * size].count(min(categories)) for s in range(slices)]
    assert max(shares) - min(shares) <= 1 and sum(shares) == fresh
    if fresh >= slices:
        assert min(shares) >= 1  # every optimiser step has a fresh row


def test_stratified_order_example():
    # 8 fresh, 2 elite, 6 padding rows over 2 mini-batches of 8
    categories = [0] * 8 + [2] * 2 + [3] * 6
    arranged = [categories[i] for i in stratified_order(categories, 2)]
    assert arranged[:8].count(0) == 4 and arranged[:8].count(2) == 1 and arranged[:8].count(3) == 3
    with pytest.raises(ValueError, match="equal slices"):
        stratified_order([0, 0, 3], 2)
