import contextlib
import json
import math
import re

import pytest
import torch

from conftest import GiB, MiB
from torch_budget.units import format_bytes
from torch_budget.planner import (
    CacheCost,
    Plan,
    Profile,
    Reserve,
    WorkspaceReserve,
    attended_token_cap,
    plan,
    profile,
    workspace_reserve,
)

# --- CacheCost ---------------------------------------------------------------------------------


def test_tokens_for_budget_is_floor_of_budget_minus_intercept_over_slope():
    cost = CacheCost(slope=4096, intercept=1000)
    assert cost.tokens_for_budget(10 * 4096 + 1000) == 10
    assert cost.tokens_for_budget(10 * 4096 + 999) == 9
    assert cost.bytes_for_tokens(10) == 10 * 4096 + 1000


def test_tokens_for_a_tag_budget_are_the_most_whose_cache_the_allocator_charges_within_it():
    cost = CacheCost(slope=4096, intercept=1000)
    # the allocator charges whole 512-byte units: 41,960 bytes of cache are charged 41,984
    assert cost.charged_for_tokens(10) == 41984
    assert cost.tokens_for_tag_budget(41984) == 10
    assert cost.tokens_for_tag_budget(41983) == cost.tokens_for_tag_budget(10 * 4096 + 1000) == 9
    assert CacheCost(slope=0).tokens_for_tag_budget(1 << 30) == 0
    # each tensor of the cache is rounded up on its own
    per_layer = CacheCost(slope=4096, intercept=1000, tensors=4)   # four of 10,490 bytes: 10,752 each
    assert per_layer.charged_for_tokens(10) == 4 * 10752
    parts = CacheCost(slope=4096, intercept=1000, tensors=4, one_size=False)  # sizes unknown: 511 B each at most
    assert parts.charged_for_tokens(10) == (41960 + 4 * 511) // 512 * 512
    for cost in (per_layer, parts):
        for budget in range(40000, 50000, 37):  # the most tokens that fit, never one that does not
            t = cost.tokens_for_tag_budget(budget)
            assert cost.charged_for_tokens(t) <= budget < cost.charged_for_tokens(t + 1)


def test_tokens_for_budget_below_intercept_is_zero_not_negative():
    assert CacheCost(slope=4096, intercept=5 * MiB).tokens_for_budget(1 * MiB) == 0
    assert CacheCost(slope=4096).tokens_for_budget(-3 * GiB) == 0


@pytest.mark.parametrize("slope", [0, -4096])
def test_tokens_for_budget_is_zero_when_slope_not_positive(slope):
    assert CacheCost(slope=slope).tokens_for_budget(80 * GiB) == 0


def test_adding_costs_adds_slope_and_intercept_and_drops_policy_fields():
    kv = CacheCost(slope=4096, intercept=0, max_tokens_per_request=8192, policy="lru")
    state = CacheCost(slope=0, intercept=2 * MiB, max_tokens_per_request=1024, policy="pinned")
    total = kv + state
    # each cache's tensors are rounded apart, and they are not of one size
    assert total == CacheCost(slope=4096, intercept=2 * MiB, tensors=2, one_size=False)
    assert total.max_tokens_per_request is None and total.policy is None


def test_shard_changes_only_the_slope_and_keeps_policy_fields():
    cost = CacheCost(slope=4096, intercept=3 * MiB, max_tokens_per_request=8192, policy="lru")
    sharded = cost.shard(4)
    assert sharded == CacheCost(slope=1024, intercept=3 * MiB, max_tokens_per_request=8192, policy="lru")


def test_shard_rounds_slope_up_so_a_rank_never_undercounts():
    assert CacheCost(slope=10).shard(4).slope == 3


def test_shard_rejects_zero_ways():
    with pytest.raises(ValueError, match="ways"):
        CacheCost(slope=4096).shard(0)


def test_negative_intercept_is_rejected():
    with pytest.raises(ValueError, match="intercept"):
        CacheCost(slope=4096, intercept=-1)


@pytest.mark.parametrize("kwargs", [{"slope": float("nan")}, {"slope": 1024, "intercept": float("inf")}])
def test_a_cost_that_is_not_finite_is_rejected(kwargs):
    # accepted before; plan() then failed converting NaN to an integer
    with pytest.raises(ValueError, match="must be a finite number of bytes"):
        CacheCost(**kwargs)


