"""Every old name still works for one release and warns, saying what to write instead; over the
host stand-in where the name needs an installed allocator (_hostcore.python_api_over)."""
import pytest

import torch_budget
from _hostcore import MiB, Host, isolated, python_api_over
from torch_budget import diagnostics, eager_workspace, planner, sleep, snapshot

pytestmark = pytest.mark.built("_host_core")


def _installed_host():
    host = Host(configure=False)
    python_api_over(host)
    torch_budget.install(route="vmm")
    return host


def _deprecated(instead):
    return pytest.warns(DeprecationWarning, match=rf"is deprecated and will be removed in the next release: .*{instead}")


@isolated
def test_route_scope_warns_and_works_as_region():
    host = _installed_host()
    with _deprecated(r"torch_budget\.region\(tag=\.\.\., route=\.\.\.\)"):
        scope = torch_budget.route("sync", tag="kv")
    with scope:
        host.malloc(2 * MiB)
    st = torch_budget.stats()
    assert st["by_tag"]["kv"]["allocated"] == 2 * MiB and st["by_route"]["sync"]["allocated"] == 2 * MiB
    with _deprecated("region"):
        torch_budget.allocator.route(tag="kv")


def test_route_names_the_old_call_in_its_warning_at_the_caller():
    with pytest.warns(DeprecationWarning, match=r"^torch_budget\.route\(\) is deprecated") as caught:
        with torch_budget.route(tag="kv"):  # without install the scope only checks its arguments
            pass
    assert caught[0].filename == __file__


@isolated
def test_trim_tag_warns_and_returns_the_bytes_like_empty_cache_with_tags():
    host = _installed_host()
    with torch_budget.region("kv"):
        p = host.malloc(4 * MiB)
    host.free(p)
    host.complete(host.stream())
    with _deprecated(r"torch_budget\.empty_cache\(tags=tag, device=device\)"):
        assert torch_budget.trim_tag("kv") == 4 * MiB
    with _deprecated("empty_cache"):
        assert torch_budget.allocator.trim_tag("kv", device=0) == 0


@isolated
def test_memory_snapshot_warns_and_returns_the_annotated_snapshot(monkeypatch, tmp_path):
    import torch

    _installed_host()
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": []})
    with _deprecated(r"torch_budget\.snapshot\.snapshot\(\).*torch\.cuda\.memory_snapshot\(\) is torch's list"):
        assert torch_budget.memory_snapshot() == snapshot.snapshot() == {"segments": [], "device_traces": []}
    with _deprecated(r"snapshot\.snapshot\(\)"):
        snapshot.memory_snapshot()
    with _deprecated(r"use torch_budget\.snapshot\.dump_snapshot"):
        dump = torch_budget.dump_snapshot
    dump(str(tmp_path / "s.pickle"))
    assert (tmp_path / "s.pickle").stat().st_size > 0


@isolated
def test_diagnostics_moved_out_of_the_top_level():
    _installed_host()
    for name in ("capabilities", "route_for", "segments"):
        with _deprecated(rf"use torch_budget\.diagnostics\.{name}"):
            old = getattr(torch_budget, name)
        assert old is getattr(diagnostics, name)
    with _deprecated(r"use torch_budget\.diagnostics\.segments"):
        assert torch_budget.allocator.segments() == diagnostics.segments()
    assert diagnostics.capabilities()["vmm"] and diagnostics.route_for("auto") == "vmm"


@isolated
def test_sleep_helpers_moved_to_torch_budget_sleep():
    host = _installed_host()
    with torch_budget.region("w"):
        host.malloc(2 * MiB)
    for name in ("tag_states", "reserve_host_pool", "free_host_pool", "host_pool_stats"):
        with _deprecated(rf"use torch_budget\.sleep\.{name}"):
            assert getattr(torch_budget, name) is getattr(sleep, name)
    with _deprecated("sleep.tag_states"):
        assert torch_budget.tag_states()["w"]["state"] == "live"
    with _deprecated("sleep.reserve_host_pool"):
        assert torch_budget.reserve_host_pool(4 * MiB) >= 4 * MiB


@pytest.mark.parametrize("name", ["CacheCost", "profile", "plan"])
def test_planner_names_moved_to_torch_budget_planner(name):
    with _deprecated(rf"use torch_budget\.planner\.{name}"):
        assert getattr(torch_budget, name) is getattr(planner, name)


def test_workspace_shrink_policy_moved_to_eager_workspace():
    with _deprecated(r"use torch_budget\.eager_workspace\.WorkspaceShrinkPolicy"):
        policy = torch_budget.WorkspaceShrinkPolicy
    assert policy is eager_workspace.WorkspaceShrinkPolicy


def test_allocator_torch_budget_error_moved_to_errors():
    with _deprecated(r"use torch_budget\.errors\.TorchBudgetError"):
        assert torch_budget.allocator.TorchBudgetError is torch_budget.TorchBudgetError


def test_the_top_level_lists_only_the_new_names():
    old = {"route", "trim_tag", "memory_snapshot", "capabilities", "route_for", "segments", "dump_snapshot",
           "tag_states", "reserve_host_pool", "free_host_pool", "host_pool_stats", "WorkspaceShrinkPolicy",
           "CacheCost", "profile", "plan"}
    assert not old & set(torch_budget.__all__)
    assert {"install", "installed", "region", "stats", "empty_cache", "set_budget", "release", "restore", "sleeping",
            "workspace", "WorkspaceMetadata", "GraphPoolManager", "TorchBudgetError"} <= set(torch_budget.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        torch_budget.nothing_here


def test_a_moved_name_warns_where_it_is_read():
    with pytest.warns(DeprecationWarning) as caught:
        torch_budget.CacheCost
    assert caught[0].filename == __file__


def test_runner_keeping_outputs_in_warns_and_names_only_a_runner_keeping_its_outputs_there(monkeypatch):
    import torch

    from torch_budget.graphs import GraphPoolManager, StaticInput

    handles = iter([(0, 77), (0, 78)])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    manager = GraphPoolManager("cpu")
    own = manager.runner("own", lambda b: {"y": b["x"] * 1}, buckets=(2,), pool="own",
                         inputs=[StaticInput("x", torch.float32, (4,))])
    own._pool = manager.capture_pool(own)  # what its first capture does
    with _deprecated("runner_keeping_pool"):
        assert manager.runner_keeping_outputs_in(own.pool) is None  # its own pool, not its outputs'
    assert manager.runner_keeping_pool(own.pool) is own
