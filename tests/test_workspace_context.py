"""workspace(metadata), the context manager around a forward, on CPU tensors: the rules that do not
depend on the device (warm-up first, no overlapping forwards, graph metadata left alone,
reclamation off for good after a stream change, shrinking by reallocation of pure scratch).

Streams are simulated through the metadata's `stream_fn` hook, the documented way to tell
streams apart on a device torch_budget cannot query; the installed allocator through a
stand-in that records its regions.
"""

import contextlib
import logging
import threading
import weakref

import pytest
import torch

from conftest import MiB
from torch_budget import _runtime, allocator
from torch_budget.eager_workspace import WORKSPACE_TAG, WorkspaceMetadata, get, reserve, warm_up, workspace
from torch_budget.errors import NotWarmedUpError, StateError
from torch_budget.resources import DummyRequest, Step
from torch_budget.workspace_resource import WorkspaceResource

LOGGER = "torch_budget.eager_workspace"


def warmed(floor=1 * MiB, **kwargs):
    kwargs.setdefault("reclaimable", True)
    meta = WorkspaceMetadata("cpu", **kwargs)
    meta.warm_up(floor)
    return meta


def forward(meta, *demands):
    """One eager forward whose layers need `demands` bytes of scratch each."""
    with workspace(meta):
        for nbytes in demands:
            meta.get(nbytes).fill_(1)  # touch the scratch, as a kernel would


def storage_bytes(tensor):
    return tensor.untyped_storage().nbytes()