# --- per-token workspace reserve ---------------------------------------------------------------


def test_workspace_reserve_splits_budget_in_proportion_when_cap_is_large():
    # k=3, w=1: a quarter of the budget goes to the workspace.
    assert workspace_reserve(3, 1, 1000, 10_000) == WorkspaceReserve(bytes=250, tokens=250)


def test_workspace_reserve_is_bounded_by_the_attended_token_cap():
    assert workspace_reserve(3, 2, 1000, 100) == WorkspaceReserve(bytes=200, tokens=100)


@pytest.mark.parametrize("k,w,b,cap", [(0, 1, 1000, 100), (3, 0, 1000, 100), (3, 1, 0, 100), (3, 1, 1000, 0),
                                       (-3, 1, 1000, 100), (3, -1, 1000, 100), (3, 1, -1000, 100), (3, 1, 1000, -5)])
def test_workspace_reserve_is_zero_for_any_non_positive_input(k, w, b, cap):
    assert workspace_reserve(k, w, b, cap) == WorkspaceReserve(0, 0)


def test_attended_token_cap_default_is_largest_batch_times_max_seq_len():
    assert attended_token_cap(max_batch=8, max_num_tokens=4096, max_seq_len=2048) == 8 * 2048
    assert attended_token_cap(max_batch=256, max_num_tokens=16, max_seq_len=2048) == 16 * 2048


def test_attended_token_cap_user_value_is_floored_at_max_seq_len():
    assert attended_token_cap(8, 4096, 2048, user_cap=100) == 2048
    assert attended_token_cap(8, 4096, 2048, user_cap=-5) == 2048


def test_attended_token_cap_user_value_is_capped_at_the_default():
    assert attended_token_cap(8, 4096, 2048, user_cap=10**9) == 8 * 2048


def test_attended_token_cap_user_value_in_range_is_kept():
    assert attended_token_cap(8, 4096, 2048, user_cap=5000) == 5000


def test_attended_token_cap_rejects_non_positive_scheduler_limits():
    with pytest.raises(ValueError, match="max_batch"):
        attended_token_cap(0, 4096, 2048)


# --- Profile arithmetic --------------------------------------------------------------------------


def test_profile_derives_activations_extra_cost_allocator_cache_and_peak():
    p = Profile.from_measurements(torch_peak=20 * GiB, torch_used=21 * GiB, total_used=22 * GiB,
                                  total=80 * GiB, model_bytes=16 * GiB)
    assert p.activation_bytes == 4 * GiB
    assert p.extra_cost == 1 * GiB
    assert p.allocator_cache == 1 * GiB
    # What the device held at the peak: torch's peak, what its allocator cached, what is outside torch.
    assert p.peak == 22 * GiB == p.total_used


def test_profile_extra_cost_is_never_negative():
    p = Profile.from_measurements(torch_peak=20 * GiB, torch_used=21 * GiB, total_used=20 * GiB,
                                  total=80 * GiB, model_bytes=16 * GiB)
    assert p.extra_cost == 0 and p.peak == 21 * GiB


def test_profile_allocator_cache_is_never_negative():
    # Reserved below the allocated peak (an allocator that gave memory back after the peak).
    p = Profile.from_measurements(torch_peak=20 * GiB, torch_used=19 * GiB, total_used=20 * GiB,
                                  total=80 * GiB, model_bytes=16 * GiB)
    assert p.allocator_cache == 0 and p.extra_cost == 1 * GiB and p.peak == 21 * GiB


def test_profile_rejects_peak_below_weights():
    with pytest.raises(ValueError, match="below model_bytes"):
        Profile.from_measurements(torch_peak=1 * GiB, torch_used=1 * GiB, total_used=1 * GiB,
                                  total=80 * GiB, model_bytes=16 * GiB)


# --- plan: the seven steps -----------------------------------------------------------------------

COST = CacheCost(slope=128 * 1024, max_tokens_per_request=8192)


def base_profile(**overrides):
    values = dict(torch_peak=20 * GiB, torch_used=21 * GiB, total_used=22 * GiB, total=80 * GiB, model_bytes=16 * GiB)
    values.update(overrides)
    return Profile.from_measurements(**values)


