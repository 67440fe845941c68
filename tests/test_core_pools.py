"""Private pools in the core, against the host stand-in: checkpoints restored at the same
addresses (CUDA graph trees), the live-allocation check, MemPool options, and the trace
torch's memory history is built from."""
import ctypes

import pytest

from _hostcore import OOM, MiB, S1, S2, S3, Host, isolated
from torch_budget import _native

pytestmark = pytest.mark.built("_host_core")

KiB = 1 << 10
POOL = (0, 7)


def layout(h, pool):
    return [(s["address"], s["blocks"]) for s in h.segments() if tuple(s["pool"]) == pool]


def captured(h, sizes, pool=POOL, tag=None, stream=S2):
    """Blocks allocated into `pool` as a capture would."""
    if tag:
        h.push(tag=tag)
    h.begin_pool(pool, stream)
    ptrs = [h.malloc(n, stream) for n in sizes]
    h.end_pool(pool)
    if tag:
        h.pop()
    return ptrs


@pytest.mark.parametrize("tag", [None, "graphs"], ids=["sync", "vmm"])
def test_a_checkpoint_brings_back_the_same_blocks_at_the_same_addresses(tag):
    @isolated
    def body():
        h = Host(route="vmm")
        a, b, c = captured(h, [64 * KiB, 3 * KiB, 512 * KiB], tag=tag)
        h.free(b)                                     # a hole inside the segment
        before = layout(h, POOL)
        cp = h.checkpoint(POOL)
        assert h.live_matches(POOL, [a, c]) and not h.live_matches(POOL, [a])
        h.free(a)                                     # the layout changes after the checkpoint
        h.begin_pool(POOL, S2)
        d = h.malloc(200 * KiB, S2)
        e = h.malloc(8 * MiB, S2)                     # in a new segment, or further in the arena
        h.end_pool(POOL)
        freed, created = h.restore_checkpoint(cp)
        assert sorted(freed) == sorted([c, d, e])     # everything allocated now is freed
        assert sorted(created) == sorted([a, c])      # the checkpoint's live blocks come back
        assert h.live_matches(POOL, [a, c])
        after = {addr: blocks for addr, blocks in layout(h, POOL)}
        for addr, blocks in before:                  # checkpointed segments: identical
            assert after[addr] == blocks, (addr, blocks, after[addr])
        again_freed, again_created = h.restore_checkpoint(cp)  # a checkpoint can be restored twice
        assert sorted(again_freed) == sorted(again_created) == sorted([a, c])
        for p in (a, c):
            h.free(p)
        h.release_pool(POOL)                          # one use per capture, as torch's graphs hold
        h.release_pool(POOL)
        h.empty_cache()
        assert h.stats()["graph_pool_reserved"]["current"] == 0
        assert h.allocated() == 0
    body()


