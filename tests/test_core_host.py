"""The allocator core's logic against the host-memory stand-in for the driver."""
import random

import pytest

from _hostcore import OOM, GiB, MiB, S1, S2, S3, Host, isolated
from torch_budget import _native

pytestmark = pytest.mark.skipif(not _native.is_built("_host_core"), reason="compiled core not built")

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
def test_freed_block_is_not_handed_to_another_stream():
    h = Host(route="sync")
    p = h.malloc(3 * MiB, S1)
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
    h.free(g)
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
        _native.check(h.lib, h.lib.tb_configure(-1, -1.0, 0, 1))


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
