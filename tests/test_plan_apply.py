"""Plan.apply(): a plan's lines become per-tag budgets inside the device budget (Note [Plan as
budgets]), enforced by the core over the host stand-in; what it set can be undone; a plan that
does not fit is refused before anything is set."""
import pytest
import torch

import torch_budget
from _hostcore import MiB, Host, isolated, python_api_over
from torch_budget import planner
from torch_budget.errors import NotInstalledError, PlanDoesNotFitError, StateError
from torch_budget.planner import CacheCost, Profile, Reserve

CARD = 4 << 30  # the host stand-in's device


def sample_plan(total=CARD, non_torch=3 * MiB, allocator_cache=0):
    """weights 16 MiB, activations 8, eager workspace 4, graph pools 8 + static buffers 2, KV 32
    (capped), a 1 MiB reserve beside the peak that no tag holds, non-torch and what the allocator
    cached beyond the torch peak as given."""
    reserved = 28 * MiB + allocator_cache
    prof = Profile.from_measurements(torch_peak=28 * MiB, torch_used=reserved, total_used=reserved + non_torch,
                                     total=total, model_bytes=16 * MiB)
    return planner.plan(prof, CacheCost(slope=4096), eager_workspace_in_peak=4 * MiB, max_kv_bytes=32 * MiB,
                        beside_peak=[Reserve("encoder outputs", 1 * MiB, "not profiled")],
                        from_kv=[Reserve("decode graph pools", 8 * MiB, "measured", "graph_pools"),
                                 Reserve("decode static buffers", 2 * MiB, "measured", "graph_workspace")])


EXPECTED = {"weights": 16 * MiB, "activations": 8 * MiB, "workspace": 4 * MiB, "graphs": 10 * MiB, "kv": 32 * MiB}


def budgets_now():
    return {tag: entry["budget"] for tag, entry in torch_budget.stats()["by_tag"].items()}


def installed_host(**install):
    host = Host(configure=False)
    python_api_over(host)
    torch_budget.install(**{"route": "vmm", **install})
    return host


def under(host, tag, nbytes):
    with torch_budget.region(tag):
        return host.malloc(nbytes)


def test_tag_budgets_are_the_plans_lines_summed_per_tag():
    p = sample_plan()
    assert p.tag_budgets() == EXPECTED
    # non-torch, the allocator cache, the reserve no component holds and the headroom are no tag's
    assert sum(EXPECTED.values()) == p.total - sum(p.bytes_in(c) for c in planner.apply.UNBUDGETED)
    assert p.tag_budgets({"kv_pool": "cache", "weights": "params"}) == {"cache": 32 * MiB, "params": 16 * MiB}
    with pytest.raises(ValueError, match="not among"):
        p.tag_budgets({"kv": "kv"})


def test_the_allocator_cache_is_no_tags_budget():
    p = sample_plan(allocator_cache=2 * MiB)
    assert p.bytes_in("allocator_cache") == 2 * MiB
    assert p.tag_budgets() == EXPECTED  # the KV line is capped at 32 MiB, so no budget changes
    assert "allocator_cache" in planner.apply.UNBUDGETED and "allocator_cache" not in planner.apply.TAGS
    assert sum(EXPECTED.values()) == p.total - sum(p.bytes_in(c) for c in planner.apply.UNBUDGETED)
    # Every category is a tag's or no tag's, never both.
    assert set(planner.apply.TAGS) | set(planner.apply.UNBUDGETED) == set(planner.CATEGORIES)
    assert not set(planner.apply.TAGS) & set(planner.apply.UNBUDGETED)


