"""The allocator core's logic against the host-memory stand-in for the driver."""
import random

import pytest

from _hostcore import OOM, GiB, MiB, S1, S2, S3, Host, isolated
from torch_budget import _native
from torch_budget.errors import StateError

pytestmark = pytest.mark.built("_host_core")

KiB = 1 << 10


def free_blocks(seg):
    return [b for b in seg["blocks"] if b[2] == 0]


@isolated
def test_small_blocks_split_one_segment_and_coalesce_back():
    h = Host(route="sync")
    ptrs = [h.malloc(1 * KiB) for _ in range(3)]
    assert ptrs[1] - ptrs[0] == 1 * KiB and ptrs[2] - ptrs[1] == 1 * KiB
    (seg,) = h.segments()
    assert seg["total_size"] == 2 * MiB and len(seg["blocks"]) == 4
    h.free(ptrs[1])
    h.free(ptrs[0])
    h.free(ptrs[2])
    (seg,) = h.segments()
    assert seg["blocks"] == [[2 * MiB, 0, 0]]


@isolated
def test_freed_block_is_reused_on_the_same_stream():
    h = Host(route="sync")
    p = h.malloc(3 * MiB)
    h.free(p)
    assert h.malloc(3 * MiB) == p
    assert h.stats()["num_device_alloc"] == 1


@isolated
def test_freed_block_its_stream_may_still_use_is_not_handed_to_another_stream():
    h = Host(route="sync")
    p = h.malloc(3 * MiB, S1)
    h.submit(S1)  # a kernel on S1 may still use p (a clean block is adopted: test_core_adopt.py)
    h.free(p)
    q = h.malloc(3 * MiB, S2)
    assert q != p
    assert h.stats()["num_device_alloc"] == 2


@isolated
def test_recorded_stream_delays_reuse_until_its_work_is_done():
    h = Host(route="sync")
    p = h.malloc(4 * MiB, S1)
    h.submit(S2)             # a consumer kernel on S2 reads the block
    h.record_stream(p, S2)
    h.free(p)
    q = h.malloc(4 * MiB, S1)
    assert q != p            # S2 may still be reading p
    stats = h.stats()
    assert stats["active_bytes"]["all"]["current"] == stats["allocated_bytes"]["all"]["current"] + 4 * MiB
    h.complete(S2)
    r = h.malloc(4 * MiB, S1)
    assert r == p            # now safe to reuse
    h.free(q)
    h.free(r)
    assert h.stats()["active_bytes"]["all"]["current"] == 0


@isolated
def test_vmm_recorded_stream_delays_reuse_until_its_work_is_done():
    h = Host(route="vmm")
    p = h.malloc(8 * MiB, S1)
    h.submit(S3)
    h.record_stream(p, S3)
    h.free(p)
    q = h.malloc(8 * MiB, S1)
    assert q != p
    h.complete(S3)
    h.free(q)
    assert h.malloc(8 * MiB, S1) in (p, q)


@pytest.mark.parametrize("route", ["sync", "vmm", "pool"])
def test_budget_is_never_exceeded_under_random_churn(route):
    @isolated
    def body():
        budget = 512 * MiB
        h = Host(route=route, budget=budget, capacity=2 * GiB)
        rng = random.Random(7)
        live, ooms = [], 0
        for _ in range(600):
            if live and rng.random() < 0.45:
                h.free(live.pop(rng.randrange(len(live))))
            else:
                size = int(min(rng.lognormvariate(14, 2.5), 200 * MiB)) + 1
                try:
                    live.append(h.malloc(size, rng.choice([S1, S2])))
                except OOM:
                    ooms += 1
            st = h.stats()
            assert st["reserved_bytes"]["all"]["current"] <= budget
            assert h.device_used() <= budget
        assert ooms > 0, "the trace should press against the budget"
        assert st["reserved_bytes"]["all"]["peak"] <= budget
        for p in live:
            h.free(p)
        st = h.stats()
        assert st["allocated_bytes"]["all"]["current"] == 0
        assert st["allocation"]["all"]["current"] == 0
        assert st["requested_bytes"]["all"]["current"] == 0
        h.empty_cache()
        assert h.reserved() == 0
        assert h.device_used() == 0
    body()