def expected_ledger(*, kv: int, held_back: int, **lines) -> dict:
    """The ledger a plan of base_profile() must show, from this test's own arithmetic: weights are
    the model's 16 GiB, activations the torch peak minus weights (20 - 16), non-torch the device's
    used minus torch's reserved (22 - 21), the allocator cache torch's reserved minus its peak
    (21 - 20), so a peak of 22 GiB; then the lines a test adds (or overrides), the KV pool, and as
    headroom what the planner held back (the 1 - fraction margin, caps)."""
    return {"weights": 16 * GiB, "activations": 4 * GiB, "non-torch": 1 * GiB, "allocator cache": 1 * GiB, **lines,
            "KV pool": kv, "headroom": held_back}


def check_ledger(p: Plan, expected: dict):
    """Every line as expected, and the expectation itself accounts for the whole card: headroom is
    not taken as the remainder here, so a line the planner got wrong cannot be absorbed by it."""
    assert {line.name: line.bytes for line in p.lines} == expected
    assert sum(expected.values()) == p.total == 80 * GiB


def test_plan_available_is_fraction_of_card_minus_peak():
    p = plan(base_profile(), COST)
    kv = math.floor((80 - 22) * GiB * 0.9)
    assert p.kv_bytes == kv
    assert p.kv_tokens == kv // (128 * 1024)
    check_ledger(p, expected_ledger(kv=kv, held_back=(80 - 22) * GiB - kv))


def test_plan_memory_outside_torch_lowers_the_budget():
    more = plan(base_profile(total_used=24 * GiB), COST)
    assert more.line("non-torch").bytes == 3 * GiB
    assert more.kv_bytes == math.floor((80 - 24) * GiB * 0.9)


def test_plan_reserves_beside_the_peak_are_scaled_by_fraction():
    p = plan(base_profile(), COST, beside_peak=[Reserve("penalty table", 2 * GiB, "first request only")])
    kv = math.floor((80 - 22 - 2) * GiB * 0.9)
    assert p.kv_bytes == kv
    check_ledger(p, expected_ledger(**{"penalty table": 2 * GiB}, kv=kv, held_back=(80 - 22 - 2) * GiB - kv))


def test_reserve_increment_reserves_only_what_a_config_adds():
    assert Reserve.increment("penalty", profiled_bytes=1 * GiB, needed_bytes=3 * GiB, reason="r").bytes == 2 * GiB
    assert Reserve.increment("penalty", profiled_bytes=3 * GiB, needed_bytes=1 * GiB, reason="r").bytes == 0


def test_plan_gives_estimation_kv_back():
    p = plan(base_profile(), COST, estimation_kv_bytes=2 * GiB)
    kv = math.floor((80 - 22 + 2) * GiB * 0.9)
    assert p.kv_bytes == kv
    # The estimation KV is not charged to activations on the ledger.
    check_ledger(p, expected_ledger(activations=4 * GiB - 2 * GiB, kv=kv, held_back=(80 - 22 + 2) * GiB - kv))


def test_plan_fraction_one_gives_everything_past_the_peak():
    assert plan(base_profile(), COST, fraction=1.0).kv_bytes == (80 - 22) * GiB


@pytest.mark.parametrize("fraction,error", [(0, ValueError), (-0.1, ValueError), (1.5, ValueError),
                                            (True, TypeError), ("0.5", TypeError)])
def test_plan_rejects_a_fraction_outside_the_unit_interval_or_of_the_wrong_type(fraction, error):
    with pytest.raises(error, match="fraction"):
        plan(base_profile(), COST, fraction=fraction)


def test_plan_names_a_kv_cost_that_is_not_a_cache_cost():
    # plan(profile, 1024), bytes per token for a CacheCost, raised AttributeError 'tokens_for_budget'
    with pytest.raises(TypeError, match=r"kv_cost must be a CacheCost, got int: .*CacheCost\(slope=1024\)"):
        plan(base_profile(), 1024)


@pytest.mark.parametrize("text,match", [
    ('{"total": 1}', "it lacks 'fraction', 'kv_bytes', 'kv_cost'"), ("[1]", "JSON object"),
    ('{"total": 1, "nope": 2}', "unknown key"),
])
def test_a_plan_file_that_is_not_one_is_named(text, match):
    with pytest.raises(ValueError, match=match):   # KeyError: 'kv_cost' before
        Plan.from_json(text)