def test_the_demos_tags_are_the_planners():
    from torch_budget.demo import settings
    from torch_budget.demo.kv_resource import PagedKVResource
    from torch_budget.eager_workspace import WORKSPACE_TAG
    from torch_budget.graphs.resource import GRAPHS_TAG
    from torch_budget.workspace_resource import WorkspaceResource

    tags = planner.TAGS
    assert (tags["weights"], tags["kv_pool"], tags["graph_pools"], tags["activations"], tags["eager_workspace"]) == (
        settings.TAG_WEIGHTS, settings.TAG_KV, settings.TAG_GRAPHS, settings.TAG_ACTIVATIONS, WORKSPACE_TAG)
    assert tags["graph_workspace"] == GRAPHS_TAG == settings.TAG_GRAPHS
    # the resource managers charge their memory to the tags the plan bounds
    import inspect

    assert inspect.signature(PagedKVResource).parameters["tag"].default == tags["kv_pool"]
    assert WorkspaceResource.tag == tags["eager_workspace"]


def test_apply_needs_install():
    if torch_budget.installed():
        pytest.skip("this process has torch_budget installed")
    with pytest.raises(NotInstalledError, match=r"Plan.apply\(\) needs torch_budget.install\(\) first"):
        sample_plan().apply()


@pytest.mark.built("_host_core")
@isolated
def test_an_allocation_past_its_line_fails_naming_its_tag_while_the_other_tags_keep_serving():
    host = installed_host(budget="128MiB")
    weights = under(host, "weights", 16 * MiB)  # loaded before planning, as a server does
    applied = sample_plan().apply()
    assert applied.budgets == EXPECTED and applied.devices == (0,)
    assert {t: b for t, b in budgets_now().items() if b is not None} == EXPECTED
    kv = [under(host, "kv", 24 * MiB), under(host, "kv", 8 * MiB)]  # exactly the KV line
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        under(host, "kv", 4096)
    assert "tag 'kv' would exceed its budget of 32.00 MiB" in str(raised.value), str(raised.value)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="tag 'weights'"):
        under(host, "weights", 4096)
    act = under(host, "activations", 8 * MiB)  # the other tags serve up to their own lines
    graphs = under(host, "graphs", 10 * MiB)
    assert torch_budget.stats()["by_tag"]["kv"]["headroom"] == 0
    for p in (weights, *kv, act, graphs):
        host.free(p)


@pytest.mark.built("_host_core")
@isolated
def test_undo_puts_back_the_budgets_apply_replaced():
    host = installed_host()
    torch_budget.set_budget("64MiB", tag="kv")
    with sample_plan().apply() as applied:
        assert budgets_now()["kv"] == 32 * MiB
        assert applied.previous == {0: {"weights": None, "activations": None, "workspace": None, "graphs": None,
                                        "kv": 64 * MiB}}
    now = budgets_now()
    assert now["kv"] == 64 * MiB and all(now[t] is None for t in EXPECTED if t != "kv"), now
    assert under(host, "weights", 20 * MiB)  # past the plan's line: no budget any more
    applied.undo()  # idempotent
    assert budgets_now()["kv"] == 64 * MiB


@pytest.mark.built("_host_core")
@isolated
def test_a_second_block_of_one_applied_plan_raises_instead_of_running_without_its_budgets():
    # __enter__ returned the plan whatever its state: a block entered inside the first ran on without
    # the budgets once the inner one ended, and one entered after the first (or after undo()) ran
    # without them from its start.
    host = installed_host()
    applied = sample_plan().apply()
    with applied:
        with pytest.raises(StateError, match="were entered in a block already"):
            with applied:
                pytest.fail("entered twice")
        assert budgets_now()["weights"] == 16 * MiB, "the refused inner block undid the plan"
    with pytest.raises(StateError, match="were undone"):
        with applied:
            pytest.fail("entered after its block ended")
    undone = sample_plan().apply()
    undone.undo()
    with pytest.raises(StateError, match="were undone"):
        with undone:
            pytest.fail("entered after undo()")
    assert all(budgets_now()[t] is None for t in EXPECTED)
    applied.__exit__(None, None, None)  # the end of a block is undo(): idempotent
    host.free(under(host, "weights", 20 * MiB))


