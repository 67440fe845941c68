"""The eager workspace on a CUDA device: memory really goes back, streams and capture are honoured.

Every test runs in a fresh process: some install the allocator shim (which must precede the
first CUDA allocation) or capture graphs, and the others need clean allocator statistics.
"""

import logging

import pytest
import torch  # importing touches no device: bodies that install() do so before their first allocation

from torch_budget.eager_workspace import WorkspaceMetadata, workspace
from torch_budget.units import MiB

pytestmark = pytest.mark.gpu

LONG, SHORT, FLOOR = 512 * MiB, 16 * MiB, 8 * MiB


def forward(meta, *demands):
    with workspace(meta):
        for nbytes in demands:
            meta.get(nbytes).fill_(1)


def long_then_two_short(meta):
    forward(meta, 64 * MiB, LONG, 128 * MiB)
    assert meta.capacity == LONG, meta
    forward(meta, SHORT)
    forward(meta, 4 * MiB, SHORT)
    assert meta.capacity == LONG, "two short forwards must not shrink"
    torch.cuda.synchronize()


class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def count_warnings():
    """Counts the workspace's warnings (which then stay off stderr); every body calls it first,
    after install() where it installs."""
    warnings = Count()
    logging.getLogger("torch_budget.eager_workspace").addHandler(warnings)
    return warnings


@pytest.mark.exclusive
def test_third_short_forward_frees_the_excess_under_install_and_empty_cache_returns_it(fresh):
    out = fresh(third_short_forward_frees_the_excess_under_install_and_empty_cache_returns_it)
    assert "returned_mib" in out


def third_short_forward_frees_the_excess_under_install_and_empty_cache_returns_it():
    import torch_budget
    torch_budget.install()
    count_warnings()
    meta = WorkspaceMetadata("cuda", reclaimable=True)
    meta.warm_up(FLOOR)
    long_then_two_short(meta)
    by_tag = torch_budget.allocator.stats()["by_tag"]
    assert by_tag["workspace"]["allocated"] == meta.capacity == LONG, by_tag
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    allocated_before = torch.cuda.memory_allocated()
    forward(meta, SHORT)
    torch.cuda.synchronize()
    assert meta.capacity == SHORT, meta
    # The shrink frees the excess at once (the ledger shows it) and hands it to the device (the
    # next test measures that before any empty_cache); after empty_cache it is there in any case.
    assert allocated_before - torch.cuda.memory_allocated() == LONG - SHORT
    torch.cuda.empty_cache()
    returned = torch.cuda.mem_get_info()[0] - free_before
    assert returned >= 0.95 * (LONG - SHORT), (returned / MiB, "MiB returned")
    by_tag = torch_budget.allocator.stats()["by_tag"]
    assert by_tag["workspace"]["allocated"] == meta.capacity == SHORT, by_tag
    print("returned_mib", returned / MiB)


@pytest.mark.exclusive
def test_shrink_under_install_returns_the_excess_to_the_device_at_once_unless_told_to_keep_it(fresh):
    out = fresh(shrink_under_install_returns_the_excess_to_the_device_at_once_unless_told_to_keep_it)
    assert "RETURNED_MIB" in out


def shrink_under_install_returns_the_excess_to_the_device_at_once_unless_told_to_keep_it():
    import torch_budget
    torch_budget.install()
    count_warnings()
    def returned_by_shrink(meta):
        # A long forward, two short ones, then the third short one shrinks: bytes the device got.
        meta.warm_up(FLOOR)
        long_then_two_short(meta)
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        forward(meta, SHORT)
        returned = torch.cuda.mem_get_info()[0] - free0    # no synchronize, no empty_cache
        assert meta.capacity == SHORT, meta
        return returned

    EXCESS = LONG - SHORT
    returned_meta = WorkspaceMetadata("cuda", reclaimable=True)    # kept alive to the end
    returned = returned_by_shrink(returned_meta)
    assert returned >= 0.95 * EXCESS, ("returned at once", returned / MiB, "MiB of", EXCESS / MiB)
    kept_meta = WorkspaceMetadata("cuda", reclaimable=True, return_to_device=False)
    kept = returned_by_shrink(kept_meta)
    assert kept <= 0.05 * EXCESS, ("return_to_device=False still returned", kept / MiB, "MiB")
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    torch.cuda.empty_cache()
    cached = torch.cuda.mem_get_info()[0] - free0
    assert cached >= 0.95 * EXCESS, ("the kept excess was not in the cache", cached / MiB, "MiB")
    assert torch_budget.stats()["by_tag"]["workspace"]["allocated"] == 2 * SHORT
    print("RETURNED_MIB", returned / MiB, "KEPT_MIB", kept / MiB)


