"""WorkspaceShrinkPolicy: the grow-only workspace's shrink rule (three underfilled forwards in a
window, reset by growth, a full or floor-sized workspace, or a shrink), branch by branch."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import MiB
from torch_budget.eager_workspace import WorkspaceShrinkPolicy


def underfilled(policy, *demands, capacity):
    """Feed forwards that need less than `capacity` and did not grow; return the results."""
    return [policy.finish_forward(d, capacity, False) for d in demands]


# -- construction ---------------------------------------------------------------------------


def test_new_policy_starts_with_an_empty_window_of_three():
    policy = WorkspaceShrinkPolicy(4 * MiB)
    assert (policy.floor, policy.remaining, policy.window_max) == (4 * MiB, 3, 0)


def test_negative_floor_is_rejected_naming_the_value():
    with pytest.raises(ValueError, match=r"floor_bytes \(bytes\) must be >= 0, got -1"):
        WorkspaceShrinkPolicy(-1)


@pytest.mark.parametrize("bad", [1.5, "4", None, True])
def test_non_integer_floor_is_rejected(bad):
    with pytest.raises(TypeError, match=r"floor_bytes \(bytes\) must be an integer"):
        WorkspaceShrinkPolicy(bad)


def test_zero_floor_is_allowed():
    assert WorkspaceShrinkPolicy(0).floor == 0


# -- finish_forward: invalid input ----------------------------------------------------------


def test_negative_required_is_rejected_naming_the_value():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    with pytest.raises(ValueError, match=r"required \(bytes\) must be >= 0, got -5"):
        policy.finish_forward(-5, 8 * MiB, False)


def test_capacity_below_required_is_rejected_naming_both_values():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    with pytest.raises(ValueError, match=rf"capacity {4 * MiB} is below max\(required={8 * MiB}, floor={MiB}\)"):
        policy.finish_forward(8 * MiB, 4 * MiB, False)


def test_capacity_below_floor_is_rejected_naming_both_values():
    policy = WorkspaceShrinkPolicy(8 * MiB)
    with pytest.raises(ValueError, match=rf"capacity {4 * MiB} is below max\(required={MiB}, floor={8 * MiB}\)"):
        policy.finish_forward(1 * MiB, 4 * MiB, False)


def test_invalid_input_leaves_the_window_untouched():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    underfilled(policy, 2 * MiB, capacity=8 * MiB)
    with pytest.raises(ValueError):
        policy.finish_forward(16 * MiB, 8 * MiB, False)
    assert (policy.remaining, policy.window_max) == (2, 2 * MiB)


def test_non_integer_required_or_capacity_is_rejected():
    policy = WorkspaceShrinkPolicy(0)
    with pytest.raises(TypeError, match=r"required \(bytes\) must be an integer"):
        policy.finish_forward(1.0, 8, False)
    with pytest.raises(TypeError, match=r"capacity \(bytes\) must be an integer"):
        policy.finish_forward(1, "8", False)


# -- finish_forward: branches ---------------------------------------------------------------


def test_forward_that_needed_nothing_neither_counts_nor_breaks_the_window():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    assert underfilled(policy, 3 * MiB, 0, 0, 2 * MiB, 0, capacity=8 * MiB) == [None] * 5
    assert (policy.remaining, policy.window_max) == (1, 3 * MiB)
    assert policy.finish_forward(1 * MiB, 8 * MiB, False) == 3 * MiB


def test_forward_that_grew_resets_the_window():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    underfilled(policy, 2 * MiB, 2 * MiB, capacity=8 * MiB)
    assert policy.finish_forward(4 * MiB, 16 * MiB, True) is None
    assert (policy.remaining, policy.window_max) == (3, 0)


def test_growth_resets_even_when_the_forward_used_less_than_the_new_capacity():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    underfilled(policy, 2 * MiB, 2 * MiB, capacity=8 * MiB)
    assert policy.finish_forward(2 * MiB, 8 * MiB, True) is None
    assert (policy.remaining, policy.window_max) == (3, 0)


def test_workspace_at_its_floor_resets_the_window():
    policy = WorkspaceShrinkPolicy(4 * MiB)
    underfilled(policy, 2 * MiB, 2 * MiB, capacity=8 * MiB)
    assert policy.finish_forward(1 * MiB, 4 * MiB, False) is None
    assert (policy.remaining, policy.window_max) == (3, 0)


def test_forward_that_filled_the_workspace_resets_the_window():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    underfilled(policy, 2 * MiB, 2 * MiB, capacity=8 * MiB)
    assert policy.finish_forward(8 * MiB, 8 * MiB, False) is None
    assert (policy.remaining, policy.window_max) == (3, 0)


def test_third_underfilled_forward_returns_the_largest_demand_of_the_window():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    assert underfilled(policy, 2 * MiB, 5 * MiB, 3 * MiB, capacity=64 * MiB) == [None, None, 5 * MiB]


def test_shrink_target_never_goes_below_the_floor():
    policy = WorkspaceShrinkPolicy(4 * MiB)
    assert underfilled(policy, 1 * MiB, 2 * MiB, 3 * MiB, capacity=64 * MiB) == [None, None, 4 * MiB]


def test_window_restarts_after_a_shrink():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    underfilled(policy, 2 * MiB, 2 * MiB, 2 * MiB, capacity=64 * MiB)
    assert (policy.remaining, policy.window_max) == (3, 0)
    assert underfilled(policy, 1 * MiB, 1 * MiB, capacity=8 * MiB) == [None, None]
    assert policy.finish_forward(1 * MiB, 8 * MiB, False) == 1 * MiB


def test_reset_empties_the_window():
    policy = WorkspaceShrinkPolicy(1 * MiB)
    underfilled(policy, 2 * MiB, 2 * MiB, capacity=64 * MiB)
    policy.reset()
    assert (policy.remaining, policy.window_max) == (3, 0)


# -- property: a simulated grow-only workspace ---------------------------------------------

forward = st.tuples(
    st.integers(min_value=0, max_value=1 << 12),  # bytes the forward needs
    st.integers(min_value=0, max_value=1 << 8),  # extra bytes the allocator hands out on growth
)


@settings(max_examples=400, deadline=None)
@given(floor=st.integers(min_value=0, max_value=1 << 11), forwards=st.lists(forward, max_size=60))
def test_simulated_workspace_never_drops_below_floor_nor_below_recent_demand(floor, forwards):
    policy = WorkspaceShrinkPolicy(floor)
    capacity = floor
    nonzero = []  # demands of forwards that needed something, oldest first
    for required, extra in forwards:
        grew = required > capacity
        if grew:
            capacity = required + extra
        if required:
            nonzero.append(required)
        before = capacity
        target = policy.finish_forward(required, capacity, grew)
        if target is not None:
            assert not grew
            assert target < before, "a shrink must return memory"
            capacity = target
            assert all(capacity >= d for d in nonzero[-3:]), (capacity, nonzero[-3:])
        assert capacity >= floor