@pytest.mark.built("_host_core")
@isolated
def test_an_undo_one_tag_refuses_puts_every_other_back_and_can_be_done_later():
    host = installed_host()
    torch_budget.set_budget("8MiB", tag="weights")
    torch_budget.set_budget("64MiB", tag="kv")
    applied = sample_plan().apply()
    w = under(host, "weights", 12 * MiB)  # within the plan's 16 MiB line, past the old 8 MiB
    with pytest.raises(torch_budget.errors.TorchBudgetError) as raised:
        applied.undo()
    assert "'weights' on device 0 stayed" in "".join(raised.value.__notes__)
    now = budgets_now()
    assert now["kv"] == 64 * MiB and now["weights"] == 16 * MiB and not applied.undone
    assert all(now[t] is None for t in ("activations", "workspace", "graphs")), now
    host.free(w)
    applied.undo()
    assert budgets_now()["weights"] == 8 * MiB and applied.undone


@pytest.mark.built("_host_core")
@isolated
def test_a_blocks_own_exception_is_not_replaced_by_a_failed_undo():
    host = installed_host()
    torch_budget.set_budget("8MiB", tag="weights")
    with pytest.raises(KeyError) as raised:
        with sample_plan().apply():
            under(host, "weights", 12 * MiB)
            raise KeyError("the body's own")
    assert "undoing the plan's budgets failed" in "".join(raised.value.__notes__)


@pytest.mark.built("_host_core")
@isolated
def test_a_plan_applied_to_all_devices_before_any_serves_says_it_names_none():
    host = installed_host()
    with pytest.raises(ValueError, match="no device serves allocations yet"):
        sample_plan().apply(device="all")
    host.free(host.malloc(1 * MiB))
    assert sample_plan().apply(device="all").devices == (0,)
    assert budgets_now()["kv"] == 32 * MiB


@pytest.mark.built("_host_core")
@isolated
def test_a_plan_larger_than_the_device_budget_is_refused_and_sets_nothing():
    installed_host(budget="48MiB")
    with pytest.raises(PlanDoesNotFitError) as raised:
        sample_plan().apply()
    message = str(raised.value)
    for words in ("the plan does not fit device 0: the tag budgets in force would add up to 70.0 MiB",
                  "weights 16.0 MiB", "kv 32.0 MiB", "22.0 MiB more than its budget of 48.0 MiB",
                  "torch_budget.set_budget"):
        assert words in message, (words, message)
    assert all(b is None for b in budgets_now().values())


@pytest.mark.built("_host_core")
@isolated
def test_without_a_device_budget_the_card_less_what_is_outside_torch_is_the_room():
    installed_host()
    fits = sample_plan(non_torch=CARD - 60 * MiB)  # made for this card: the KV line shrinks to fit
    fits.apply().undo()
    # over-committed (the KV line is 0 and still the lines pass the card): 38 MiB of budgets, 35 of room
    tight = sample_plan(non_torch=CARD - 35 * MiB)
    assert tight.kv_bytes == 0 and sum(tight.tag_budgets().values()) == 38 * MiB
    with pytest.raises(PlanDoesNotFitError, match=r"3\.0 MiB more than the card \(4\.00 GiB, no budget set\) less "
                                                  r"the plan's 3\.97 GiB outside torch"):
        tight.apply()
    other_card = sample_plan(total=2 * CARD, non_torch=2 * CARD - 60 * MiB)
    with pytest.raises(PlanDoesNotFitError, match=r"The plan was made for a card of 8\.00 GiB; this one has 4\.00 GiB"):
        other_card.apply()


@pytest.mark.built("_host_core")
@isolated
def test_a_tag_holding_more_than_its_line_already_is_refused():
    host = installed_host()
    under(host, "weights", 20 * MiB)
    with pytest.raises(PlanDoesNotFitError, match="'weights' has 20.0 MiB allocated, the plan gives it 16.0 MiB"):
        sample_plan().apply()
    assert all(b is None for b in budgets_now().values())


_real_set_budget = None