@isolated
def test_a_restored_one_mib_block_larger_than_its_request_stays_in_torchs_small_pool_stats():
    # Note [Half-granule requests]: a 1 MiB request in a tagged graph pool's large arena takes a
    # 1.5 MiB hole whole (the rest is too small to split); torch counts it in small_pool, and a
    # restored checkpoint re-created it in large_pool, judged by its size.
    h = Host(route="vmm")
    hole, keep = captured(h, [MiB + MiB // 2, 4 * MiB], tag="graphs")
    h.free(hole)
    (one,) = captured(h, [MiB], tag="graphs")
    assert one == hole
    small = h.stats()["allocation"]["small_pool"]["current"]
    cp = h.checkpoint(POOL)
    h.restore_checkpoint(cp)
    st = h.stats()
    assert st["allocation"]["small_pool"]["current"] == small == 1, st["allocation"]
    assert st["requested_bytes"]["small_pool"]["current"] == MiB
    for p in (one, keep):
        h.free(p)
    assert h.stats()["allocation"]["all"]["current"] == 0


@isolated
def test_restoring_a_checkpoint_whose_segment_is_gone_fails_and_changes_nothing():
    h = Host(route="sync")
    (a,) = captured(h, [64 * KiB])
    cp = h.checkpoint(POOL)
    h.free(a)
    h.release_pool(POOL)                              # the pool dies and is destroyed
    with pytest.raises(ValueError, match="no private pool|no longer exists"):
        h.restore_checkpoint(cp)
    (b,) = captured(h, [64 * KiB], pool=(0, 8))
    (c,) = captured(h, [1 * MiB], pool=(0, 8))
    cp2 = h.checkpoint((0, 8))
    with pytest.raises(ValueError, match="unknown checkpoint"):
        h.restore_checkpoint(999)
    freed, created = h.restore_checkpoint(cp2)
    assert sorted(freed) == sorted(created) == sorted([b, c])
    assert h.allocated() == 64 * KiB + 1 * MiB
    h.free(b)
    h.free(c)
    h.release_pool((0, 8))
    assert h.allocated() == 0


@isolated
def test_live_check_of_an_unknown_pool_is_an_error():
    h = Host(route="sync")
    with pytest.raises(ValueError, match="no private pool"):
        h.live_matches((0, 99), [])
    with pytest.raises(ValueError, match="no private pool"):
        h.checkpoint((0, 99))


@isolated
def test_use_on_oom_pool_lends_its_free_blocks_when_the_budget_is_reached():
    h = Host(route="sync", budget=64 * MiB)
    lender, other = (0, 20), (0, 21)
    big = captured(h, [30 * MiB], pool=lender, stream=S1)[0]  # free blocks are lent on their own stream
    held = captured(h, [30 * MiB], pool=other, stream=S1)[0]
    h.pool_options(lender, use_on_oom=1)
    h.free(big)
    h.free(held)
    filler = h.malloc(1 * KiB, S1)                    # a small segment: what is left of the budget
    p = h.malloc(20 * MiB, S1)                        # no room: the lending pool's free block
    owner = [tuple(s["pool"]) for s in h.segments() if s["allocated_size"] >= 20 * MiB]
    assert owner == [lender]
    with pytest.raises(OOM):
        h.malloc(20 * MiB, S1)                        # 'other' does not lend
    h.pool_options(lender, use_on_oom=0)
    h.free(p)
    with pytest.raises(OOM):
        h.malloc(20 * MiB, S1)
    h.free(filler)
    for pool in (lender, other):
        h.release_pool(pool)
    h.empty_cache()
    assert h.reserved() == 0


@isolated
def test_a_no_split_pool_gives_each_allocation_a_whole_segment():
    h = Host(route="sync")
    split, whole = (0, 30), (0, 31)
    for pool in (split, whole):
        h.begin_pool(pool, S2)                        # the pool exists before the option is set
        h.end_pool(pool)
    h.pool_options(whole, no_split=True)
    for pool in (split, whole):
        h.begin_pool(pool, S2)
        h.malloc(4 * MiB, S2)
        h.malloc(4 * MiB, S2)
        h.end_pool(pool)
    segs = {pool: [s for s in h.segments() if tuple(s["pool"]) == pool] for pool in (split, whole)}
    assert len(segs[split]) == 1 and len(segs[whole]) == 2
    assert all(len(s["blocks"]) == 1 for s in segs[whole])
    with pytest.raises(ValueError, match="no memory pool"):
        h.pool_options((0, 77), no_split=True)


@isolated
def test_a_no_split_pool_under_a_tag_gives_each_allocation_whole_granules_not_the_arena():
    # A tagged pool lives in a VMM arena, one free block of the card's size: never splitting it
    # handed a 4 MiB request the whole arena, every byte of the card mapped for it.
    h = Host(capacity=16 * 1024 * MiB, route="vmm")
    pool = (0, 32)
    captured(h, [], pool=pool, tag="kv")  # the pool exists before the option is set
    h.pool_options(pool, no_split=True)
    ptrs = captured(h, [4 * MiB, 512, 3 * MiB], pool=pool, tag="kv")
    assert h.allocated() == h.reserved() == 4 * MiB + 2 * MiB + 4 * MiB

    def blocks():  # address -> size of each allocated block of the pool
        out = {}
        for seg in (s for s in h.segments() if tuple(s["pool"]) == pool):
            at = seg["address"]
            for size, _requested, allocated in seg["blocks"]:
                if allocated:
                    out[at] = size
                at += size
        return out

    assert {p: blocks()[p] for p in ptrs} == dict(zip(ptrs, [4 * MiB, 2 * MiB, 4 * MiB]))
    assert all(p % (2 * MiB) == 0 for p in ptrs), ptrs  # no two blocks share a granule
    h.free(ptrs[0])
    again = captured(h, [4 * MiB - 512], pool=pool, tag="kv")  # the freed block, whole
    assert again == ptrs[:1] and blocks()[again[0]] == 4 * MiB
    for p in again + ptrs[1:]:
        h.free(p)


@pytest.mark.parametrize("route", ["vmm", "sync"])
def test_the_trace_reports_each_action_once(route):
    @isolated
    def body():
        h = Host(route=route, budget=256 * MiB)
        h.trace(True)
        a = h.malloc(5 * MiB)
        b = h.malloc(1 * KiB)
        h.record_stream(b, S2)
        h.submit(S2)                                  # S2 still uses b
        h.free(a)
        h.free(b)                                     # waits for S2's event: completes later
        counts = h.trace(True)
        assert counts["alloc"] == 2 and counts["free_requested"] == 2, counts
        assert counts["free_completed"] == 1, counts
        h.complete(S2)
        h.malloc(1 * KiB)                             # events are polled on the allocation path
        with pytest.raises(OOM):
            h.malloc(1 << 40)
        h.empty_cache()
        counts = h.trace(False)
        assert counts["free_completed"] == 1 and counts["oom"] == 1, counts
        if route == "vmm":
            assert counts["segment_unmap"] >= 1 and counts["segment_alloc"] == 0, counts
        else:
            assert counts["segment_free"] >= 1 and counts["segment_map"] == 0, counts
    body()


@isolated
def test_nested_pool_scopes_allocate_from_the_innermost():
    # torch.cuda.use_mem_pool nests: each scope's pool serves until it ends.
    h = Host(route="sync")
    outer, inner = (0, 40), (0, 41)
    h.begin_pool(outer, S1)
    a = h.malloc(20 * MiB, S1)
    h.begin_pool(inner, S1)
    b = h.malloc(20 * MiB, S1)
    h.end_pool(inner)
    c = h.malloc(20 * MiB, S1)
    h.end_pool(outer)
    owner = {}
    for s in h.segments():
        for p in (a, b, c):
            if s["address"] <= p < s["address"] + s["total_size"]:
                owner[p] = tuple(s["pool"])
    assert owner == {a: outer, b: inner, c: outer}, owner
    for p in (a, b, c):
        h.free(p)
    h.release_pool(outer)
    h.release_pool(inner)
    assert h.reserved() == 0 or h.stats()["graph_pool_reserved"]["current"] == 0


def captured_read(h, sequence, streams_nodes):
    """Each (stream, node, parents): `stream` queues graph node `node` after `parents`."""
    for stream, node, parents in streams_nodes:
        h.node(node, parents)
        h.capture(stream, sequence, [node])


def _capturing_into_the_pool_on_two_streams(reuse):
    """A sync-route host with torch's graph_capture_record_stream_reuse set to `reuse`, S1 and S2
    capturing (capture 1), allocations on S1 going to POOL."""
    h = Host(route="sync")
    h.capture_reuse(reuse)
    h.capture(S1, 1)
    h.capture(S2, 1)
    h.begin_pool(POOL, S1)
    return h


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "default"])
def test_a_block_freed_after_record_stream_is_reused_in_capture_once_the_streams_join(reuse):
    # torch's graph_capture_record_stream_reuse, two streams (Note [Reuse during capture]).
    @isolated
    def body():
        h = _capturing_into_the_pool_on_two_streams(reuse)
        h.malloc(512, S1)                              # a neighbour, so the freed block stays apart
        data1 = h.malloc(512, S1)
        captured_read(h, 1, [(S2, 10, [])])            # s2 reads data1
        h.record_stream(data1, S2)
        h.free(data1)
        data2 = h.malloc(512, S1)                      # s1 has queued nothing after s2's read
        assert data2 != data1
        captured_read(h, 1, [(S1, 11, [10])])          # s1 waits for s2, then queues a kernel
        data3 = h.malloc(512, S1)
        assert (data3 == data1) == reuse
        h.end_pool(POOL)
        h.capture(S1, 0)
        h.capture(S2, 0)
        h.complete(S2)
        h.free(data2)
        h.free(data3)
        h.empty_cache()                                # the deferred block (no reuse) is freed now
        assert h.allocated() == 512
    body()