@isolated
def test_out_of_memory_names_the_numbers_and_the_knob_then_recovers():
    h = Host(route="vmm", budget=64 * MiB)
    p = h.malloc(48 * MiB)
    with pytest.raises(OOM) as err:
        h.malloc(32 * MiB)
    msg = str(err.value)
    for part in ("Tried to allocate 32.00 MiB", "budget of 64.00 MiB", "Allocated 48.00 MiB", "device free",
                 "torch_budget.install(budget=...)"):
        assert part in msg, (part, msg)
    assert h.stats()["num_ooms"] == 1
    h.free(p)
    q = h.malloc(32 * MiB)
    h.free(q)


@isolated
def test_driver_refusal_releases_cache_and_retries():
    h = Host(route="sync", capacity=64 * MiB)
    p = h.malloc(40 * MiB, S1)
    h.submit(S1)                # S1's kernels may still use p
    h.free(p)                   # cached on S1
    q = h.malloc(40 * MiB, S2)  # S2 cannot reuse it: the cache is released and the call retried
    assert h.stats()["num_alloc_retries"] == 1
    assert h.device_used() == 40 * MiB
    h.free(q)


@isolated
def test_vmm_moves_cached_granules_instead_of_growing():
    h = Host(route="vmm")
    a = h.malloc(64 * MiB)
    b = h.malloc(64 * MiB)
    h.free(a)
    c = h.malloc(100 * MiB)  # does not fit a's hole: takes a's physical granules
    assert h.device_used() <= (64 + 100) * MiB + 2 * MiB
    assert h.reserved() == h.device_used()
    for p in (b, c):
        h.free(p)
    h.empty_cache()
    assert h.device_used() == 0
    assert h.counters()["mappings"] == 0 and h.counters()["handles"] == 0


@isolated
def test_vmm_without_reuse_keeps_its_cache_and_grows():
    h = Host(route="vmm", reuse_before_grow=False)
    a = h.malloc(64 * MiB)
    b = h.malloc(64 * MiB)
    h.free(a)
    c = h.malloc(100 * MiB)
    assert h.device_used() >= (64 + 64 + 100) * MiB
    for p in (b, c):
        h.free(p)


@isolated
def test_empty_cache_returns_everything_and_counts_reach_zero():
    h = Host(route="vmm")
    ptrs = [h.malloc(s) for s in (1 * KiB, 300 * KiB, 5 * MiB, 33 * MiB)]
    h.push("sync")
    ptrs += [h.malloc(7 * MiB)]
    h.pop()
    h.push("pool")
    ptrs += [h.malloc(9 * MiB)]
    h.pop()
    for p in ptrs:
        h.free(p)
    h.empty_cache()
    st = h.stats()
    assert st["reserved_bytes"]["all"]["current"] == 0
    assert all(r["reserved"]["current"] == 0 and r["allocated"]["current"] == 0 for r in st["routes"].values())
    assert h.device_used() == 0


@isolated
def test_every_allocation_is_charged_to_its_route_and_tag():
    h = Host(route="vmm")
    h.push("sync", "kv")
    a = h.malloc(10 * MiB)
    h.push(None, "scratch")  # keeps route sync
    b = h.malloc(3 * MiB)
    h.pop()
    h.pop()
    c = h.malloc(5 * MiB)
    st = h.stats()
    assert st["tags"]["kv"]["allocated"]["current"] == 10 * MiB
    assert st["tags"]["scratch"]["allocated"]["current"] == 3 * MiB
    assert st["tags"]["untagged"]["allocated"]["current"] == 5 * MiB
    assert st["routes"]["sync"]["allocated"]["current"] == 13 * MiB
    assert st["routes"]["vmm"]["allocated"]["current"] == 5 * MiB
    for p in (a, b, c):
        h.free(p)
    st = h.stats()
    assert st["tags"]["kv"]["allocated"] == {"current": 0, "peak": 10 * MiB, "allocated": 10 * MiB,
                                              "freed": 10 * MiB}


@isolated
def test_unsupported_route_falls_back_by_capability():
    h = Host(route="vmm", vmm=False, pools=False)
    p = h.malloc(4 * MiB)
    assert h.stats()["routes"]["sync"]["allocated"]["current"] == 4 * MiB
    h.free(p)