def _weights_at_40_mib_and_graphs_refused(undo_refused=False):
    """Installed over the host, with 'weights' at 40 MiB; set_budget then refuses the graphs tag
    a budget (RuntimeError), and with `undo_refused` putting 'weights' back to 40 MiB (OSError)."""
    from torch_budget import allocator

    installed_host()
    torch_budget.set_budget("40MiB", tag="weights")
    global _real_set_budget
    real = _real_set_budget = allocator.set_budget

    def failing(budget, device=None, tag=None):
        if tag == "graphs" and budget is not None:
            raise RuntimeError("refused")
        if undo_refused and tag == "weights" and budget == ("bytes", 40 * MiB):
            raise OSError("cannot go back")
        return real(budget, device=device, tag=tag)

    allocator.set_budget = failing


@pytest.mark.built("_host_core")
@isolated
def test_a_failure_part_way_restores_what_was_set():
    _weights_at_40_mib_and_graphs_refused()
    with pytest.raises(RuntimeError, match="refused"):
        sample_plan().apply()
    now = budgets_now()
    assert now["weights"] == 40 * MiB and now.get("kv") is None and now["activations"] is None, now


@pytest.mark.built("_host_core")
@isolated
def test_install_takes_the_plans_budgets_before_anything_is_allocated():
    host = installed_host(budgets=sample_plan().budget_settings())
    assert {t: b for t, b in budgets_now().items() if b is not None} == EXPECTED
    with pytest.raises(torch.cuda.OutOfMemoryError, match="tag 'workspace'"):
        under(host, "workspace", 4 * MiB + 4096)


@pytest.mark.built("_host_core")
@isolated
def test_lines_smaller_than_a_mebibyte_are_applied_as_bytes():
    # A bare number under 1 MiB is refused by set_budget as a likely slip for a fraction; a
    # plan's small line (a workspace of a few hundred KiB) is bytes all the same.
    prof = Profile.from_measurements(torch_peak=16 * MiB + (300 << 10), torch_used=16 * MiB + (300 << 10),
                                     total_used=20 * MiB, total=CARD, model_bytes=16 * MiB)
    p = planner.plan(prof, CacheCost(slope=4096), eager_workspace_in_peak=300 << 10, max_kv_bytes=32 * MiB)
    assert 0 < p.tag_budgets()["workspace"] < MiB
    installed_host()
    with p.apply():
        assert budgets_now()["workspace"] == p.tag_budgets()["workspace"]


@pytest.mark.built("_host_core")
@isolated
def test_install_takes_a_plans_sub_mebibyte_lines_through_budget_settings():
    prof = Profile.from_measurements(torch_peak=16 * MiB + (300 << 10), torch_used=16 * MiB + (300 << 10),
                                     total_used=20 * MiB, total=CARD, model_bytes=16 * MiB)
    p = planner.plan(prof, CacheCost(slope=4096), eager_workspace_in_peak=300 << 10, max_kv_bytes=32 * MiB)
    installed_host(budgets=p.budget_settings())
    assert {t: b for t, b in budgets_now().items() if b is not None} == p.tag_budgets()


def _no_kv_plan():
    """A plan whose KV line is 0 bytes (max_kv_tokens=0): the plan gives the cache nothing."""
    prof = Profile.from_measurements(torch_peak=28 * MiB, torch_used=28 * MiB, total_used=28 * MiB, total=CARD,
                                     model_bytes=16 * MiB)
    p = planner.plan(prof, CacheCost(slope=4096), max_kv_tokens=0)
    assert p.kv_bytes == 0 and p.tag_budgets()["kv"] == 0
    return p


@pytest.mark.built("_host_core")
@isolated
def test_a_line_of_0_bytes_lets_nothing_be_allocated_under_its_tag():
    host = installed_host()
    torch_budget.set_budget("64MiB", tag="kv")  # an older, larger budget the plan must replace
    with _no_kv_plan().apply() as applied:
        assert budgets_now()["kv"] == 0 and applied.budgets["kv"] == 0
        with pytest.raises(torch.cuda.OutOfMemoryError, match="tag 'kv'"):
            under(host, "kv", 4096)
        under(host, "weights", 4096)  # the other tags keep serving
    assert budgets_now()["kv"] == 64 * MiB  # undone: the older budget is back