@isolated
def test_reuse_in_capture_waits_until_every_stream_that_used_the_block_joined():
    # torch's four-stream case: partial joins do not free the block.
    h = Host(route="sync")
    S4 = 0x4000
    h.capture_reuse(True)
    for s in (S1, S2, S3, S4):
        h.capture(s, 7)
    h.begin_pool(POOL, S1)
    captured_read(h, 7, [(S1, 1, [])])                 # data1 is written on s1
    data1 = h.malloc(512, S1)
    h.malloc(512, S1)
    captured_read(h, 7, [(S2, 20, [1]), (S3, 30, [1]), (S4, 40, [1])])
    for s in (S2, S3, S4):
        h.record_stream(data1, s)
    h.free(data1)
    captured_read(h, 7, [(S1, 11, [1, 20]), (S3, 31, [30, 40])])  # s1 joins s2, s3 joins s4
    data2 = h.malloc(512, S1)
    assert data2 != data1
    assert h.malloc(512, S2) != data1                  # only the block's own stream may take it
    captured_read(h, 7, [(S1, 12, [11, 31])])          # s1 joins s3: every use is behind it
    assert h.malloc(512, S1) == data1
    h.end_pool(POOL)


@isolated
def test_reuse_in_capture_is_not_fooled_by_dependencies_set_anew():
    h = _capturing_into_the_pool_on_two_streams(True)
    captured_read(h, 1, [(S1, 9, [])])
    blocks = [h.malloc(512, S1) for _ in range(5)]     # d and c apart, between neighbours
    d, c = blocks[1], blocks[3]
    captured_read(h, 1, [(S2, 10, [9])])               # node 10 on s2 reads d and c
    h.record_stream(d, S2)
    h.record_stream(c, S2)
    h.free(d)
    captured_read(h, 1, [(S1, 11, [10])])              # s1 joins s2: d is behind every use
    assert h.malloc(512, S1) == d                      # (s1's walk has reached 11, 10 and 9)
    # cudaStreamUpdateCaptureDependencies(s1, {12}, SET): s1 follows node 12 alone, not node 10.
    h.node(12, [])
    h.capture(S1, 1, [12])
    h.free(c)
    captured_read(h, 1, [(S1, 14, [12])])
    assert h.malloc(512, S1) != c, "node 10 reads c, and nothing orders it before s1's next work"
    h.end_pool(POOL)