@isolated
def test_graph_pool_holds_capture_allocations_until_released():
    h = Host(route="vmm")
    lib = h.lib
    _native.check(lib, lib.tb_begin_pool(0, 1, 0, S2))
    g = h.malloc(6 * MiB, S2)     # the capturing stream: private pool
    e = h.malloc(6 * MiB, S1)     # another stream: default pool
    t = h.malloc(1 * MiB, S2)
    h.free(t)                     # a free during capture stays in the pool
    _native.check(lib, lib.tb_end_pool(0, 1, 0))
    pools = {tuple(s["pool"]) for s in h.segments()}
    assert (1, 0) in pools and (0, 0) in pools
    assert h.stats()["graph_pool_reserved"]["current"] > 0
    _native.check(lib, lib.tb_release_pool(0, 1, 0))
    assert h.stats()["graph_pool_reserved"]["current"] > 0  # g is still live
    syncs = h.counters()["syncs"]
    h.free(g)
    # A replay of the destroyed graph may still run: a free never waits for the device, so
    # the pool stays parked (as torch's do) until the device is known idle.
    assert h.counters()["syncs"] == syncs
    h.empty_cache()
    assert h.stats()["graph_pool_reserved"]["current"] == 0
    assert all(tuple(s["pool"]) == (0, 0) for s in h.segments())
    with pytest.raises(ValueError, match="no graph holds"):
        _native.check(lib, lib.tb_release_pool(0, 1, 0))
    h.free(e)


@isolated
def test_shared_graph_pool_is_released_by_its_last_user():
    h = Host(route="sync")
    lib = h.lib
    for _ in range(2):  # two graphs captured into one pool
        _native.check(lib, lib.tb_begin_pool(0, 0, 7, S2))
        h.free(h.malloc(2 * MiB, S2))
        _native.check(lib, lib.tb_end_pool(0, 0, 7))
    _native.check(lib, lib.tb_release_pool(0, 0, 7))
    assert h.stats()["graph_pool_reserved"]["current"] > 0
    _native.check(lib, lib.tb_release_pool(0, 0, 7))
    assert h.stats()["graph_pool_reserved"]["current"] == 0


@isolated
def test_a_quiet_first_attempt_fails_before_reclaiming_and_counts_nothing():
    # The bridge asks quietly first, runs torch's free-memory callbacks, then asks in full: the
    # first failure had emptied the cache and counted an OOM that nobody saw raised.
    h = Host(route="sync", budget=64 * MiB)
    p = h.malloc(40 * MiB, S1)
    h.submit(S1)  # S1's kernels may still use p
    h.free(p)     # cached on S1
    before = h.stats()
    with pytest.raises(OOM):
        h.malloc_quiet(40 * MiB, S2)  # S2 cannot reuse it without emptying the cache
    after = h.stats()
    for key in ("num_ooms", "num_alloc_retries", "num_device_free"):
        assert after[key] == before[key], (key, before[key], after[key])
    assert h.reserved() == 40 * MiB  # nothing was emptied
    q = h.malloc(40 * MiB, S2)  # asked in full: the cache is emptied and the call retried
    assert h.stats()["num_ooms"] == 0 and h.stats()["num_alloc_retries"] == 1
    with pytest.raises(OOM):
        h.malloc_quiet(1 << 60)  # past the card: quiet too
    with pytest.raises(OOM):
        h.malloc(1 << 60)
    assert h.stats()["num_ooms"] == 1
    h.free(q)


@isolated
def test_a_quiet_first_attempt_past_a_tag_budget_counts_nothing():
    h = Host(route="vmm")
    h.set_tag_budget("kv", 8 * MiB)
    h.push(tag="kv")
    p = h.malloc(6 * MiB)
    with pytest.raises(OOM):
        h.malloc_quiet(4 * MiB)
    assert h.stats()["num_ooms"] == 0
    with pytest.raises(OOM, match="tag 'kv' would exceed its budget"):
        h.malloc(4 * MiB)
    assert h.stats()["num_ooms"] == 1
    h.free(p)
    h.pop()