def test_plan_reserves_from_kv_are_subtracted_in_full():
    p = plan(base_profile(), COST, from_kv=[Reserve("decode graphs", 3 * GiB, "captured after KV", "graph_pools")])
    available = math.floor((80 - 22) * GiB * 0.9)
    assert p.kv_bytes == available - 3 * GiB
    assert p.bytes_in("graph_pools") == 3 * GiB
    check_ledger(p, expected_ledger(**{"decode graphs": 3 * GiB}, kv=available - 3 * GiB,
                                    held_back=(80 - 22) * GiB - available))


def test_plan_per_token_workspace_uses_the_shared_split():
    w, k = 8 * 1024, 128 * 1024
    p = plan(base_profile(), COST, workspace_bytes_per_token=w, max_batch=64, max_num_tokens=4096, max_seq_len=8192)
    available = math.floor((80 - 22) * GiB * 0.9)
    # min(w * L, B * w / (k + w)) with L = min(64, 4096) * 8192: here the proportional split is smaller.
    # (rounded down to whole tokens)
    reserve = min(w * 64 * 8192, available * w // (k + w)) // w * w
    assert reserve == available * w // (k + w) // w * w > 0
    assert p.kv_bytes == available - reserve
    assert p.workspace_tokens == reserve // w
    check_ledger(p, expected_ledger(**{"per-token workspace": reserve}, kv=available - reserve,
                                    held_back=(80 - 22) * GiB - available))


def test_plan_per_token_workspace_takes_max_seq_len_from_the_cache_cost():
    a = plan(base_profile(), COST, workspace_bytes_per_token=8 * 1024, max_batch=2, max_num_tokens=4096)
    b = plan(base_profile(), COST, workspace_bytes_per_token=8 * 1024, max_batch=2, max_num_tokens=4096, max_seq_len=8192)
    assert a.kv_bytes == b.kv_bytes and a.workspace_tokens == 2 * 8192


def test_plan_per_token_workspace_needs_scheduler_limits():
    with pytest.raises(ValueError, match="max_batch"):
        plan(base_profile(), COST, workspace_bytes_per_token=8 * 1024)


def test_plan_byte_cap_lowers_the_budget():
    p = plan(base_profile(), COST, max_kv_bytes=10 * GiB)
    assert p.kv_bytes == 10 * GiB
    # Held back: the 1 - fraction margin and what the cap took, together all that is past the peak.
    check_ledger(p, expected_ledger(kv=10 * GiB, held_back=(80 - 22) * GiB - 10 * GiB))


def test_plan_token_cap_is_converted_to_bytes_with_the_cache_cost():
    p = plan(base_profile(), COST, max_kv_tokens=1000)
    assert p.kv_bytes == COST.bytes_for_tokens(1000)
    assert p.kv_tokens == 1000


def test_plan_caps_never_raise_the_budget():
    full = plan(base_profile(), COST)
    p = plan(base_profile(), COST, max_kv_bytes=1000 * GiB, max_kv_tokens=10**9)
    assert p.kv_bytes == full.kv_bytes


def test_plan_rejects_negative_caps():
    with pytest.raises(ValueError, match="max_kv_bytes"):
        plan(base_profile(), COST, max_kv_bytes=-1)


def test_plan_single_process_is_its_own_min():
    p = plan(base_profile(), COST)
    assert p.world_size == 1 and p.steps[-1].kv_bytes == p.kv_bytes


def test_plan_clamps_negative_budget_to_zero_and_reports_overcommit():
    p = plan(base_profile(torch_peak=79 * GiB, torch_used=79 * GiB, total_used=82 * GiB), COST)
    assert p.kv_bytes == 0 and p.kv_tokens == 0
    assert "OVER-COMMITTED" in p.line("headroom").reason
    # activations 79 - 16, non-torch 82 - 79, no allocator cache; the peak of 82 GiB exceeds the card by 2.
    check_ledger(p, expected_ledger(activations=63 * GiB, **{"non-torch": 3 * GiB, "allocator cache": 0}, kv=0,
                                    held_back=-2 * GiB))


def test_plan_clamps_when_reserves_from_kv_exceed_what_is_available():
    p = plan(base_profile(), COST, from_kv=[Reserve("huge", 100 * GiB, "too big")])
    assert p.kv_bytes == 0
    assert "OVER-COMMITTED" in p.line("headroom").reason


def test_reserves_past_the_kv_budget_are_said_to_come_out_of_the_margin():
    # (80 - 22) GiB available before the fraction; 0.9 of it for the KV budget, the rest the margin
    raw = (80 - 22) * GiB
    available = math.floor(raw * 0.9)
    p = plan(base_profile(), COST, from_kv=[Reserve("graphs", available + 2 * GiB, "measured", "graph_pools")])
    assert p.kv_bytes == 0
    step5 = next(s for s in p.steps if s.step == 5)
    assert "2.00 GiB more than is available" in step5.note
    headroom = p.line("headroom")
    assert headroom.bytes == raw - available - 2 * GiB > 0
    assert headroom.reason.startswith(f"left unplanned: 1-fraction margin {format_bytes(headroom.bytes)}")
    assert "exceed it by 2.00 GiB, taken from the 1-fraction margin" in headroom.reason


def test_a_fractional_slope_gives_whole_bytes_that_read_back():
    p = plan(base_profile(), CacheCost(slope=1536.5), max_kv_tokens=1000)
    assert p.kv_bytes == 1536512 and isinstance(p.kv_bytes, int)  # 1,536,500 B charged in 512 B units
    assert CacheCost(slope=0.5).bytes_for_tokens(3) == 2  # rounded up: never under-counts
    assert Plan.from_json(p.to_json()).kv_bytes == p.kv_bytes


def test_plan_steps_trace_each_stage_of_the_budget():
    p = plan(base_profile(), COST, from_kv=[Reserve("g", 1 * GiB, "r", "graph_pools")], max_kv_bytes=20 * GiB)
    by_step = {s.step: s.kv_bytes for s in p.steps}
    assert [s.step for s in p.steps] == [1, 2, 3, 4, 5, 6, 7]
    assert by_step[4] - by_step[5] == 1 * GiB
    assert by_step[6] == 20 * GiB == p.kv_bytes


def test_plan_splits_eager_workspace_out_of_activations():
    p = plan(base_profile(), COST, eager_workspace_in_peak=512 * MiB)
    kv = math.floor((80 - 22) * GiB * 0.9)
    check_ledger(p, expected_ledger(activations=4 * GiB - 512 * MiB, **{"eager workspace": 512 * MiB}, kv=kv,
                                    held_back=(80 - 22) * GiB - kv))


# --- the allocator cache: what torch reserved beyond its peak -----------------------------------


def test_a_cached_slack_gets_its_own_line_and_the_kv_budget_shrinks_by_exactly_it():
    # The same forward profiled twice: once on an allocator that reserves nothing beyond what it
    # allocates (the torch peak), once with 140 MiB cached beside it (what llama-3.2-1b's profile
    # held on an H200). Outside torch, 1 GiB both times.
    slack = 140 * MiB
    native = plan(base_profile(torch_used=20 * GiB, total_used=21 * GiB), COST, fraction=1.0)
    cached = plan(base_profile(torch_used=20 * GiB + slack, total_used=21 * GiB + slack), COST, fraction=1.0)
    line = cached.line("allocator cache")
    assert (line.category, line.bytes) == ("allocator_cache", slack) and cached.bytes_in("allocator_cache") == slack
    assert line.reason == "allocator's cached memory at the profiled peak: torch reserved minus torch peak"
    assert native.kv_bytes - cached.kv_bytes == slack
    for p, used in ((native, 21 * GiB), (cached, 21 * GiB + slack)):
        assert sum(l.bytes for l in p.lines) == p.total
        # Every line but the KV pool and headroom is what the device held at the profiled peak.
        assert sum(l.bytes for l in p.lines if l.category not in ("kv_pool", "headroom")) == used
        assert p.line("headroom").bytes == 0  # fraction 1, no caps: the KV pool takes all the rest
    # The line sits after non-torch, and every other line is the same in both plans.
    names = [l.name for l in cached.lines]
    assert names.index("allocator cache") == names.index("non-torch") + 1
    assert ({l.name: l.bytes for l in native.lines if l.name not in ("allocator cache", "KV pool")}
            == {l.name: l.bytes for l in cached.lines if l.name not in ("allocator cache", "KV pool")})
    assert "allocator cache 140.0 MiB" in cached.steps[1].note


def test_the_allocator_cache_is_charged_before_the_fraction_like_the_rest_of_the_peak():
    slack = 140 * MiB
    cached = plan(base_profile(torch_used=20 * GiB + slack, total_used=21 * GiB + slack), COST)
    assert cached.kv_bytes == math.floor((80 * GiB - 21 * GiB - slack) * 0.9)
    check_ledger(cached, expected_ledger(**{"allocator cache": slack}, kv=cached.kv_bytes,
                                         held_back=80 * GiB - 21 * GiB - slack - cached.kv_bytes))


def test_a_native_style_profile_with_reserved_equal_to_allocated_shows_a_zero_line():
    # Shown like non-torch (the profile's other derived line), not left out: a zero says it was read.
    p = plan(base_profile(torch_used=20 * GiB, total_used=21 * GiB), COST)
    assert p.line("allocator cache").bytes == 0 == p.bytes_in("allocator_cache")
    assert sum(l.bytes for l in p.lines) == p.total
    assert "allocator cache" in p.to_text()
    assert Plan.from_json(p.to_json()) == p


def test_the_allocator_cache_is_no_reserve_category():
    with pytest.raises(ValueError, match="reservable"):
        Reserve("fragmentation", 1 * GiB, "expected", "allocator_cache")


def test_the_h200_profiles_predict_the_device_peak_they_measured():
    # tools/plan_hf.py's prediction on the profiles it measured on an H200 (torch peak, torch
    # reserved, device used as printed, in MiB; weights and StaticCache bytes from each shape): the
    # planned worst case is the profiled one, its cache the estimation KV, so the device-wide
    # prediction is the profile's device used (the serving processes measured 9.16, 28.43 and
    # 33.80 GiB against 9.16, 28.29 and 33.80 profiled). Before the allocator cache line it also
    # left out what the allocator cached (140, 90 and 130 MiB) and missed by up to 1.6 %.
    from torch_budget.planner import hf_plan

    card = 143_771 * MiB
    for torch_peak, reserved, used, weights, cache in (
            (8540 * MiB, 8680 * MiB, 9380 * MiB, 2357 * MiB, 4096 * MiB),
            (28180 * MiB, 28270 * MiB, 28970 * MiB, 7672 * MiB, 18432 * MiB),
            (33780 * MiB, 33910 * MiB, 34610 * MiB, 15316 * MiB, 16384 * MiB)):
        prof = Profile.from_measurements(torch_peak=torch_peak, torch_used=reserved, total_used=used, total=card,
                                         model_bytes=weights)
        p = plan(prof, COST, estimation_kv_bytes=cache, max_kv_bytes=cache)
        allocated, device = hf_plan.predicted_peaks(p, cache)
        assert allocated == torch_peak
        assert device == used == prof.peak
        assert p.bytes_in("allocator_cache") == reserved - torch_peak
        assert sum(l.bytes for l in p.lines) == card


def test_plan_rejects_estimation_kv_larger_than_activations():
    with pytest.raises(ValueError, match="estimation_kv_bytes"):
        plan(base_profile(), COST, estimation_kv_bytes=5 * GiB)


def test_plan_json_round_trip_is_exact():
    p = plan(base_profile(), COST, from_kv=[Reserve("g", 1 * GiB, "r", "graph_pools")], max_kv_tokens=5000)
    again = Plan.from_json(p.to_json())
    assert again == p


def test_plan_text_names_every_line_and_the_token_count():
    p = plan(base_profile(), COST, beside_peak=[Reserve("encoder outputs", 1 * GiB, "vision tower")])
    text = p.to_text()
    for line in p.lines:
        assert line.name in text
    assert f"{p.kv_tokens} tokens" in text


def test_plan_notes_must_name_an_existing_line():
    with pytest.raises(ValueError, match="no-such-line"):
        plan(base_profile(), COST, notes={"no-such-line": "x"})


# --- profile() -----------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device error")
def test_profile_without_cuda_says_what_to_do_instead():
    with pytest.raises(RuntimeError, match="from_measurements"):
        profile(lambda: None, model_bytes=0)


def test_profile_releases_cache_and_resets_peak_before_the_forward(monkeypatch):
    # Stand-in for the public torch.cuda calls, recording their order.
    calls = []
    stats = {"allocated_bytes.all.peak": 20 * GiB, "reserved_bytes.all.current": 21 * GiB}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset_peak"))
    monkeypatch.setattr(cuda, "memory_stats", lambda *a: calls.append("stats") or stats)
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a: calls.append("mem_get_info") or (58 * GiB, 80 * GiB))

    p = profile(lambda x: calls.append(f"forward {x}"), 7, model_bytes=16 * GiB)
    assert calls == ["sync", "empty_cache", "reset_peak", "forward 7", "sync", "stats", "mem_get_info"]
    assert (p.torch_peak, p.torch_used, p.total_used, p.total) == (20 * GiB, 21 * GiB, 22 * GiB, 80 * GiB)
    assert (p.activation_bytes, p.extra_cost, p.allocator_cache, p.peak) == (4 * GiB, 1 * GiB, 1 * GiB, 22 * GiB)


