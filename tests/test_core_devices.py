"""The core over two stand-in devices: current device, peer access, cross-device frees."""
import pytest

from _hostcore import OOM, GiB, MiB, Host, isolated

pytestmark = pytest.mark.built("_host_core")

ROUTES = ["vmm", "pool", "sync"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("caller", [0, -1])
def test_no_entry_point_moves_the_callers_current_device(route, caller):
    @isolated
    def body():
        h = Host(devices=2, route=route)
        h.set_current(caller)
        s1, s0 = h.stream(1), h.stream(0)

        def unchanged(what):
            assert h.current() == caller, f"{what} moved the current device to {h.current()}"

        p = h.malloc(3 * MiB, s1, device=1)  # first use of device 1 creates it
        unchanged("the first allocation on device 1")
        q = h.malloc(5 * MiB, s1, device=1)
        h.record_stream(q, s0, device=0)
        unchanged("record_stream")
        h.submit(s0)
        h.free(q)
        unchanged("a free waiting on another device's stream")
        h.complete(s0)
        h.free(p)
        unchanged("free")
        h.empty_cache(1)
        unchanged("empty_cache")
        h.begin_pool((1, 1), s1, device=1)
        g = h.malloc(2 * MiB, s1, device=1)
        h.end_pool((1, 1), device=1)
        h.release_pool((1, 1), device=1)
        h.free(g)
        unchanged("graph pool teardown")
        h.set_budget(1 * GiB, device=1)
        unchanged("set_budget")
        with pytest.raises(OOM):
            h.malloc(2 * GiB, s1, device=1)
        unchanged("an out-of-memory failure")
        assert h.stats(1)["allocated_bytes"]["all"]["current"] == 0
    body()


@pytest.mark.parametrize("route", ["vmm", "pool"])
def test_peer_access_covers_existing_and_later_mappings(route):
    @isolated
    def body():
        h = Host(devices=2, route=route)
        s1 = h.stream(1)
        before = h.malloc(6 * MiB, s1, device=1)
        assert h.can_access(1, before) and not h.can_access(0, before)
        h.grant_peer(1, 0)  # device 0 may now use device 1's memory
        assert h.can_access(0, before)
        after = h.malloc(40 * MiB, s1, device=1)
        assert h.can_access(0, after) and h.can_access(0, after + 39 * MiB)
        h.push(tag="graphs")  # a tagged private pool is on the VMM route (Note [Private pool routes])
        h.begin_pool((0, 3), s1, device=1)
        captured = h.malloc(4 * MiB, s1, device=1)
        h.end_pool((0, 3), device=1)
        h.pop()
        assert h.can_access(0, captured)
        h.grant_peer(1, 0)  # twice is fine
        with pytest.raises(ValueError, match="cannot be a peer"):
            h.grant_peer(1, 1)
        for p in (before, after, captured):
            h.free(p)
        h.release_pool((0, 3), device=1)
    body()


def test_vmm_granules_remapped_after_a_grant_keep_peer_access():
    @isolated
    def body():
        h = Host(devices=2, route="vmm")
        s1 = h.stream(1)
        h.grant_peer(1, 0)
        a = h.malloc(64 * MiB, s1, device=1)
        h.free(a)
        h.empty_cache(1)
        b = h.malloc(64 * MiB, s1, device=1)  # new handles, new mappings
        assert h.can_access(0, b) and h.can_access(1, b)
        h.free(b)
    body()


@pytest.mark.parametrize("route", ROUTES)
def test_free_after_record_stream_on_another_devices_stream_waits_then_returns_memory(route):
    @isolated
    def body():
        h = Host(devices=2, route=route)
        s1, s0 = h.stream(1), h.stream(0)
        p = h.malloc(8 * MiB, s1, device=1)
        h.submit(s0)                 # a kernel on device 0 still reads p
        h.record_stream(p, s0, device=0)
        h.free(p)
        st = h.stats(1)
        assert st["allocated_bytes"]["all"]["current"] == 0
        assert st["active_bytes"]["all"]["current"] == 8 * MiB  # held for device 0's stream
        h.complete(s0)
        q = h.malloc(8 * MiB, s1, device=1)  # events are processed on the next call
        h.free(q)
        st = h.stats(1)
        assert st["active_bytes"]["all"]["current"] == 0
        h.empty_cache(1)
        assert h.device_used(1) == 0
        assert h.counters()["allocs"] == 0, "a stream-ordered free was lost"
        assert h.stats(1)["reserved_bytes"]["all"]["current"] == 0
    body()


def test_a_block_of_one_device_is_freed_from_a_thread_current_on_the_other():
    @isolated
    def body():
        import threading

        h = Host(devices=2, route="vmm")
        s0, s1 = h.stream(0), h.stream(1)
        ptrs = [h.malloc(3 * MiB, s1, device=1) for _ in range(8)] + [h.malloc(1 * MiB, s0) for _ in range(8)]
        errors = []

        def worker(mine, current):
            try:
                h.set_current(current)
                for p in mine:
                    h.free(p)
                assert h.current() == current
            except BaseException as e:  # collected and re-raised in the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(ptrs[i::2], i % 2)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert h.stats(0)["allocated_bytes"]["all"]["current"] == 0
        assert h.stats(1)["allocated_bytes"]["all"]["current"] == 0
    body()


def test_a_share_opened_before_peer_access_was_enabled_becomes_reachable_by_the_peer():
    # torch's enablePeerAccess extends the expandable segments it opened from other processes: a
    # consumer's mapping of a producer's VMM memory stayed reachable by its own device alone, so a
    # kernel of the peer reading the shared tensor faulted.
    @isolated
    def body():
        h = Host(devices=2, route="vmm")
        t = h.malloc(4 * MiB, h.stream(0))
        handle, _ = h.share(t)
        opened, ptr, size = h.open_kept(handle, device=1)  # a consumer's tensor on device 1
        assert h.can_access(1, ptr) and not h.can_access(0, ptr)
        h.grant_peer(1, 0)  # device 0 may now use device 1's memory
        assert h.can_access(0, ptr) and h.can_access(0, ptr + size - 1)
        later, ptr2, _ = h.open_kept(handle, device=1)  # opened after the grant
        assert h.can_access(0, ptr2)
        h.close_opened(opened, device=1)
        h.close_opened(later, device=1)
        h.grant_peer(1, 0)  # granted already: nothing to do
        h.free(t)
    body()


def test_a_share_closed_before_a_grant_is_not_touched_by_it():
    @isolated
    def body():
        h = Host(devices=3, route="vmm")
        t = h.malloc(4 * MiB, h.stream(0))
        handle, _ = h.share(t)
        opened, ptr, _ = h.open_kept(handle, device=1)
        h.close_opened(opened, device=1)  # its range is unmapped again: a grant must not name it
        h.grant_peer(1, 2)  # raised, had the grant set access on the closed mapping
        assert not h.can_access(2, ptr)
        h.free(t)
    body()


@pytest.mark.parametrize("current", [1, -1])
def test_reserving_the_host_pool_pins_under_the_callers_device_and_starts_no_other(current):
    # It always pinned under device 0's context: a process running on device 1 alone (one rank of
    # several, every card visible) started a context on device 0, and device 0 counted as served.
    @isolated
    def body():
        from torch_budget import _native

        h = Host(devices=2, route="vmm")
        h.set_current(current)
        _native.check(h.lib, h.lib.tb_host_pool_reserve(4 * MiB))
        assert h.host_pool()["bytes"] >= 4 * MiB
        assert h.current() == current
        # Without a current context (before CUDA started), device 0's pins, as before.
        assert bool(h.lib.tb_device_ready(0)) == (current < 0)
    body()


@pytest.mark.parametrize("route", ["vmm", "sync"])
def test_a_capture_ending_on_one_device_never_waits_for_another(route):
    # The end of the last capture settled every device's dead graph pools, waiting for each device
    # whose pools were not clean: a capture on device 1 synchronised device 0, stalling behind
    # whatever another thread had queued there.
    @isolated
    def body():
        h = Host(devices=2, route=route)
        s0, s1 = h.stream(0), h.stream(1)
        h.begin_pool((0, 5), s0, device=0)
        out = h.malloc(2 * MiB, s0, device=0)  # a graph's output, outliving its graph
        h.end_pool((0, 5), device=0)
        h.release_pool((0, 5), device=0)
        h.submit(s0)  # device 0 is busy
        h.free(out)  # the pool dies with work queued on device 0
        synced = h.stats(0)["num_sync_all_streams"]
        h.begin_pool((1, 1), s1, device=1)
        h.capture(s1, 9)
        h.free(h.malloc(2 * MiB, s1, device=1))
        h.capture(s1, 0)
        h.end_pool((1, 1), device=1)
        assert h.stats(0)["num_sync_all_streams"] == synced, "device 1's capture end waited for device 0"
        h.release_pool((1, 1), device=1)
        h.empty_cache(0)  # device 0's own call waits for it, and the dead pool goes
        assert h.reserved(0) == 0 and h.device_used(0) == 0
    body()