@isolated
def test_address_arrays_given_to_the_c_abi_are_checked_not_read_blindly():
    import ctypes

    h = Host(route="vmm")
    p = h.malloc(1 * MiB)
    null = ctypes.POINTER(ctypes.c_uint64)()
    one = (ctypes.c_uint64 * 1)(p)
    # a null array (it had crashed the process) and a count no host could hold (it had aborted it)
    for ptrs, n in ((null, 3), (one, 1 << 60), (one, -1)):
        rc = h.lib.tb_pool_live_matches(0, 0, 7, ptrs, n)
        assert rc == -_native.INVALID_ARGUMENT, rc
        assert "expected live addresses" in h.lib.tb_last_error().decode()
        rc = h.lib.tb_release_tag_discarding(0, 0, 0, ptrs, n)
        assert rc == _native.INVALID_ARGUMENT, rc
        assert "discardable addresses" in h.lib.tb_last_error().decode()
    h.free(p)


@isolated
def test_bad_input_raises_clear_errors_without_aborting():
    h = Host(route="vmm")
    p = h.malloc(1 * MiB)
    h.free(p)
    with pytest.raises(ValueError, match="double free"):
        h.free(p)
    with pytest.raises(ValueError, match="not allocated by torch_budget"):
        h.free(0xDEAD0000)
    with pytest.raises(ValueError, match="must be positive"):
        h.malloc(-5)
    with pytest.raises(ValueError, match="unknown route"):
        _native.check(h.lib, h.lib.tb_push_scope(9, -1))
    with pytest.raises(RuntimeError, match="empty route/tag scope stack"):
        h.pop()
    with pytest.raises(ValueError, match="non-empty name"):
        h.tag("")
    q = h.malloc(30 * MiB)
    with pytest.raises(ValueError, match="below what device 0 already has allocated"):
        h.set_budget(10 * MiB)
    h.set_budget(40 * MiB)
    h.free(q)
    with pytest.raises(RuntimeError, match="configure it before the first one"):
        _native.check(h.lib, h.lib.tb_configure(-1, -1.0, 0, 1, 0))


@isolated
def test_lowering_budget_releases_cache_first():
    h = Host(route="sync")
    p = h.malloc(100 * MiB)
    h.free(p)
    assert h.reserved() == 100 * MiB
    h.set_budget(50 * MiB)  # only cache is above it: released, not refused
    assert h.reserved() == 0