def test_profile_names_missing_allocator_statistics(monkeypatch):
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "device", lambda d: contextlib.nullcontext())
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(cuda, name, lambda *a: None)
    monkeypatch.setattr(cuda, "memory_stats", lambda *a: {})
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (1 * GiB, 2 * GiB))
    monkeypatch.setattr(cuda, "get_allocator_backend", lambda: "pluggable")
    with pytest.raises(RuntimeError, match="allocated_bytes.all.peak"):
        profile(lambda: None, model_bytes=0)


@pytest.mark.gpu
def test_profile_measures_a_real_forward_on_the_device():
    weights = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")

    def forward():
        scratch = torch.ones(32 * MiB, dtype=torch.uint8, device="cuda")
        return int(scratch.sum().item())

    p = profile(forward, model_bytes=weights.numel())
    free, total = torch.cuda.mem_get_info()
    assert p.total == total
    assert p.activation_bytes >= 32 * MiB
    assert p.peak >= p.torch_peak >= 96 * MiB


def test_workspace_reserve_holds_whole_tokens_only():
    # 10**15 B per attended token out of 10**6: no token fits, so nothing is reserved
    assert workspace_reserve(4096, 10**15, 10**6, 8) == WorkspaceReserve(0, 0)
    assert workspace_reserve(3, 7, 1000, 10_000) == WorkspaceReserve(bytes=700, tokens=100)