@pytest.mark.built("_host_core")
@isolated
def test_install_takes_a_line_of_0_bytes_too():
    host = installed_host(budgets=_no_kv_plan().budget_settings())
    assert budgets_now()["kv"] == 0
    with pytest.raises(torch.cuda.OutOfMemoryError, match="tag 'kv'"):
        under(host, "kv", 4096)


@pytest.mark.built("_host_core")
@isolated
def test_a_tag_budget_of_0_is_written_out_and_a_device_budget_is_never_0():
    from torch_budget.errors import ConfigError

    installed_host()
    torch_budget.set_budget(("bytes", 0), tag="kv")
    assert budgets_now()["kv"] == 0
    torch_budget.set_budget(None, tag="kv")
    assert budgets_now()["kv"] is None
    for zero in (0, "0B"):  # a bare 0 may mean "no limit" to some: only the written-out form is a budget of 0
        with pytest.raises(ConfigError, match="more than 0 bytes"):
            torch_budget.set_budget(zero, tag="kv")
    with pytest.raises(ConfigError, match="more than 0 bytes"):
        torch_budget.set_budget(("bytes", 0))


@pytest.mark.built("_host_core")
@isolated
def test_when_putting_back_fails_too_the_failure_that_stopped_apply_is_raised_with_a_note():
    _weights_at_40_mib_and_graphs_refused(undo_refused=True)
    with pytest.raises(RuntimeError, match="refused") as e:
        sample_plan().apply()
    notes = "".join(getattr(e.value, "__notes__", ()))
    assert "putting back the budgets set before it failed too: 'weights' on device 0 (OSError: cannot go back)" \
        in notes, e.value
    assert "call undo() on this error's `applied`" in notes
    # what stayed on the plan's budget can still be put back, once the allocator lets it
    from torch_budget import allocator

    allocator.set_budget = _real_set_budget
    assert budgets_now()["weights"] == 16 * MiB
    e.value.applied.undo()
    assert budgets_now()["weights"] == 40 * MiB and budgets_now().get("kv") is None


def _plan_without_workspace():
    """sample_plan's profile, planned with no eager workspace and a KV cap of 48 MiB."""
    prof = Profile.from_measurements(torch_peak=28 * MiB, torch_used=28 * MiB, total_used=31 * MiB, total=CARD,
                                     model_bytes=16 * MiB)
    return planner.plan(prof, CacheCost(slope=4096), max_kv_bytes=48 * MiB)


@pytest.mark.built("_host_core")
@isolated
@pytest.mark.parametrize("undo_order", ["earlier first", "later first"])
def test_a_plan_applied_over_another_alone_bounds_the_device_and_undoing_both_returns_to_before(undo_order):
    installed_host()
    torch_budget.set_budget("64MiB", tag="kv")  # set before any plan: what undo must come back to
    first, second = sample_plan(), _plan_without_workspace()
    assert "workspace" in first.tag_budgets() and "workspace" not in second.tag_budgets()
    a1 = first.apply()
    a2 = second.apply()
    # the second plan's budgets, and none of the first's left over (its workspace line went back)
    assert {t: b for t, b in budgets_now().items() if b is not None} == second.tag_budgets()
    if undo_order == "earlier first":
        a1.undo()  # the device is the second plan's now: nothing of it changes
        assert {t: b for t, b in budgets_now().items() if b is not None} == second.tag_budgets()
        a2.undo()
    else:
        a2.undo()  # the first plan is in force again, as at the end of a nested `with` block
        assert {t: b for t, b in budgets_now().items() if b is not None} == first.tag_budgets()
        a1.undo()
    assert {t: b for t, b in budgets_now().items() if b is not None} == {"kv": 64 * MiB}