@isolated
def test_threads_allocating_on_their_own_streams_leave_consistent_counts():
    import threading

    h = Host(route="vmm")
    errors = []

    def worker(stream, seed):
        rng = random.Random(seed)
        live = []
        try:
            for _ in range(400):
                if live and rng.random() < 0.5:
                    h.free(live.pop(rng.randrange(len(live))))
                else:
                    live.append(h.malloc(rng.choice([512, 3000, 300 * KiB, 3 * MiB, 17 * MiB]), stream))
            for p in live:
                h.free(p)
        except Exception as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(0x1000 * (i + 1), i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    st = h.stats()
    assert st["allocated_bytes"]["all"]["current"] == 0
    assert st["allocation"]["all"]["current"] == 0
    assert st["allocation"]["all"]["allocated"] == st["allocation"]["all"]["freed"] > 0
    h.empty_cache()
    assert h.device_used() == 0


# ---------------------------------------------------------------- fault-proofing


@isolated
def test_pool_route_that_grows_in_chunks_never_exceeds_the_budget():
    budget = 40 * MiB
    h = Host(route="pool", budget=budget, pool_chunk=32 * MiB)
    a = h.malloc(8 * MiB)              # the pool grows by one 32 MiB chunk
    b = h.malloc(8 * MiB)              # fits in that chunk
    assert h.reserved() == 32 * MiB
    with pytest.raises(OOM, match="budget of 40.00 MiB"):
        h.malloc(20 * MiB)             # would grow the pool by another 32 MiB
    assert h.reserved() <= budget and h.device_used() <= budget
    assert h.stats()["reserved_bytes"]["all"]["peak"] <= budget
    h.free(a)
    h.free(b)
    c = h.malloc(20 * MiB)             # fits the chunk once a and b are gone
    h.free(c)


@pytest.mark.parametrize("route", ["vmm", "pool", "sync"])
@pytest.mark.parametrize("size", [(1 << 63) - 1, 1 << 62, (1 << 64) - 512])
def test_absurd_sizes_are_a_clean_out_of_memory_error(route, size):
    @isolated
    def body():
        h = Host(route=route, budget=1 * GiB)
        n = size if size < (1 << 63) else size - (1 << 64)  # as ssize_t
        if n <= 0:
            with pytest.raises(ValueError, match="must be positive"):
                h.malloc(n)
            return
        with pytest.raises(OOM, match="larger than the device's total memory"):
            h.malloc(n)
        assert h.stats()["num_ooms"] == 1
        p = h.malloc(1 * MiB)  # nothing was corrupted
        h.free(p)
        assert h.allocated() == 0
    body()


@isolated
def test_a_pool_that_dies_during_another_capture_stays_until_empty_cache():
    h = Host(route="vmm")
    h.begin_pool((1, 0), S2)
    h.begin_pool((2, 0), S3)
    a = h.malloc(6 * MiB, S2)
    b = h.malloc(6 * MiB, S3)
    h.end_pool((1, 0))
    h.free(a)
    h.release_pool((1, 0))             # unused, but capture (2, 0) is still open
    assert {tuple(s["pool"]) for s in h.segments()} >= {(1, 0)}
    h.end_pool((2, 0))                 # the graph captured meanwhile may use (1, 0)'s memory: it stays
    assert {tuple(s["pool"]) for s in h.segments()} == {(1, 0), (2, 0)}
    h.empty_cache()                    # as with torch's allocator, empty_cache gives it back
    assert {tuple(s["pool"]) for s in h.segments()} == {(2, 0)}
    assert h.stats()["graph_pool_reserved"]["current"] == 20 * MiB  # torch's segment for 6 MiB (untagged: sync)
    with pytest.raises(ValueError, match="no graph holds"):
        h.release_pool((1, 0))
    h.free(b)
    h.release_pool((2, 0))
    assert h.stats()["graph_pool_reserved"]["current"] == 0


@isolated
def test_a_second_capture_into_a_pool_being_captured_into_is_refused():
    # As torch's allocator ("already recording to mempool_id"): an end then names the one
    # capture it closes, and never ends another thread's capture into the pool.
    h = Host(route="vmm")
    h.begin_pool((5, 0), S1)
    with pytest.raises(StateError, match=r"\(5, 0\) on device 0 is already being captured into"):
        h.begin_pool((5, 0), S2)       # another thread, into the same pool
    with pytest.raises(ValueError, match="never begun"):
        h.end_pool((9, 9))
    p = h.malloc(4 * MiB, S1)          # the capture on S1 is still open
    q = h.malloc(4 * MiB, S2)          # S2 captures nothing
    owner = {ptr: tuple(s["pool"]) for s in h.segments() for ptr in (p, q)
             if s["address"] <= ptr < s["address"] + s["total_size"]}
    assert owner == {p: (5, 0), q: (0, 0)}, owner
    h.end_pool((5, 0))
    with pytest.raises(ValueError, match="never begun"):
        h.end_pool((5, 0))
    h.begin_pool((5, 0), S2)           # once ended, the pool takes another capture
    h.end_pool((5, 0))
    for ptr in (p, q):
        h.free(ptr)
    h.release_pool((5, 0))
    h.release_pool((5, 0))             # one use per capture that began: the refused one took none
    assert h.stats()["graph_pool_reserved"]["current"] == 0


@isolated
def test_record_stream_and_free_racing_from_threads_stay_consistent():
    from _faultfuzz import race

    h = Host(route="vmm")
    shared, errors = race(h)
    assert not errors, errors
    for p in shared:
        h.free(p)
    h.complete(S3)
    h.empty_cache()
    st = h.stats()
    assert st["allocated_bytes"]["all"]["current"] == 0 and st["active_bytes"]["all"]["current"] == 0
    assert h.device_used() == 0


@pytest.mark.parametrize("call", ["empty_cache", "reuse"])
def test_other_threads_keep_allocating_while_one_waits_for_the_device(call):
    @isolated
    def body():
        import threading

        # A budget that a's memory must come back for: only then does an allocation wait.
        h = Host(route="vmm", budget=(64 + 64 + 2 + 40) * MiB)
        a = h.malloc(64 * MiB, S1)
        b = h.malloc(64 * MiB, S1)
        h.free(h.malloc(1 * MiB, S3))  # a mapped block cached for S3
        h.submit(S1)
        h.free(a)                      # cached, not clean: S1 may still use it
        h.hold_syncs(True)
        if call == "empty_cache":
            waiter = threading.Thread(target=h.empty_cache)
        else:                          # a's memory for c, under the budget, asks S1 to be synchronised
            waiter = threading.Thread(target=lambda: h.free(h.malloc(100 * MiB, S1)))
        waiter.start()
        h.hold_syncs(True, wait_for=1)  # the waiter is inside a synchronisation
        p = h.malloc(1 * MiB, S3)       # would deadlock if the device lock were held
        h.free(p)
        h.stats()
        h.hold_syncs(False)
        waiter.join(timeout=30)
        assert not waiter.is_alive()
        h.free(b)
        h.empty_cache()
        assert h.device_used() == 0
    body()


@isolated
def test_settings_apply_to_a_device_created_before_configure():
    h = Host(route="sync", configure=False)
    h.stats()                          # creates device 0
    h.configure(budget=64 * MiB, route="vmm")
    assert h.stats()["budget"] == 64 * MiB
    with pytest.raises(OOM, match="budget of 64.00 MiB"):
        h.malloc(100 * MiB)
    p = h.malloc(1 * MiB)
    assert h.stats()["routes"]["vmm"]["allocated"]["current"] == 1 * MiB
    with pytest.raises(RuntimeError, match="configure it before the first one"):
        h.configure(budget=128 * MiB)
    h.free(p)


@isolated
def test_vmm_arenas_are_released_and_a_failed_reservation_is_retried():
    h = Host(route="vmm")
    ptrs = [h.malloc(3 * MiB, s) for s in (S1, S2, S3)]
    assert h.stats()["segment"]["all"]["current"] == 3
    for p in ptrs:
        h.free(p)
    h.empty_cache()
    assert h.stats()["segment"]["all"]["current"] == 0
    assert h.counters()["reservations"] == 0
    h.fail("cuMemAddressReserve", nth=1)
    p = h.malloc(3 * MiB)              # the first reservation fails, the retry succeeds
    assert h.stats()["num_alloc_retries"] == 1
    h.free(p)


@isolated
def test_reserved_bytes_are_split_into_small_and_large_pools():
    h = Host(route="vmm")
    s = h.malloc(1 * KiB)
    big = h.malloc(5 * MiB)
    st = h.stats()["reserved_bytes"]
    assert st["small_pool"]["current"] == 2 * MiB
    assert st["large_pool"]["current"] == 6 * MiB
    assert st["all"]["current"] == st["small_pool"]["current"] + st["large_pool"]["current"]
    h.free(s)
    h.free(big)
    h.empty_cache()
    st = h.stats()["reserved_bytes"]
    assert st["small_pool"]["current"] == st["large_pool"]["current"] == 0


@isolated
def test_a_granule_whose_unmap_fails_stays_charged_and_is_released_later():
    h = Host(route="vmm")
    p = h.malloc(8 * MiB)
    h.free(p)
    h.fail("cuMemUnmap", rate=1.0)
    h.empty_cache()
    assert h.reserved() == h.device_used() == 8 * MiB  # still held, still counted
    h.heal()
    h.empty_cache()
    assert h.reserved() == h.device_used() == 0
    assert h.counters()["handles"] == 0


@isolated
def test_a_driver_without_vmm_or_pool_entry_points_still_loads_and_serves():
    h = Host(route="vmm", missing=("cuMemSetAccess", "cuMemPoolSetAccess"))
    p = h.malloc(4 * MiB)
    assert h.stats()["routes"]["sync"]["allocated"]["current"] == 4 * MiB
    h.free(p)


@isolated
def test_a_forked_child_refuses_allocations_and_ignores_frees():
    import os

    h = Host(route="vmm")
    p = h.malloc(4 * MiB)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            h.free(p)                  # the parent's memory: ignored
            try:
                h.malloc(1 * MiB)
                code = 2
            except RuntimeError as e:
                code = 0 if "spawn" in str(e) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert h.allocated() == 4 * MiB    # the child's free did not reach the parent
    h.free(p)


@isolated
def test_a_budget_bounds_its_tag_and_every_tag_of_its_family_together():
    """Note [Tag families]: the adapters keep a stack tag's memory under one tag per backup mode
    ("kv", "kv+cpu"); a budget on "kv" bounds them all, each keeping its own figures."""
    h = Host(route="vmm")
    h.set_tag_budget("kv", 8 * MiB)

    def under(tag, n):
        h.push(tag=tag)
        try:
            return h.malloc(n)
        finally:
            h.pop()

    a = under("kv", 4 * MiB)
    b = under("kv+cpu", 3 * MiB)
    # the refusal says which tags of the family hold the memory, and to free those
    with pytest.raises(OOM, match=r"tag 'kv' \(this allocation is under 'kv\+pinned', whose memory counts toward "
                                  r"it\) would exceed its budget of 8\.00 MiB: it and its family have 7\.00 MiB allocated "
                                  r"\('kv' 4\.00 MiB, 'kv\+cpu' 3\.00 MiB\), 1024\.00 KiB left.*free tensors allocated under "
                                  r"those tags\."):
        under("kv+pinned", 2 * MiB)
    with pytest.raises(OOM, match=r"tag 'kv' would exceed its budget of 8\.00 MiB: it and its family have 7\.00 MiB"):
        under("kv", 2 * MiB)
    other = under("kvx", 16 * MiB)  # not of the family: a name that only starts alike
    c = under("kv+pinned", 1 * MiB)  # what is left fits
    tags = h.stats()["tags"]
    assert [tags[t]["allocated"]["current"] for t in ("kv", "kv+cpu", "kv+pinned")] == [4 * MiB, 3 * MiB, 1 * MiB]
    # a budget below what the family holds is refused, naming the family's figure
    with pytest.raises(Exception, match=r"below what it and its family already have allocated on device 0 "
                                        r"\(8\.00 MiB: 'kv' 4\.00 MiB, 'kv\+cpu' 3\.00 MiB, 'kv\+pinned' "):
        h.set_tag_budget("kv", 6 * MiB)
    # a member's own budget bounds it alone, inside the family's
    h.set_tag_budget("kv+cpu", 3 * MiB)
    h.free(a)
    with pytest.raises(OOM, match=r"tag 'kv\+cpu' would exceed its budget of 3\.00 MiB"):
        under("kv+cpu", 1 * MiB)
    # a member that held memory before its head was named joins the family once the head is
    late = under("late+cpu", 4 * MiB)
    with pytest.raises(Exception, match=r"already have allocated on device 0 \(4\.00 MiB: 'late\+cpu' 4\.00 MiB\)"):
        h.set_tag_budget("late", 2 * MiB)
    for p in (b, c, other, late):
        h.free(p)


@isolated
def test_a_budget_below_what_a_family_holds_is_refused_naming_the_tags_that_hold_it():
    """Note [Tag families]: the memory a head's budget would cut into may be under its members
    alone, so the refusal says which of them hold it, not only that the head "has" it."""
    h = Host(route="vmm")
    h.push(tag="kv+cpu")
    p = h.malloc(3 * MiB)
    h.pop()
    h.push(tag="kv")
    q = h.malloc(2 * MiB)
    h.pop()
    with pytest.raises(Exception, match=r"budget of 2\.00 MiB for tag 'kv' is below what it and its family "
                                        r"already have allocated on device 0 \(5\.00 MiB: 'kv\+cpu' 3\.00 MiB, "
                                        r"'kv' 2\.00 MiB\): free their tensors first"):
        h.set_tag_budget("kv", 2 * MiB)
    with pytest.raises(Exception, match=r"for tag 'kv\+cpu' is below what it already has allocated on device 0 "
                                        r"\(3\.00 MiB\): free its tensors first"):
        h.set_tag_budget("kv+cpu", 2 * MiB)
    h.free(p)
    h.free(q)