@isolated
def test_a_block_used_on_a_stream_outside_the_capture_waits_for_the_end_of_capture():
    h = Host(route="sync")
    h.capture_reuse(True)
    h.capture(S1, 3)
    h.begin_pool(POOL, S1)
    data1 = h.malloc(512, S1)
    h.malloc(512, S1)
    h.record_stream(data1, S3)                         # s3 is not capturing
    h.free(data1)
    captured_read(h, 3, [(S1, 5, [])])
    assert h.malloc(512, S1) != data1
    h.end_pool(POOL)


def _user_pool_block_freed():
    """A host whose pool (9, 9) has its own allocator (tb_host_user_pool), which gave it one
    segment; the block cut from it is freed. (host, reserved bytes)."""
    h = Host(route="vmm")
    h.free(h.malloc(1 * MiB, S1))
    assert h.lib.tb_host_user_pool(0, 9, 9) == 0
    h.begin_pool((9, 9), S1)
    p = h.malloc(3 * MiB, S1)
    h.end_pool((9, 9))
    h.free(p)
    return h, h.reserved()


def _user_counts(h):
    out = (ctypes.c_int64 * 5)()
    h.lib.tb_host_user_counts(out)
    return {"allocs": out[0], "frees": out[1], "under_lock": out[2], "ends": out[3], "ends_under_lock": out[4]}


@isolated
def test_a_mempools_own_allocator_frees_with_the_device_lock_released():
    # route_user.h: a free built on cudaFree waits for the device, one written in Python takes the
    # GIL; under the device lock either stalls every other thread's allocations, or deadlocks.
    h, reserved = _user_pool_block_freed()
    h.release_pool((9, 9))  # the MemPool's reference and its capture's: the pool dies,
    h.release_pool((9, 9))  # and its segments go back to its allocator
    h.empty_cache()
    counts = _user_counts(h)
    assert counts["allocs"] == 1 and counts["frees"] == 1, counts
    assert counts["under_lock"] == 0, "the pool's own allocator was called under the device lock"
    assert counts["ends"] == 1 and counts["ends_under_lock"] == 0, "the allocator ended under the device lock"
    assert h.reserved() < reserved and h.stats()["num_device_free"] >= 1


@isolated
def test_a_mempool_that_never_allocated_ends_its_allocator_with_the_device_lock_released():
    # No segment holds a reference then: the pool's route holds the allocator's last one.
    h = Host(route="vmm")
    h.free(h.malloc(1 * MiB, S1))
    assert h.lib.tb_host_user_pool(0, 9, 9) == 0
    h.release_pool((9, 9))
    h.empty_cache()
    counts = _user_counts(h)
    assert counts["allocs"] == 0 and counts["ends"] == 1, counts
    assert counts["ends_under_lock"] == 0, "the allocator ended under the device lock"


@isolated
def test_emptying_one_pools_cache_hands_its_own_allocators_segments_back_at_once():
    h, _ = _user_pool_block_freed()
    h.begin_pool((9, 9), S1)
    out = h.malloc(64 * KiB, S1)  # an output that outlives the pool's graphs and its MemPool
    h.end_pool((9, 9))
    for _ in range(3):            # the MemPool's use and both captures'
        h.release_pool((9, 9))
    reserved = h.reserved()
    _native.check(h.lib, h.lib.tb_empty_pool_cache(0, 9, 9))  # ~MemPool's emptyCache(id)
    counts = _user_counts(h)
    assert counts["frees"] == 1 and counts["under_lock"] == 0, counts
    assert h.reserved() < reserved, "the segment left the pool but stayed charged"
    h.free(out)