def test_third_short_forward_returns_the_excess_to_torchs_cache_natively(fresh):
    fresh(third_short_forward_returns_the_excess_to_torchs_cache_natively)


def third_short_forward_returns_the_excess_to_torchs_cache_natively():
    count_warnings()
    meta = WorkspaceMetadata("cuda", reclaimable=True)
    meta.warm_up(FLOOR)
    long_then_two_short(meta)
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    forward(meta, SHORT)
    torch.cuda.synchronize()
    assert meta.capacity == SHORT, meta
    assert allocated - torch.cuda.memory_allocated() == LONG - SHORT
    # Released before the new workspace was allocated: the cache served it, no new segment.
    assert torch.cuda.memory_reserved() <= reserved, (torch.cuda.memory_reserved(), reserved)


def test_growing_scratch_never_holds_the_old_and_new_storage_at_once(fresh):
    fresh(growing_scratch_never_holds_the_old_and_new_storage_at_once)


def growing_scratch_never_holds_the_old_and_new_storage_at_once():
    count_warnings()
    for reclaimable, extra in ((True, 0), (False, 64 * MiB)):
        meta = WorkspaceMetadata("cuda", reclaimable=reclaimable)
        meta.warm_up(64 * MiB)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward(meta, LONG)
        torch.cuda.synchronize()
        # Pure scratch is released before it regrows; a stateful workspace is copied, so both exist.
        assert torch.cuda.max_memory_allocated() - base == LONG - 64 * MiB + extra, reclaimable
        del meta


def test_shrink_never_touches_the_graph_workspace(fresh):
    fresh(shrink_never_touches_the_graph_workspace)


def shrink_never_touches_the_graph_workspace():
    count_warnings()
    graph_ws = torch.full((4 * MiB,), 5, dtype=torch.uint8, device="cuda")
    address = graph_ws.data_ptr()
    meta = WorkspaceMetadata("cuda", reclaimable=True, graph_workspace=graph_ws)
    meta.warm_up(FLOOR)
    long_then_two_short(meta)
    forward(meta, SHORT)
    assert meta.capacity == SHORT
    assert meta.graph_workspace is graph_ws and graph_ws.data_ptr() == address
    assert bool((graph_ws == 5).all())


def test_forward_on_another_cuda_stream_disables_reclamation_with_one_warning(fresh):
    fresh(forward_on_another_cuda_stream_disables_reclamation_with_one_warning)


def forward_on_another_cuda_stream_disables_reclamation_with_one_warning():
    warnings = count_warnings()
    meta = WorkspaceMetadata("cuda", reclaimable=True)
    meta.warm_up(FLOOR)
    forward(meta, LONG)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(meta, SHORT)
    torch.cuda.current_stream().wait_stream(side)
    assert meta.reclaim_disabled
    for _ in range(4):
        forward(meta, SHORT)
    torch.cuda.synchronize()
    assert meta.capacity == LONG, meta
    assert len(warnings.records) == 1, [r.getMessage() for r in warnings.records]


def test_forward_under_graph_capture_counts_nothing_and_keeps_the_address_the_graph_baked_in(fresh):
    fresh(forward_under_graph_capture_counts_nothing_and_keeps_the_address_the_graph_baked_in)


def forward_under_graph_capture_counts_nothing_and_keeps_the_address_the_graph_baked_in():
    warnings = count_warnings()
    meta = WorkspaceMetadata("cuda", reclaimable=True)
    meta.warm_up(FLOOR)
    forward(meta, 64 * MiB)
    forward(meta, SHORT)
    policy = meta.workspace_state.policy
    assert policy.remaining == 2
    tensor = meta.workspace
    address = tensor.data_ptr()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on a side stream
        with workspace(meta):
            assert tensor.numel() == SHORT, "capture must not zero the logical size"
            meta.get(SHORT).fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert meta.workspace is tensor and meta.capacity == 64 * MiB
    assert policy.remaining == 2, "a captured forward must not count"
    assert not meta.reclaim_disabled
    assert len(warnings.records) == 1 and "CUDA graph capture" in warnings.records[0].getMessage()
    for _ in range(4):
        forward(meta, SHORT)
    assert meta.capacity == 64 * MiB and meta.workspace.data_ptr() == address, "the graph's address moved"
    graph.replay()  # still writes the workspace it was captured with
    torch.cuda.synchronize()