def warnings_from(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


class StandInAllocator:
    """Stands in for an installed torch_budget.allocator: records each region and what it saw."""

    def __init__(self, installed=True):
        self.is_installed = installed
        self.scopes = []  # tag of every region() entered
        self.emptied = []  # tags of every empty_cache(tags=...)
        self.on_enter = None  # called when a region is entered
        self.fail = None  # exception to raise when the next region is entered

    def installed(self):
        return self.is_installed

    def empty_cache(self, device=None, tags=None):
        self.emptied.append(tags)

    @contextlib.contextmanager
    def region(self, tag=None, route=None):
        self.scopes.append(tag)
        if self.on_enter is not None:
            self.on_enter()
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        yield


@pytest.fixture
def shim(monkeypatch):
    stand_in = StandInAllocator()
    monkeypatch.setattr(_runtime, "installed", stand_in.installed)
    monkeypatch.setattr(allocator, "region", stand_in.region)
    monkeypatch.setattr(allocator, "empty_cache", stand_in.empty_cache)
    return stand_in


# -- warm-up --------------------------------------------------------------------------------


def test_forward_before_warm_up_raises_not_warmed_up_error_a_value_error():
    meta = WorkspaceMetadata("cpu", reclaimable=True)
    with pytest.raises(NotWarmedUpError, match="warm-up must create it") as raised:
        with workspace(meta):
            pass
    assert isinstance(raised.value, ValueError)


def test_get_before_warm_up_raises_not_warmed_up_error():
    with pytest.raises(NotWarmedUpError, match="warm-up must create it"):
        WorkspaceMetadata("cpu").get(1 * MiB)


def test_warm_up_capacity_becomes_the_floor():
    meta = warmed(3 * MiB)
    assert (meta.floor, meta.capacity, storage_bytes(meta.workspace)) == (3 * MiB, 3 * MiB, 3 * MiB)
    assert meta.workspace.dtype == torch.uint8 and meta.workspace.dim() == 1


def test_warm_up_adopts_the_workspace_a_backend_already_made():
    meta = WorkspaceMetadata("cpu", reclaimable=True)
    own = torch.empty(2 * MiB, dtype=torch.uint8)
    meta.workspace = own
    assert warm_up(meta) is own
    assert meta.floor == 2 * MiB


@pytest.mark.parametrize(
    "tensor, problem",
    [
        (torch.empty(16, dtype=torch.float32), "dtype torch.float32"),
        (torch.empty(4, 4, dtype=torch.uint8), "2 dimensions"),
        (torch.empty(16, dtype=torch.uint8)[4:], "a view"),
    ],
)
def test_warm_up_rejects_a_workspace_that_is_not_flat_owned_uint8(tensor, problem):
    meta = WorkspaceMetadata("cpu")
    meta.workspace = tensor
    with pytest.raises(ValueError, match=problem):
        warm_up(meta)


def _sharing_storage(tensor):
    """A tensor of its own (not a view) over `tensor`'s storage."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


@pytest.mark.parametrize("same_object", [True, False])
def test_warm_up_refuses_a_workspace_whose_storage_another_metadata_manages(same_object):
    first = warmed(1 * MiB)
    forward(first, 4 * MiB)  # its storage moved: the check follows it
    second = WorkspaceMetadata("cpu", reclaimable=True)
    second.workspace = first.workspace if same_object else _sharing_storage(first.workspace)
    with pytest.raises(ValueError, match="is already the workspace of WorkspaceMetadata"):
        warm_up(second)
    assert second.workspace_state is None
    forward(first, 2 * MiB)  # the first is untouched


def test_a_storage_can_be_adopted_again_once_its_metadata_is_gone():
    first = warmed(1 * MiB)
    tensor = first.workspace
    del first
    second = WorkspaceMetadata("cpu", reclaimable=True)
    second.workspace = tensor
    assert warm_up(second) is tensor


def test_warm_up_refuses_a_graph_workspace_that_shares_the_eager_workspaces_storage():
    eager = torch.empty(2 * MiB, dtype=torch.uint8)
    for graph_ws in (eager, eager[: 1 * MiB], _sharing_storage(eager)):
        meta = WorkspaceMetadata("cpu", reclaimable=True, graph_workspace=graph_ws)
        meta.workspace = eager
        with pytest.raises(ValueError, match="graph_workspace shares its storage with the eager workspace"):
            warm_up(meta)
    other = warmed(1 * MiB)  # nor another metadata's eager workspace, which its forwards move
    meta = WorkspaceMetadata("cpu", reclaimable=True, graph_workspace=other.workspace)
    with pytest.raises(ValueError, match="graph_workspace shares its storage with the workspace of WorkspaceMetadata"):
        meta.warm_up(1 * MiB)
    meta = WorkspaceMetadata("cpu", reclaimable=True, graph_workspace=eager)
    meta.warm_up(1 * MiB)  # a graph workspace of its own is fine
    late = WorkspaceMetadata("cpu", reclaimable=True)
    late.workspace = eager  # and then is no one's eager workspace
    with pytest.raises(ValueError, match="already the graph_workspace of WorkspaceMetadata"):
        warm_up(late)


class BackendMetadata:
    """A backend's own metadata with the protocol's required attributes only."""

    def __init__(self):
        self.workspace = None
        self.is_graph_metadata = False
        self.workspace_state = None


def test_metadata_without_a_reclaimable_flag_is_a_stateful_workspace():
    def backend_forward(nbytes):
        with workspace(meta):
            get(meta, nbytes).fill_(1)

    meta = BackendMetadata()
    warm_up(meta, 1 * MiB, device="cpu")
    backend_forward(8 * MiB)
    tensor = meta.workspace
    for _ in range(4):
        backend_forward(2 * MiB)
    assert meta.workspace is tensor and storage_bytes(tensor) == 8 * MiB  # never reclaimed


def test_warm_up_names_a_required_protocol_attribute_the_metadata_lacks():
    meta = BackendMetadata()
    del meta.is_graph_metadata
    with pytest.raises(TypeError, match="BackendMetadata at 0x[0-9a-f]+ has no is_graph_metadata"):
        warm_up(meta, 1 * MiB, device="cpu")
    assert meta.workspace_state is None


def test_second_warm_up_of_one_metadata_is_rejected():
    meta = warmed(1 * MiB)
    with pytest.raises(StateError, match=rf"already warmed up \(floor {MiB} bytes\)"):
        meta.warm_up(2 * MiB)


def test_warm_up_rejects_a_negative_size():
    with pytest.raises(ValueError, match=r"nbytes \(bytes\) must be >= 0, got -1"):
        WorkspaceMetadata("cpu").warm_up(-1)


def test_a_workspace_refuses_what_is_not_metadata_and_an_exit_without_a_forward():
    for bad in (None, 5):
        with pytest.raises(TypeError, match="takes the forward's attention metadata"):
            workspace(bad)
    meta = WorkspaceMetadata("cpu", reclaimable=True)
    meta.warm_up(1 * MiB)
    with pytest.raises(StateError, match="no forward running"):
        workspace(meta).__exit__(None, None, None)
    with workspace(meta):            # still usable
        pass
    with pytest.raises(ValueError, match="below 2\\*\\*63"):
        WorkspaceMetadata("cpu").warm_up(2**64)


def test_get_rejects_negative_or_non_integer_sizes():
    meta = warmed()
    with pytest.raises(ValueError, match=r"nbytes \(bytes\) must be >= 0, got -3"):
        meta.get(-3)
    with pytest.raises(TypeError, match=r"nbytes \(bytes\) must be an integer"):
        meta.get(2.5)
    with pytest.raises(ValueError, match=r"nbytes \(bytes\) must be below 2\*\*63"):
        meta.get(2**70)


@pytest.mark.parametrize("flag", ["reclaimable", "is_graph_metadata", "multi_stream", "return_to_device"])
@pytest.mark.parametrize("value", ["false", None, 0])
def test_metadata_flags_must_be_bools_not_values_that_read_as_one(flag, value):
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        WorkspaceMetadata("cpu", **{flag: value})


# -- overlapping forwards -------------------------------------------------------------------


def test_nested_forward_on_one_workspace_raises_runtime_error():
    meta = warmed()
    with workspace(meta):
        with pytest.raises(StateError, match="overlapping forwards"):
            with workspace(meta):
                pass
        assert meta.workspace_state.in_forward
    assert not meta.workspace_state.in_forward
    forward(meta, 1 * MiB)  # the workspace is free again


@contextlib.contextmanager
def _forward_in_another_thread(meta):
    """While the block runs, another thread's forward holds `meta`'s workspace."""
    inside, leave = threading.Event(), threading.Event()

    def first_forward():
        with workspace(meta):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=first_forward)
    thread.start()
    try:
        assert inside.wait(10)
        yield
    finally:
        leave.set()
        thread.join()


def test_forward_from_another_thread_during_a_forward_raises_runtime_error():
    meta = warmed()
    with _forward_in_another_thread(meta):
        with pytest.raises(StateError, match="overlapping forwards"):
            with workspace(meta):
                pass
    forward(meta, 1 * MiB)


def test_another_thread_cannot_exit_a_forward_it_did_not_enter():
    meta = warmed()
    with _forward_in_another_thread(meta):
        with pytest.raises(StateError, match="other than the one whose forward"):
            workspace(meta).__exit__(None, None, None)
        assert meta.workspace_state.in_forward  # the first forward still holds its workspace
        with pytest.raises(StateError, match="overlapping forwards"):
            with workspace(meta):
                pass
    forward(meta, 1 * MiB)


class _HookedLock:
    """A lock that runs `hook` once, right after an acquire succeeds."""

    def __init__(self, lock, hook):
        self._lock, self._hook = lock, hook

    def acquire(self, blocking=True):
        ok = self._lock.acquire(blocking)
        if ok and self._hook is not None:
            hook, self._hook = self._hook, None
            hook()
        return ok

    def release(self):
        self._lock.release()

    def locked(self):
        return self._lock.locked()


def test_a_stray_exit_of_the_last_forwards_thread_cannot_end_the_next_forward():
    meta = warmed()
    state = workspace(meta)
    ended, asked, done, stray = threading.Event(), threading.Event(), threading.Event(), []

    def last_owner():  # runs a forward, then exits once more when asked
        forward(meta, 1 * MiB)
        ended.set()
        asked.wait(10)
        try:
            state.__exit__(None, None, None)
        except StateError as e:
            stray.append(e)
        done.set()

    def between_acquire_and_owner_mark():  # the next forward holds the lock, not yet marked its owner's
        asked.set()
        assert done.wait(10)

    thread = threading.Thread(target=last_owner)
    thread.start()
    assert ended.wait(10)
    state._lock = _HookedLock(state._lock, between_acquire_and_owner_mark)
    try:
        with workspace(meta):
            assert state.in_forward, "the stray exit ended this forward"
    finally:
        thread.join()
    assert len(stray) == 1 and "other than the one whose forward" in str(stray[0])
    forward(meta, 1 * MiB)


def test_separate_metadata_objects_run_forwards_side_by_side():
    a, b = warmed(), warmed()
    with workspace(a), workspace(b):
        ta, tb = a.get(2 * MiB), b.get(3 * MiB)
        assert ta.numel() >= 2 * MiB and tb.numel() >= 3 * MiB
        assert ta.data_ptr() != tb.data_ptr(), "two metadata objects must not share one workspace"
    assert a.capacity >= 2 * MiB and b.capacity >= 3 * MiB


def test_forward_that_raises_frees_the_workspace_and_is_not_counted():
    meta = warmed(1 * MiB)
    forward(meta, 8 * MiB)
    forward(meta, 2 * MiB)
    forward(meta, 2 * MiB)
    with pytest.raises(KeyError):
        with workspace(meta):
            meta.get(2 * MiB)
            raise KeyError("layer failed")
    assert meta.capacity == 8 * MiB, "a failed forward must not complete the window"
    assert not meta.workspace_state.in_forward
    forward(meta, 2 * MiB)
    assert meta.capacity == 2 * MiB


# -- measuring demand -----------------------------------------------------------------------


def test_get_grows_one_shared_storage_to_the_largest_request():
    meta = warmed(1 * MiB)
    with workspace(meta):
        views = [meta.get(n) for n in (2 * MiB, 8 * MiB, 4 * MiB)]
        assert [v.numel() for v in views] == [2 * MiB, 8 * MiB, 4 * MiB]
        assert views[-1].untyped_storage().data_ptr() == meta.workspace.untyped_storage().data_ptr()
    assert meta.capacity == storage_bytes(meta.workspace) == 8 * MiB


def test_logical_size_is_zeroed_only_above_the_floor():
    meta = warmed(1 * MiB)
    with workspace(meta):
        assert meta.workspace.numel() == 1 * MiB  # at the floor: nothing to measure
        meta.get(8 * MiB)
    storage = meta.workspace.untyped_storage().data_ptr()
    with workspace(meta):
        assert meta.workspace.numel() == 0
        assert storage_bytes(meta.workspace) == 8 * MiB
        assert meta.workspace.untyped_storage().data_ptr() == storage  # storage kept
        meta.get(3 * MiB)
        assert meta.workspace.untyped_storage().data_ptr() == storage  # and reused


def test_backend_that_resizes_the_workspace_itself_is_measured():
    meta = warmed(1 * MiB)

    def backend_forward(*demands):
        with workspace(meta):
            for nbytes in demands:
                scratch = meta.workspace
                if scratch.numel() < nbytes:
                    scratch.resize_(nbytes)  # grow-only, in place, without get()

    backend_forward(8 * MiB)
    assert meta.capacity == 8 * MiB
    for demand in (2 * MiB, 3 * MiB, 2 * MiB):
        backend_forward(demand)
    assert meta.capacity == storage_bytes(meta.workspace) == 3 * MiB


@pytest.mark.parametrize("reclaimable, raises", [(True, True), (False, True), (False, False)])
def test_capacity_follows_a_backends_own_resize_in_a_forward_that_raised_or_was_not_measured(reclaimable, raises):
    meta = warmed(1 * MiB, reclaimable=reclaimable)
    with contextlib.suppress(KeyError):
        with workspace(meta):
            meta.workspace.resize_(8 * MiB)  # the backend's own growth
            if raises:
                raise KeyError("a later layer failed")
    assert meta.capacity == storage_bytes(meta.workspace) == 8 * MiB
    forward(meta, 6 * MiB)  # served by the storage it has, without a reallocation
    assert meta.capacity == storage_bytes(meta.workspace) == 8 * MiB


def test_growth_of_a_stateful_workspace_keeps_its_contents():
    meta = warmed(1 * MiB, reclaimable=False)
    meta.get(1 * MiB).fill_(7)
    grown = meta.get(4 * MiB)
    assert storage_bytes(meta.workspace) == 4 * MiB
    assert bool((grown[: 1 * MiB] == 7).all())


# -- growth between forwards ----------------------------------------------------------------


def test_growth_between_forwards_starts_the_shrink_window_again():
    meta = warmed(1024)
    ws = WorkspaceResource(meta, 1024, 64)
    for demand in (8 * 1024, 2 * 1024, 2 * 1024):  # two underfilled forwards of the three
        forward(meta, demand)
    ws.prepare(Step(context=(DummyRequest(1, 2), DummyRequest(2, 32))))  # the next step's long prompt
    assert meta.capacity == 32 * 1024
    forward(meta, 2 * 1024)  # the short forward before it must not shrink prepare's growth away
    assert meta.capacity == 32 * 1024


@pytest.mark.parametrize("nbytes", [4 * MiB, 1 * MiB])  # past the storage, and within it
def test_growth_from_another_thread_during_a_forward_is_refused(nbytes):
    meta = warmed(1 * MiB)
    forward(meta, 2 * MiB)
    storage = meta.workspace.untyped_storage().data_ptr()
    with _forward_in_another_thread(meta):  # its forward zeroed the logical size
        with pytest.raises(StateError, match="while a forward runs on it in another thread"):
            meta.get(nbytes)
        assert meta.workspace.untyped_storage().data_ptr() == storage and meta.capacity == 2 * MiB
    assert meta.get(4 * MiB).numel() == 4 * MiB  # between forwards any thread may grow it


class _SlowRelease:
    """A lock whose release() is slow: a waiting forward's attempts fall between the growth's end
    and its release of the lock."""

    def __init__(self, lock):
        self._lock = lock

    def acquire(self, blocking=True, timeout=-1):
        return self._lock.acquire(blocking, timeout)

    def release(self):
        import time

        time.sleep(0.1)
        self._lock.release()

    def locked(self):
        return self._lock.locked()


@pytest.mark.parametrize("slow_release", [False, True])
def test_a_forward_entered_while_another_thread_grows_the_workspace_between_forwards_waits_for_it(monkeypatch,
                                                                                                  slow_release):
    # A scheduler thread preparing the next step (WorkspaceResource.prepare) holds the forward lock while it
    # grows; a forward entered meanwhile was refused as an overlapping forward, in the middle of serving.
    import torch_budget.eager_workspace as eager_workspace

    meta = warmed(1 * MiB)
    if slow_release:
        meta.workspace_state._lock = _SlowRelease(meta.workspace_state._lock)
    growing, may_finish = threading.Event(), threading.Event()
    real = eager_workspace._allocation_scope

    @contextlib.contextmanager
    def slow_scope():
        growing.set()
        assert may_finish.wait(10)
        with real():
            yield

    monkeypatch.setattr(eager_workspace, "_allocation_scope", slow_scope)
    grower = threading.Thread(target=lambda: meta.get(8 * MiB))
    grower.start()
    assert growing.wait(10)
    threading.Timer(0.05, may_finish.set).start()
    forward(meta, 4 * MiB)  # waits for the growth, then runs on the grown workspace
    grower.join()
    assert meta.capacity >= 8 * MiB


# -- reclaiming -----------------------------------------------------------------------------


def test_three_underfilled_forwards_replace_the_workspace_with_target_bytes():
    meta = warmed(1 * MiB)
    forward(meta, 2 * MiB, 8 * MiB)
    long_workspace = weakref.ref(meta.workspace)
    forward(meta, 2 * MiB)
    forward(meta, 3 * MiB, 1 * MiB)
    assert meta.workspace is long_workspace(), "two underfilled forwards must not shrink"
    forward(meta, 2 * MiB)
    assert long_workspace() is None, "the old workspace must be dropped"
    assert meta.workspace.numel() == storage_bytes(meta.workspace) == 3 * MiB
    assert meta.capacity == 3 * MiB


def test_shrink_releases_the_old_workspace_before_allocating_the_new_one(shim):
    meta = warmed(1 * MiB)
    forward(meta, 8 * MiB)
    for demand in (2 * MiB, 2 * MiB):
        forward(meta, demand)
    old = weakref.ref(meta.workspace)
    alive_at_allocation = []
    shim.on_enter = lambda: alive_at_allocation.append(old() is not None)
    shim.scopes.clear()
    forward(meta, 2 * MiB)
    assert shim.scopes == [WORKSPACE_TAG]
    assert alive_at_allocation == [False]
    assert meta.capacity == 2 * MiB


def test_a_shrink_whose_memory_cannot_go_back_to_the_device_keeps_it_cached_and_the_forward_succeeds(
        monkeypatch, caplog):
    from torch_budget import eager_workspace

    def refused(device):  # what the core says while another thread captures on the device
        raise StateError("trim of tag 'workspace' while a CUDA graph capture is open")

    monkeypatch.setattr(eager_workspace, "_return_to_device", refused)
    meta = warmed(1 * MiB)
    for demand in (8 * MiB, 2 * MiB, 2 * MiB, 2 * MiB):
        forward(meta, demand)
    assert meta.capacity == storage_bytes(meta.workspace) == 2 * MiB  # the shrink itself happened
    assert not meta.workspace_state.in_forward
    warnings = warnings_from(caplog)
    assert len(warnings) == 1 and "while a CUDA graph capture is open" in warnings[0].getMessage()


def test_shrink_target_is_never_below_the_floor():
    meta = warmed(4 * MiB)
    forward(meta, 16 * MiB)
    for demand in (1 * MiB, 1 * MiB, 2 * MiB):
        forward(meta, demand)
    assert meta.capacity == storage_bytes(meta.workspace) == 4 * MiB


def test_non_reclaimable_workspace_is_never_reclaimed():
    meta = warmed(1 * MiB, reclaimable=False)
    forward(meta, 8 * MiB)
    tensor = meta.workspace
    for _ in range(6):
        forward(meta, 1 * MiB)
    assert meta.workspace is tensor
    assert storage_bytes(tensor) == 8 * MiB


def test_graph_metadata_is_left_untouched_even_without_warm_up():
    meta = WorkspaceMetadata("cpu", reclaimable=True, is_graph_metadata=True)
    with workspace(meta):
        pass
    assert meta.workspace is None


def test_graph_metadata_workspace_is_never_resized_or_reclaimed():
    meta = warmed(1 * MiB, is_graph_metadata=True)
    meta.get(8 * MiB)
    tensor = meta.workspace
    for _ in range(4):
        with workspace(meta):
            assert tensor.numel() == 8 * MiB  # not zeroed
            meta.get(1 * MiB)
    assert meta.workspace is tensor and storage_bytes(tensor) == 8 * MiB


def test_eager_forwards_never_touch_the_graph_workspace():
    graph_ws = torch.full((4 * MiB,), 5, dtype=torch.uint8)
    address = graph_ws.data_ptr()
    meta = warmed(1 * MiB, graph_workspace=graph_ws)
    forward(meta, 16 * MiB)
    for demand in (2 * MiB, 2 * MiB, 2 * MiB):
        forward(meta, demand)
    assert meta.capacity == 2 * MiB  # the eager workspace did shrink
    assert meta.graph_workspace is graph_ws
    assert graph_ws.data_ptr() == address and graph_ws.numel() == 4 * MiB
    assert bool((graph_ws == 5).all())


def test_rebinding_the_workspace_outside_the_manager_is_reported():
    meta = warmed(1 * MiB)
    meta.workspace = torch.empty(2 * MiB, dtype=torch.uint8)
    with pytest.raises(StateError, match="was replaced outside the manager"):
        with workspace(meta):
            pass
    assert not meta.workspace_state.in_forward


# -- streams --------------------------------------------------------------------------------


class SimulatedStreams:
    """A stream_fn whose answer the test sets, standing in for a device's current stream."""

    def __init__(self, current="stream-0"):
        self.current = current

    def __call__(self):
        return self.current


def test_forwards_on_the_warm_up_stream_keep_reclaiming(caplog):
    streams = SimulatedStreams()
    meta = warmed(1 * MiB, stream_fn=streams)
    forward(meta, 8 * MiB)
    for demand in (2 * MiB, 2 * MiB, 2 * MiB):
        forward(meta, demand)
    assert meta.capacity == 2 * MiB
    assert warnings_from(caplog) == []


def test_stream_change_disables_reclamation_with_exactly_one_warning(caplog):
    streams = SimulatedStreams()
    meta = warmed(1 * MiB, stream_fn=streams)
    forward(meta, 8 * MiB)
    streams.current = "stream-1"
    forward(meta, 2 * MiB)
    assert meta.reclaim_disabled
    for current in ("stream-0", "stream-1", "stream-0", "stream-0", "stream-0"):
        streams.current = current
        forward(meta, 2 * MiB)
    assert meta.capacity == storage_bytes(meta.workspace) == 8 * MiB
    warnings = warnings_from(caplog)
    assert len(warnings) == 1
    assert "disabled for good" in warnings[0].getMessage()
    assert "'stream-1'" in warnings[0].getMessage()


def test_each_metadata_warns_once_about_its_own_stream_change(caplog):
    streams = SimulatedStreams()
    first, second = warmed(stream_fn=streams), warmed(stream_fn=streams)
    streams.current = "stream-1"
    for _ in range(3):
        forward(first, 1 * MiB)
        forward(second, 1 * MiB)
    assert len(warnings_from(caplog)) == 2


def test_multi_stream_metadata_disables_reclamation_with_one_warning(caplog):
    meta = warmed(1 * MiB, multi_stream=True)
    forward(meta, 8 * MiB)
    for demand in (2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB):
        forward(meta, demand)
    assert meta.reclaim_disabled
    assert meta.capacity == 8 * MiB
    warnings = warnings_from(caplog)
    assert len(warnings) == 1 and "multi_stream" in warnings[0].getMessage()


@pytest.fixture
def syncs(monkeypatch):
    """The devices growth synchronised before releasing the old storage."""
    from torch_budget import eager_workspace

    seen = []
    monkeypatch.setattr(eager_workspace, "_synchronize", seen.append)
    return seen


@pytest.mark.parametrize("reclaimable", [True, False])
def test_growth_waits_for_the_device_before_freeing_storage_another_stream_may_read(syncs, reclaimable):
    streams = SimulatedStreams()
    on_warm_up_stream = warmed(1 * MiB, reclaimable=reclaimable, stream_fn=streams)
    forward(on_warm_up_stream, 4 * MiB)
    assert syncs == [], "one stream: stream order alone keeps the old storage safe"
    multi = warmed(1 * MiB, reclaimable=reclaimable, multi_stream=True)
    forward(multi, 4 * MiB)
    assert syncs == [torch.device("cpu")]
    streams.current = "stream-1"  # a forward on another stream than the warm-up's
    forward(on_warm_up_stream, 8 * MiB)
    assert syncs == [torch.device("cpu")] * 2
    assert on_warm_up_stream.capacity == 8 * MiB


# -- the allocator shim ---------------------------------------------------------------------


def test_workspace_allocations_are_routed_to_the_workspace_tag_when_the_shim_is_installed(shim):
    meta = warmed(1 * MiB)
    assert shim.scopes == [WORKSPACE_TAG]  # warm-up
    forward(meta, 8 * MiB)
    assert shim.scopes == [WORKSPACE_TAG] * 2  # growth
    forward(meta, 2 * MiB)
    forward(meta, 4 * MiB)
    assert shim.scopes == [WORKSPACE_TAG] * 2, "a forward that allocates nothing enters no scope"
    forward(meta, 2 * MiB)
    assert shim.scopes == [WORKSPACE_TAG] * 3  # the shrink's allocation


def test_a_backend_sizing_the_workspace_itself_grows_it_under_the_workspace_tag_with_reserve(shim):
    meta = warmed(1 * MiB)
    tensor = meta.workspace
    shim.scopes.clear()
    with workspace(meta):
        assert reserve(meta, 8 * MiB) is tensor  # in place, where a backend would call tensor.resize_
        assert tensor.numel() == storage_bytes(tensor) == 8 * MiB
    assert shim.scopes == [WORKSPACE_TAG] and meta.capacity == 8 * MiB
    for _ in range(3):
        with workspace(meta):
            reserve(meta, 2 * MiB)
    assert meta.capacity == storage_bytes(meta.workspace) == 2 * MiB  # measured and shrunk as get()'s growth


def test_nothing_is_routed_when_the_shim_is_not_installed(shim):
    shim.is_installed = False
    meta = warmed(1 * MiB)
    forward(meta, 8 * MiB)
    for demand in (2 * MiB, 2 * MiB, 2 * MiB):
        forward(meta, demand)
    assert meta.capacity == 2 * MiB
    assert shim.scopes == []


def test_failed_shrink_allocation_leaves_an_empty_usable_workspace(shim):
    meta = warmed(1 * MiB)
    forward(meta, 8 * MiB)
    forward(meta, 2 * MiB)
    forward(meta, 2 * MiB)
    shim.fail = MemoryError("budget exceeded")
    with pytest.raises(MemoryError, match="budget exceeded"):
        forward(meta, 2 * MiB)
    assert meta.workspace is not None and storage_bytes(meta.workspace) == 0
    assert not meta.workspace_state.in_forward
    forward(meta, MiB // 2)  # regrows on demand, even below the floor
    assert meta.capacity == MiB // 2
    forward(meta, 2 * MiB)
    assert meta.capacity == 2 * MiB
    for _ in range(3):
        forward(meta, 1 * MiB)  # at or above the floor again: measured and reclaimed
    assert meta.capacity == storage_bytes(meta.workspace) == 1 * MiB


@pytest.mark.parametrize("reclaimable", [True, False])
def test_a_refused_growth_leaves_a_workspace_backed_by_its_storage(reclaimable):
    # torch sets a tensor's new size before allocating, and pure scratch gives its storage up
    # first: a refused growth left 1 MiB of elements over no storage (a write then crashed the
    # process) or 2**62 elements over 1 MiB.
    meta = warmed(1 * MiB, reclaimable=reclaimable)
    with pytest.raises(RuntimeError):
        get(meta, 1 << 62)
    ws = meta.workspace
    assert ws.numel() <= storage_bytes(ws) == meta.capacity
    assert meta.capacity == (0 if reclaimable else 1 * MiB)
    get(meta, 4096).fill_(1)
    assert meta.capacity >= 4096


# -- lifetime -------------------------------------------------------------------------------


def test_dropping_the_metadata_frees_its_workspace_without_garbage_collection():
    import gc

    meta = warmed(1 * MiB)
    forward(meta, 4 * MiB)
    tensor = weakref.ref(meta.workspace)
    gc.disable()
    try:
        del meta
        assert tensor() is None, "the state must not hold the metadata in a reference cycle"
    finally:
        gc.enable()


def test_package_level_workspace_call_works_whatever_was_imported_first(fresh):
    out = fresh("""
        import torch, torch_budget
        from torch_budget.eager_workspace import WorkspaceMetadata  # the submodule is imported first
        meta = WorkspaceMetadata("cpu", reclaimable=True)
        meta.warm_up(1 << 20)
        with torch_budget.workspace(meta):
            meta.get(4 << 20)
        print(meta.capacity)
    """)
    assert out.split() == [str(4 * MiB)]


def test_a_forward_that_regrows_below_the_floor_after_a_refused_growth_exits_cleanly():
    meta = WorkspaceMetadata("cpu", reclaimable=True)
    meta.warm_up(64)
    with workspace(meta):
        meta.get(128)
    with workspace(meta):  # it raised at exit: capacity 32 below the floor of 64
        with pytest.raises(RuntimeError):
            meta.get(1 << 62)  # refused: the reclaimable workspace gave its storage up first
        assert meta.get(32).numel() >= 32  # the forward goes on with what it needs
    with workspace(meta):
        assert meta.get(100).numel() >= 100


def test_growth_in_a_forward_that_raised_starts_the_shrink_window_again():
    meta = WorkspaceMetadata("cpu", reclaimable=True)
    meta.warm_up(64)
    with workspace(meta):
        meta.get(1000)
    for _ in range(2):  # two underfilled forwards of the three that shrink it
        with workspace(meta):
            meta.get(100)
    with pytest.raises(RuntimeError, match="layer failed"):
        with workspace(meta):
            meta.get(50_000)  # grows, then a later layer raises
            raise RuntimeError("layer failed")
    with workspace(meta):  # the retry's size is kept: it shrank to 100 here
        meta.get(100)
    assert meta.capacity >= 50_000


@pytest.mark.parametrize("reclaimable", [True, False])
def test_growth_under_a_graph_capture_is_refused_and_leaves_the_workspace_as_it_was(monkeypatch, reclaimable):
    from torch_budget import eager_workspace

    capturing = [False]
    monkeypatch.setattr(eager_workspace, "_device_hooks", lambda device, meta: (None, lambda: capturing[0]))
    meta = WorkspaceMetadata("cpu", reclaimable=reclaimable)
    meta.warm_up(1 * MiB)
    storage = meta.workspace.untyped_storage().data_ptr()
    capturing[0] = True
    with workspace(meta):
        meta.get(1 * MiB).fill_(3)  # within what it holds: served in the capture
        with pytest.raises(StateError, match="CUDA graph capture asked it for 2097152.*graph workspace, or warm up "
                                             "a new metadata object with at least 2097152 bytes"):
            meta.get(2 * MiB)
    assert meta.capacity == 1 * MiB and meta.workspace.untyped_storage().data_ptr() == storage
    capturing[0] = False
    fresh = WorkspaceMetadata("cpu", reclaimable=reclaimable)  # the advice: a new metadata, warmed up
    fresh.warm_up(2 * MiB)
    with workspace(fresh):
        assert fresh.get(2 * MiB).numel() == 2 * MiB


class SimulatedCapture:
    """A capture check whose answer the test sets, standing in for torch.cuda.graph()."""

    def __init__(self):
        self.open = False

    def __call__(self):
        return self.open

    @contextlib.contextmanager
    def capture(self):
        self.open = True
        try:
            yield
        finally:
            self.open = False


@pytest.fixture
def capture(monkeypatch):
    from torch_budget import eager_workspace

    simulated = SimulatedCapture()
    monkeypatch.setattr(eager_workspace, "_device_hooks", lambda device, meta: (None, simulated))
    return simulated


def _captured_forward(meta, capture):
    with capture.capture(), workspace(meta):
        meta.get(2 * MiB).fill_(3)


def _capture_inside_a_forward(meta, capture):
    with workspace(meta):
        with capture.capture():
            meta.get(2 * MiB).fill_(3)


def _capture_of_a_bare_get(meta, capture):
    with capture.capture():
        meta.get(2 * MiB).fill_(3)


@pytest.mark.parametrize("captured", [_captured_forward, _capture_inside_a_forward, _capture_of_a_bare_get])
def test_a_workspace_a_capture_used_never_shrinks_and_warns_once(capture, caplog, captured):
    meta = warmed(1 * MiB)
    forward(meta, 8 * MiB)
    storage = meta.workspace.untyped_storage().data_ptr()
    captured(meta, capture)  # the graph bakes the workspace's address in
    for _ in range(6):
        forward(meta, 2 * MiB)
    assert meta.capacity == storage_bytes(meta.workspace) == 8 * MiB
    assert meta.workspace.untyped_storage().data_ptr() == storage, "a replay would write freed memory"
    warnings = warnings_from(caplog)
    assert len(warnings) == 1 and "CUDA graph capture" in warnings[0].getMessage()


@pytest.mark.parametrize("reclaimable", [True, False])
def test_growth_of_a_workspace_a_capture_used_is_refused_naming_the_capture(capture, reclaimable):
    meta = warmed(4 * MiB, reclaimable=reclaimable)
    storage = meta.workspace.untyped_storage().data_ptr()
    _captured_forward(meta, capture)
    with pytest.raises(StateError, match=r"a CUDA graph capture used it.*baked.*graph workspace"):
        with workspace(meta):
            meta.get(8 * MiB)
    with pytest.raises(StateError, match="a CUDA graph capture used it"):
        get(meta, 8 * MiB)  # nor between forwards
    assert meta.capacity == storage_bytes(meta.workspace) == 4 * MiB
    assert meta.workspace.untyped_storage().data_ptr() == storage
    forward(meta, 4 * MiB)  # what it holds still serves
