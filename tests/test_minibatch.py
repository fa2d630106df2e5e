import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_replay.minibatch import plan_mini_batches, stratified_order


def test_replay_adds_optimiser_steps_like_a_larger_batch():
    # b256 + r128 with mini-batches of 8 groups x 8: verl would take 6 steps for 48 groups
    plan = plan_mini_batches(num_groups=48, configured_groups=8, rows_per_group=8, row_multiple=2)
    assert (plan.num_mini_batches, plan.groups_per_mini_batch, plan.padding_groups) == (6, 8, 0)


def test_partial_fill_is_spread_not_padded_into_a_short_step():
    # 4 fresh + 1 replayed group, configured 4 groups per step: 2 steps of 3 groups, 1 group padding
    plan = plan_mini_batches(num_groups=5, configured_groups=4, rows_per_group=4, row_multiple=4)
    assert (plan.num_mini_batches, plan.groups_per_mini_batch, plan.padding_groups) == (2, 3, 1)


def test_rounds_up_to_micro_batch_multiple():
    plan = plan_mini_batches(num_groups=5, configured_groups=4, rows_per_group=4, row_multiple=8)
    assert plan.groups_per_mini_batch == 4 and plan.num_mini_batches == 2


def test_invalid_configuration_names_the_problem():
    with pytest.raises(ValueError, match="does not divide"):
        plan_mini_batches(num_groups=5, configured_groups=3, rows_per_group=1, row_multiple=4)
    with pytest.raises(ValueError, match="num_groups"):
        plan_mini_batches(num_groups=0, configured_groups=3, rows_per_group=1, row_multiple=1)


@settings(max_examples=300, deadline=None)
@given(
    num_groups=st.integers(1, 300),
    configured=st.integers(1, 64),
    rows=st.integers(1, 16),
    dp=st.sampled_from([1, 2, 4, 8]),
    micro=st.sampled_from([1, 2, 4]),
)
def test_plan_never_has_a_step_without_real_groups(num_groups, configured, rows, dp, micro):
    row_multiple = dp * micro
    if (configured * rows) % row_multiple:
        return  # verl refuses such a configuration itself
    plan = plan_mini_batches(num_groups, configured, rows, row_multiple)
    assert plan.num_mini_batches == math.ceil(num_groups / configured)
    assert plan.groups_per_mini_batch <= configured
    assert (plan.groups_per_mini_batch * rows) % row_multiple == 0
    assert plan.padded_groups >= num_groups
    # the last mini-batch still holds at least one real group
    assert (plan.num_mini_batches - 1) * plan.groups_per_mini_batch < num_groups


@settings(max_examples=200, deadline=None)
@given(categories=st.lists(st.integers(0, 3), min_size=1, max_size=120), slices=st.integers(1, 8))
def test_stratified_order_spreads_every_category(categories, slices):
    order = stratified_order(categories)
    assert sorted(order) == list(range(len(categories)))
    if len(categories) % slices:
        return
    size = len(categories) // slices
    arranged = [categories[i] for i in order]
    for category in set(categories):
        total = categories.count(category)
        for s in range(slices):
            share = arranged[s * size : (s + 1) * size].count(category)
            # each slice gets floor or ceil of its proportional share (+-1)
            assert abs(share - total / slices) <= 1.0 + 1e-9