@pytest.mark.built("_host_core")
@isolated
def test_the_fit_check_counts_the_budgets_of_tags_the_plan_does_not_name():
    installed_host(budget="100MiB")
    torch_budget.set_budget("40MiB", tag="encoder")  # 70 MiB of plan + 40 MiB > 100 MiB
    with pytest.raises(PlanDoesNotFitError, match=r"would add up to 110\.0 MiB .*of tags the plan does not name, "
                                                  r"encoder 40\.0 MiB\), 10\.0 MiB more than its budget"):
        sample_plan().apply()
    assert budgets_now().get("weights") is None  # nothing was set
    torch_budget.set_budget(None, tag="encoder")
    sample_plan().apply().undo()


@pytest.mark.built("_host_core")
@isolated
def test_the_fit_check_counts_a_budget_inside_its_family_heads_once():
    """Note [Tag families]: a budget on "kv+cpu" bounds memory that "kv"'s budget bounds too, so the
    family holds at most the head's budget: 70 MiB of plan in 80 MiB, whatever "kv+cpu" is given."""
    installed_host(budget="80MiB")
    torch_budget.set_budget("30MiB", tag="kv+cpu")
    with sample_plan().apply():
        assert budgets_now()["kv"] == 32 * MiB and budgets_now()["kv+cpu"] == 30 * MiB
    torch_budget.set_budget("20MiB", tag="encoder")  # not of the family: it adds its own
    with pytest.raises(PlanDoesNotFitError, match=r"would add up to 90\.0 MiB .*kv\+cpu 30\.0 MiB \(inside kv's\), "
                                                  r"encoder 20\.0 MiB\), 10\.0 MiB more"):
        sample_plan().apply()


@pytest.mark.built("_host_core")
@isolated
@pytest.mark.parametrize("tensors", [1, 8])
def test_a_kv_pool_of_the_plans_tokens_fits_its_tag_budget_whatever_its_cost_per_token(tensors):
    """70,272 B a token (not a multiple of the allocator's 512 B unit), capped at 1,001 tokens: the
    pool, one tensor or eight of equal size, is charged more than its bytes; the KV line holds it."""
    host = installed_host()
    prof = Profile.from_measurements(torch_peak=28 * MiB, torch_used=28 * MiB, total_used=31 * MiB, total=CARD,
                                     model_bytes=16 * MiB)
    cost = CacheCost(slope=70272, tensors=tensors)
    for p in (planner.plan(prof, cost, max_kv_tokens=1001), planner.plan(prof, cost, max_kv_bytes=64 * MiB)):
        pool = cost.bytes_for_tokens(p.kv_tokens)
        with p.apply():
            ptrs = [under(host, "kv", pool // tensors) for _ in range(tensors)]
            for ptr in ptrs:
                host.free(ptr)


@pytest.mark.built("_host_core")
@isolated
def test_nested_plan_blocks_bring_each_outer_plan_back_and_one_undone_inside_changes_nothing_until_later():
    installed_host()
    outer, middle, inner = sample_plan(), _plan_without_workspace(), sample_plan(non_torch=5 * MiB)
    in_force = lambda: {t: b for t, b in budgets_now().items() if b is not None}  # noqa: E731
    with outer.apply():
        m = middle.apply()
        with inner.apply():
            assert in_force() == inner.tag_budgets()
            m.undo()  # below the top: nothing changes now
            assert in_force() == inner.tag_budgets()
        assert in_force() == outer.tag_budgets()  # the middle plan is gone: the outer one is back
    assert in_force() == {}


@pytest.mark.built("_host_core")
@isolated
def test_a_third_plan_over_two_brings_back_none_of_the_first_ones_budgets():
    from torch_budget.planner import apply as apply_module

    installed_host()
    in_force = lambda: {t: b for t, b in budgets_now().items() if b is not None}  # noqa: E731
    with sample_plan().apply():  # sets workspace and graphs, which the two below do not
        with _plan_without_workspace().apply():
            inner = _plan_without_workspace()
            with inner.apply():
                assert in_force() == inner.tag_budgets()
    assert in_force() == {}
    empty = sample_plan().apply(tags={})  # sets nothing, and still leaves the stack when undone
    empty.undo()
    assert all(p is not empty for stack in apply_module._in_force.values() for p in stack)