def test_bad_plan_input_is_refused_naming_what_is_wrong():
    from torch_budget.planner.ledger import LedgerLine

    p = plan(base_profile(), COST, max_kv_bytes=20 * GiB)
    for mutate, words in [(lambda d: d.update(total="80GiB"), "the plan's total must be an integer"),
                          (lambda d: d.update(lines=[x for x in d["lines"] if x["category"] != "kv_pool"]),
                           "0 KV pool line(s)"),
                          (lambda d: d.update(kv_bytes=d["kv_bytes"] + 1), "1 KV pool line(s) where a plan has one, "
                                                                            "of its kv_bytes")]:
        d = json.loads(p.to_json())
        mutate(d)
        with pytest.raises(ValueError, match=re.escape(words)):
            Plan.from_dict(d)
    with pytest.raises(TypeError, match="bytes are a whole number"):
        LedgerLine("weights", "weights", 1.5, "a fraction of a byte")
    with pytest.raises(TypeError, match=r"beside_peak is a list of Reserve, and holds int"):
        plan(base_profile(), COST, beside_peak=[MiB])
    with pytest.raises(TypeError, match=r"from_kv is a list of Reserve; got one Reserve: write from_kv=\[Reserve"):
        plan(base_profile(), COST, from_kv=Reserve("g", MiB, "r", "graph_pools"))
    with pytest.raises(TypeError, match="tags maps ledger categories to tags, as a dict"):
        p.tag_budgets(["kv_pool"])
    with pytest.raises(TypeError, match="to a tag"):
        p.tag_budgets({"kv_pool": 3})


def test_numpy_byte_counts_are_whole_numbers_too():
    np = pytest.importorskip("numpy")
    from torch_budget.planner.ledger import LedgerLine

    p = plan(base_profile(), COST, beside_peak=[Reserve("encoder", np.int64(MiB), "numpy")])
    assert p.line("encoder").bytes == MiB and type(p.line("encoder").bytes) is int
    assert type(LedgerLine("weights", "weights", np.int64(5), "numpy").bytes) is int


def test_numpy_caps_leave_a_plan_that_writes_to_json():
    np = pytest.importorskip("numpy")
    p = plan(base_profile(), COST, max_kv_bytes=np.int64(20 * GiB), kv_shards=np.int64(2))
    assert Plan.from_json(p.to_json()).kv_bytes == p.kv_bytes
