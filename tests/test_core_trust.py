"""Defects a review found under the happy path, each reproduced over the host stand-in: memory
used after it went back, memory unmapped under a queued replay, a stream-ordered free inside a
capture, an internal code leaking out of the C ABI, and a shared tag released behind its
consumer's back."""
import os
import subprocess
import sys

import pytest

from _hostcore import OOM, MiB, S1, S2, S3, Host, isolated, while_a_sync_waits
from test_core_pools import _user_counts, captured, captured_read
from torch_budget import _native
from torch_budget.errors import StateError

pytestmark = pytest.mark.built("_host_core")

KiB = 1 << 10
POOL = (0, 7)


def inside_a_segment(h, ptr, size):
    return any(s["address"] <= ptr and ptr + size <= s["address"] + s["total_size"] for s in h.segments())


def restored_over_a_waiting_block(library="_host_core"):
    h = Host(route="sync", library=library)
    h.begin_pool(POOL, S2)
    a = h.malloc(64 * KiB, S2)
    b = h.malloc(64 * KiB, S2)  # a and b share one 2 MiB segment
    c = h.malloc(4 * MiB, S2)   # another segment keeps the pool alive
    h.end_pool(POOL)
    h.record_stream(b, S3)
    h.submit(S3)
    h.free(b)                   # waits on S3
    cp = h.checkpoint(POOL)
    h.restore_checkpoint(cp)
    # The restored segment holds a, then one free range: never two adjacent free blocks.
    seg = next(s for s in h.segments() if s["address"] <= a < s["address"] + s["total_size"])
    states = [blk[2] for blk in seg["blocks"]]  # 0 free, 1 allocated, 2 waiting
    assert all(x == 1 or y == 1 for x, y in zip(states, states[1:])), states
    h.free(a)
    h.release_pool(POOL)        # still alive through c
    h.empty_cache()             # the small segment goes back to the driver
    h.begin_pool(POOL, S2)
    d = h.malloc(64 * KiB, S2)
    h.end_pool(POOL)
    assert inside_a_segment(h, d, 64 * KiB)
    for p in (c, d):
        h.free(p)


@isolated
def test_a_checkpoint_restored_over_a_waiting_block_never_hands_out_freed_memory():
    restored_over_a_waiting_block()


@pytest.mark.built("_host_core_asan")
def test_the_same_restore_is_clean_under_address_sanitizer():
    from test_core_faults import _asan_runtime

    runtime = _asan_runtime()
    if runtime is None:
        pytest.skip("no AddressSanitizer runtime (g++ -print-file-name=libasan.so)")
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); from test_core_trust import restored_over_a_waiting_block; "
            "restored_over_a_waiting_block('_host_core_asan')")
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ERROR: AddressSanitizer" not in report, report[-4000:]


@isolated
def test_graph_pools_are_not_trimmed_while_a_capture_elsewhere_forbids_waiting():
    h = Host(route="vmm", devices=2)
    h.push(tag="graphs")
    h.begin_pool(POOL, S2)
    out = h.malloc(8 * MiB, S2)
    scratch = h.malloc(8 * MiB, S2)
    h.end_pool(POOL)
    h.pop()
    h.free(scratch)                 # free in the pool: every replay of the graph still writes it
    h.empty_cache()                 # a sync: scratch's free stamp is clean; the graph holds the pool
    # ... the graph is replayed (its queued work writes scratch), then destroyed:
    h.release_pool(POOL)            # its output lives on
    unmaps = h.counters()["unmaps"]
    other = h.stream(1)
    h.begin_pool((0, 9), other, device=1)  # a capture on the other device: no device may be waited for
    h.empty_cache(0)
    assert h.counters()["unmaps"] == unmaps
    h.end_pool((0, 9), device=1)
    h.empty_cache(0)                # nothing captures now: the scratch memory goes back
    assert h.counters()["unmaps"] > unmaps
    h.free(out)


@isolated
def test_capture_reuse_never_frees_pool_route_memory_on_the_capturing_stream():
    h = Host(route="pool")
    h.capture_reuse(True)
    x = h.malloc(1 * MiB, S1)        # the stream-ordered pool route, before the capture
    h.capture(S1, 1)
    h.capture(S2, 1)
    h.begin_pool(POOL, S1)
    captured_read(h, 1, [(S2, 10, [])])  # s2 reads x
    h.record_stream(x, S2)
    h.free(x)
    captured_read(h, 1, [(S1, 11, [10])])  # s1 joins s2
    h.fail("cuMemFreeAsync", nth=1)  # counts any stream-ordered free from here on
    h.malloc(512, S1)                # looks for blocks the capture may reuse now
    # x's memory would go back through cuMemFreeAsync on the capturing stream: it waits.
    assert h.counters()["injected"] == 0
    h.heal()
    h.end_pool(POOL)
    h.capture(S1, 0)
    h.capture(S2, 0)
    h.complete(S2)
    h.empty_cache()
    assert h.stats()["routes"]["pool"]["reserved"]["current"] == 0


@isolated
def test_a_capture_on_another_device_leaves_the_pool_routes_out_of_memory_retry_its_cache():
    h = Host(devices=2, capacity=1024 * MiB, route="pool")
    h.set_budget(100 * MiB, device=0)
    h.free(h.malloc(80 * MiB, S1))   # the driver's pool keeps the 80 MiB, charged to device 0
    h.begin_pool(POOL, h.stream(1), device=1)  # a capture is open on device 1 only
    h.push(route="sync")
    p = h.malloc(50 * MiB, S1)       # device 0's retry trims its pool: no stream of it captures
    h.pop()
    assert h.reserved(0) == 50 * MiB
    h.free(p)
    h.end_pool(POOL, device=1)


@isolated
def test_the_pool_route_never_allocates_on_a_stream_that_joined_another_devices_capture():
    h = Host(devices=2, route="pool")
    h.begin_pool(POOL, h.stream(1), device=1)  # a capture is open on device 1 only
    h.capture(S1, 1)                           # device 0's S1 joined it (an event fork)
    # A stream-ordered allocation on S1 would be a node of device 1's graph, not memory.
    p = h.malloc(1 * MiB, S1, device=0)
    h.poke(p, b"held")
    assert h.captured_ordered_calls() == 0 and h.peek(p, 4) == b"held"
    assert [s["stream"] for s in h.segments()] == [S1]  # the block is S1's, as any other
    h.free(p)                                  # its stream-ordered free waits for the capture
    h.fail("cuStreamSynchronize", rate=1.0)    # the wait for the route's own stream is refused
    with pytest.raises(Exception):
        h.malloc(3 * MiB, S1, device=0)
    h.heal()
    assert h.captured_ordered_calls() == 0
    h.capture(S1, 0)
    h.end_pool(POOL, device=1)
    h.free(h.malloc(512, S2))                  # settles the held free
    h.empty_cache()
    assert h.reserved() == 0 and h.stats()["routes"]["pool"]["reserved"]["current"] == 0


@isolated
def test_releasing_the_pool_routes_cache_skips_segments_whose_stream_captures():
    h = Host(devices=2, route="pool", budget=16 * MiB)
    h.fail("cuMemFreeAsync", rate=1.0)  # frees refused: an idle segment on S1 and one on S2 stay
    h.free(h.malloc(1 * MiB, S1))
    h.free(h.malloc(1 * MiB, S2))
    h.heal()
    h.lib.tb_host_pool_chunk(32 * MiB)  # the pool now grows by more than its growths so far foretell
    # A capture begun on this device: torch begins allocating to its pool before its stream
    # captures, so no stream can be asked yet, and no idle segment is freed.
    h.begin_pool(POOL, S1)
    h.fail("cuMemFreeAsync", nth=1)     # rolling back the growth past the budget is refused
    with pytest.raises(OOM):            # so the failure trims the pool back within the budget
        h.malloc(2 * MiB, S2)
    h.heal()
    assert len(h.segments()) == 3 and h.reserved() == 4 * MiB
    h.end_pool(POOL)
    # A capture on another device that S1 joined: only S1's segment stays.
    h.begin_pool(POOL, h.stream(1), device=1)
    h.capture(S1, 1)
    h.empty_cache()
    assert [s["stream"] for s in h.segments()] == [S1] and h.reserved() == 1 * MiB
    h.capture(S1, 0)
    h.end_pool(POOL, device=1)
    h.empty_cache()
    assert h.reserved() == 0 and h.segments() == []


@isolated
def test_a_restore_out_of_memory_says_so_and_never_leaks_the_internal_code():
    h = Host(route="vmm", budget=64 * MiB)
    h.push(tag="graphs")
    h.begin_pool(POOL, S2)
    a = h.malloc(20 * MiB, S2)
    b = h.malloc(4 * MiB, S2)        # keeps the pool's arena
    h.end_pool(POOL)
    h.pop()
    cp = h.checkpoint(POOL)
    h.free(a)
    h.release_pool(POOL)             # no graph holds it: empty_cache trims a's memory
    h.empty_cache()
    x = h.malloc(30 * MiB, S2)       # dirty memory of the pool's stream...
    h.submit(S2)
    h.free(x)
    y = h.malloc(30 * MiB, S1)       # ...and live memory fill the budget
    with pytest.raises(OOM):
        h.restore_checkpoint(cp)     # a's memory is refused: an out-of-memory error, never code 100
    assert h.lib.tb_last_error_code() != 100
    h.free(y)
    del b


def three_blocks_in_a_pool(h):
    h.begin_pool(POOL, S2)
    blocks = [h.malloc(64 * KiB, S2), h.malloc(64 * KiB, S2), h.malloc(4 * MiB, S2)]
    h.end_pool(POOL)
    return blocks


@isolated
def test_a_restore_that_cannot_wait_for_a_stream_of_another_device_frees_nothing():
    # The restore freed the pool's live blocks, then found b still waiting on cuda:1, which
    # synchronising cuda:0 does not cover: torch kept tensors whose memory the next capture got.
    h = Host(route="sync", devices=2)
    a, b, c = three_blocks_in_a_pool(h)
    cp = h.checkpoint(POOL)
    peer = h.stream(1)
    h.submit(peer)                        # a kernel on cuda:1 reads b, still queued
    h.record_stream(b, peer, device=1)
    errors = []
    freed, created = h.restore_checkpoint(cp, errors=errors)
    assert isinstance(errors[0], StateError) and "used on a stream of device 1" in str(errors[0])
    assert (freed, created) == ([], []) and h.live_matches(POOL, [a, b, c])
    h.begin_pool(POOL, S2)
    x = h.malloc(64 * KiB, S2)            # the graph tree goes on: never a live tensor's memory
    h.end_pool(POOL)
    assert x not in (a, b)


@isolated
def test_a_restore_that_needs_a_wait_while_a_capture_is_open_elsewhere_frees_nothing():
    h = Host(route="sync", devices=2)
    a, b, c = three_blocks_in_a_pool(h)
    cp = h.checkpoint(POOL)
    h.submit(S3)
    h.record_stream(b, S3)                # b is read on S3, still queued: its free must wait
    h.begin_pool((0, 9), h.stream(1), device=1)   # another thread captures on cuda:1
    errors = []
    freed, created = h.restore_checkpoint(cp, errors=errors)
    h.end_pool((0, 9), device=1)
    assert isinstance(errors[0], StateError) and "impossible during capture" in str(errors[0])
    assert (freed, created) == ([], []) and h.live_matches(POOL, [a, b, c])
    h.complete(S3)
    freed, created = h.restore_checkpoint(cp)      # once no capture forbids the wait, it works
    assert sorted(freed) == sorted([a, b, c]) and len(created) == 3


@isolated
def test_a_tag_is_not_released_under_work_another_device_still_queues_on_its_memory():
    # Synchronising cuda:0 left x waiting on cuda:1's kernel, and the release unmapped it.
    h = Host(route="vmm", devices=2)
    h.push("vmm", "t")
    keep = h.malloc(2 * MiB, S1)
    x = h.malloc(8 * MiB, S1)
    h.pop()
    peer = h.stream(1)
    h.submit(peer)                        # a kernel on cuda:1 reads x, still queued
    h.record_stream(x, peer, device=1)
    h.free(x)
    mapped = sum(seg["mapped_size"] for seg in h.segments())
    with pytest.raises(StateError, match="1 freed allocation\\(s\\) still in use by work queued on the streams "
                                         "they were recorded on"):
        h.release("t")
    assert h.tag_info("t")["life"] == 0 and sum(seg["mapped_size"] for seg in h.segments()) == mapped
    h.complete(peer)
    h.release("t")                        # once that work is done
    h.restore("t")
    h.free(keep)


@isolated
def test_a_tag_shared_with_another_process_is_not_released_behind_its_back():
    h = Host(route="vmm")
    h.push("vmm", "weights")
    w = h.malloc(8 * MiB)
    h.pop()
    handle, offset = h.share(w)
    assert handle and offset == 0
    live = h.tag_info("weights")["life"]
    with pytest.raises(StateError, match="shared with another process"):
        h.release("weights", "pinned")
    assert h.tag_info("weights")["life"] == live
    h.free(w)                        # the consumers are done: torch frees the producer's tensor
    h.push("vmm", "weights")
    v = h.malloc(8 * MiB)
    h.pop()
    h.release("weights", "pinned")
    h.restore("weights")
    h.free(v)


def mempool_captured_into(h, stream):
    """A MemPool with its own allocator (one use) that graph g was captured into (a second):
    g's output lives; a temporary in a segment of its own was freed, which every replay of g
    still writes. Returns (the pool's id, the output)."""
    user = (9, 9)
    assert h.lib.tb_host_user_pool(0, *user) == 0
    h.begin_pool(user, stream)
    out = h.malloc(1 * MiB, stream)
    h.free(h.malloc(12 * MiB, stream))
    h.end_pool(user)
    return user, out


@isolated
def test_a_mempool_with_its_own_allocator_keeps_its_segments_while_a_graph_holds_it():
    h = Host(route="vmm")
    user, out = mempool_captured_into(h, S1)
    segments = [s for s in h.segments() if tuple(s["pool"]) == user]
    h.release_pool(user)                            # ~MemPool: releasePool, then emptyCache(id)
    _native.check(h.lib, h.lib.tb_empty_pool_cache(0, *user))
    assert _user_counts(h)["frees"] == 0, "the pool's allocator got memory back that graph g still uses"
    assert [s for s in h.segments() if tuple(s["pool"]) == user] == segments
    h.release_pool(user)                            # g is reset; its output keeps the pool
    h.begin_pool((0, 5), S2)                        # a capture elsewhere: the device cannot be synchronised
    _native.check(h.lib, h.lib.tb_empty_pool_cache(0, *user))
    assert _user_counts(h)["frees"] == 0, "given back without the synchronisation a replay needs"
    h.end_pool((0, 5))
    _native.check(h.lib, h.lib.tb_empty_pool_cache(0, *user))
    assert _user_counts(h)["frees"] == 1
    assert [s for s in h.segments() if tuple(s["pool"]) == user] == [s for s in segments if s["allocated_size"]]
    h.free(out)
    h.release_pool((0, 5))
    h.empty_cache()
    assert h.allocated() == 0


@isolated
def test_a_capture_that_begins_while_a_release_waits_for_the_device_keeps_its_memory():
    h = Host(route="vmm")
    h.push(tag="graphs")
    w = h.malloc(8 * MiB, S1)
    h.pop()

    def capture():                   # a capture begins meanwhile, into a pool of the tag
        h.push(tag="graphs")
        h.begin_pool(POOL, S2)
        try:
            return h.malloc(4 * MiB, S2)
        finally:
            h.pop()

    # the release waits for the device, the lock released
    _, released, x = while_a_sync_waits(h, lambda: h.release("graphs"), capture)
    assert isinstance(released, StateError) and "capture is open" in str(released), released
    assert h.tag_info("graphs")["life"] == 0
    assert h.poke(x, b"x" * 4096) and h.peek(x, 4096) == b"x" * 4096, "the capture's block was unmapped"
    h.end_pool(POOL)
    h.release("graphs")              # no capture now: it goes
    h.restore("graphs")
    for p in (w, x):
        h.free(p)
    h.release_pool(POOL)


@isolated
def test_a_pool_that_dies_while_a_capture_begins_is_destroyed_when_the_capture_ends():
    h = Host(route="vmm")
    dying = (0, 8)
    (a,) = captured(h, [4 * MiB], pool=dying, tag="graphs", stream=S1)  # on the VMM route
    h.free(a)
    unmaps = h.counters()["unmaps"]

    def capture():                   # a capture begins meanwhile
        h.begin_pool(POOL, S2)
        h.fail("cuThreadExchangeStreamCaptureMode", nth=1)  # counts a switch to relaxed capture mode

    # the pool dies (a replay may run): its destruction waits for the device, the lock released
    while_a_sync_waits(h, lambda: h.release_pool(dying), capture)
    assert h.counters()["unmaps"] == unmaps, "unmapped while a capture is open"
    assert h.counters()["injected"] == 0
    assert dying in {tuple(s["pool"]) for s in h.segments()}
    h.heal()
    h.end_pool(POOL)                 # the last capture ended: the dead pool goes now
    assert h.counters()["unmaps"] > unmaps
    assert dying not in {tuple(s["pool"]) for s in h.segments()}
    h.release_pool(POOL)


@isolated
def test_a_trim_waiting_for_a_stream_while_a_capture_begins_unmaps_nothing():
    h = Host(route="vmm")
    h.push(tag="graphs")
    p = h.malloc(8 * MiB, S1)
    h.pop()
    h.submit(S1)
    h.free(p)                        # not clean: S1 may still use it
    unmaps = h.counters()["unmaps"]
    # the trim waits for S1, the lock released; a capture begins meanwhile
    _, trimmed, _ = while_a_sync_waits(h, lambda: h.trim("graphs"), lambda: h.begin_pool(POOL, S2))
    assert isinstance(trimmed, StateError) and "capture is open" in str(trimmed), trimmed
    assert h.counters()["unmaps"] == unmaps
    h.end_pool(POOL)
    assert h.trim("graphs") > 0
    h.release_pool(POOL)


def _dirty_workspace(h, nbytes=256 * MiB):
    """A freed block of tag 'workspace' with work still queued on S1: its trim waits for S1."""
    h.push("vmm", "workspace")
    big = h.malloc(nbytes)
    h.pop()
    h.submit(S1)
    h.free(big)


@isolated
def test_a_trims_figure_is_what_it_gave_back_whatever_another_thread_allocates_while_it_waits():
    h = Host(route="vmm")
    _dirty_workspace(h)
    finished, returned, other = while_a_sync_waits(h, lambda: h.trim("workspace"), lambda: h.malloc(512 * MiB, S2))
    assert finished and isinstance(other, int), other
    assert h.tag_info("workspace")["resident"] == 0 and returned == 256 * MiB


@isolated
def test_a_trims_figure_counts_the_sync_routes_segments_it_freed():
    h = Host(vmm=False, route="sync")
    h.push(None, "cudagraph")
    h.begin_pool(POOL, S1)
    blocks = [h.malloc(4 * MiB, S1), h.malloc(4 * MiB, S1)]
    h.end_pool(POOL)
    h.pop()
    h.submit(S1)                     # a replay may still run: the trim waits for it
    h.release_pool(POOL)
    for b in blocks:
        h.free(b)
    before = h.reserved()
    assert before > 0 and h.trim("cudagraph") == before and h.reserved() == 0


@isolated
def test_a_trims_figure_leaves_out_what_others_had_waiting_for_the_driver():
    h = Host(vmm=False, route="sync")
    h.free(h.malloc(30 * MiB, S2))          # an untagged segment, cached
    h.fail("cuMemFree", rate=1.0, result=2)
    h.empty_cache()                          # its cuMemFree fails: it waits for a later try
    h.push(None, "cudagraph")
    h.begin_pool(POOL, S1)
    blocks = [h.malloc(4 * MiB, S1), h.malloc(4 * MiB, S1)]
    h.end_pool(POOL)
    h.pop()
    h.submit(S1)
    h.release_pool(POOL)
    for b in blocks:
        h.free(b)
    h.heal()
    pool_bytes = h.reserved() - 30 * MiB
    assert h.trim("cudagraph") == pool_bytes  # the untagged segment went back too, but it is no tag's
    assert h.reserved() == 0


@isolated
def test_two_trims_at_once_each_count_only_what_they_gave_back():
    h = Host(route="vmm")
    _dirty_workspace(h)
    h.push("vmm", "other")
    h.free(h.malloc(128 * MiB, S2))  # clean: its trim needs no wait

    def trim_other():
        h.pass_syncs(4)
        return h.trim("other")
    finished, returned, other = while_a_sync_waits(h, lambda: h.trim("workspace"), trim_other)
    h.pop()
    assert finished, other
    assert (returned, other) == (256 * MiB, 128 * MiB)


@isolated
def test_a_block_captured_into_a_tags_pool_outside_its_region_belongs_to_the_tag():
    h = Host(route="vmm")
    graphs = h.tag("graphs")
    (a,) = captured(h, [2 * MiB], tag="graphs")   # POOL is created under 'graphs'
    (b,) = captured(h, [4 * MiB])                 # captured into again, outside the region
    assert h.lib.tb_ptr_tag(b) == graphs
    tags = h.stats()["tags"]
    assert tags["graphs"]["allocated"]["current"] == 6 * MiB
    assert tags["untagged"]["allocated"]["current"] == 0
    cp = h.checkpoint(POOL)
    h.restore_checkpoint(cp)                      # moves no bytes between tags
    assert h.stats()["tags"]["graphs"]["allocated"]["current"] == 6 * MiB
    _native.check(h.lib, h.lib.tb_set_tag_budget(0, graphs, 6 * MiB, -1.0))
    h.begin_pool(POOL, S2)
    with pytest.raises(OOM, match="tag 'graphs'"):
        h.malloc(2 * MiB, S2)                     # the pool's tag's budget holds outside the region too
    h.end_pool(POOL)
    h.release("graphs")
    assert h.tag_info("graphs")["resident"] == 0
    h.restore("graphs")
    for p in (a, b):
        h.free(p)
    for _ in range(3):
        h.release_pool(POOL)


@isolated
def test_restoring_a_checkpoint_of_a_released_tags_pool_is_refused_and_changes_nothing():
    h = Host(route="vmm")
    a, c = captured(h, [64 * KiB, 512 * KiB], tag="graphs")
    h.poke(a, b"a" * 4096)
    cp = h.checkpoint(POOL)
    h.release("graphs", "cpu")
    maps = h.counters()["maps"]
    errors = []
    freed, created = h.restore_checkpoint(cp, errors=errors)
    assert len(errors) == 1 and isinstance(errors[0], StateError), errors
    assert "tag 'graphs'" in str(errors[0]) and "released" in str(errors[0])
    assert freed == created == []
    assert h.counters()["maps"] == maps and h.tag_info("graphs")["resident"] == 0
    assert h.live_matches(POOL, [a, c])
    h.restore("graphs")
    assert h.peek(a, 4096) == b"a" * 4096
    freed, created = h.restore_checkpoint(cp)     # a live tag: it is restored
    assert sorted(freed) == sorted(created) == sorted([a, c])
    for p in (a, c):
        h.free(p)
    h.release_pool(POOL)


def replayed_and_reset_while(h, call, pool, capture=False):
    """Runs `call` (which synchronises the device) while a graph in `pool` (captured then, with
    `capture`) is replayed on S2 and then reset, all after that synchronisation began: the
    replay is not covered by it."""
    def replay_then_reset():
        if capture:
            h.begin_pool(pool, S2)
            h.end_pool(pool)
        h.submit(S2)           # graph.replay(): writes the pool's free blocks
        h.release_pool(pool)   # graph.reset(): the pool's last use dropped
    finished, _, _ = while_a_sync_waits(h, call, replay_then_reset)
    assert finished


@isolated
def test_a_graph_pool_whose_last_use_drops_during_empty_caches_sync_keeps_its_memory():
    h = Host(route="vmm")
    h.push(tag="graphs")
    h.begin_pool(POOL, S2)
    out = h.malloc(4 * MiB, S2)      # the graph's output, kept by the user
    scratch = h.malloc(8 * MiB, S2)
    h.end_pool(POOL)
    h.pop()
    h.free(scratch)                  # free in the pool: every replay still writes it
    h.empty_cache()                  # the graph holds the pool: nothing of it goes back
    unmaps = h.counters()["unmaps"]
    replayed_and_reset_while(h, h.empty_cache, POOL)
    assert h.counters()["unmaps"] == unmaps, "unmapped under a replay queued after empty_cache's sync began"
    h.empty_cache()                  # a synchronisation that started after the reset: now it goes back
    assert h.counters()["unmaps"] > unmaps
    h.free(out)


@isolated
def test_a_mempool_captured_into_during_empty_pool_caches_sync_keeps_its_segments():
    h = Host(route="vmm")
    user, out = mempool_captured_into(h, S2)        # a first graph's capture: its output, a temporary
    h.release_pool(user)                            # that graph reset
    h.release_pool(user)                            # ~MemPool: no use left, so the pool is freeable
    # While emptying the pool's cache waits for the device, a graph is captured into it, replayed
    # (its queued work writes tmp's memory) and reset.
    replayed_and_reset_while(h, lambda: _native.check(h.lib, h.lib.tb_empty_pool_cache(0, *user)), user,
                             capture=True)
    assert _user_counts(h)["frees"] == 0, "given back under a replay queued after the sync began"
    _native.check(h.lib, h.lib.tb_empty_pool_cache(0, *user))
    assert _user_counts(h)["frees"] == 1
    h.free(out)


@isolated
def test_a_block_read_by_eager_work_queued_before_its_stream_joined_a_capture_is_not_reused_in_it():
    h = Host(route="sync")
    h.capture_reuse(True)
    x = h.malloc(512, S1)            # eager, in the default pool
    keep = h.malloc(512, S1)         # a neighbour: x stays a block of its own
    h.submit(S2)                     # an eager kernel on S2 reads x, still queued
    h.record_stream(x, S2)
    h.node(5)
    h.capture(S1, 1, [5])            # S1 captures; S2 joins after S1's first node
    h.capture(S2, 1, [5])
    h.begin_pool(POOL, S1)
    h.free(x)                        # every stream's tail is node 5
    h.malloc(512, S1)                # S1 has reached node 5: in-capture reuse would retire x here
    h.end_pool(POOL)
    h.capture(S1, 0)
    h.capture(S2, 0)
    z = h.malloc(512, S1)            # eager, after the capture, while S2's read is still queued
    assert z != x, "handed out again while eager work queued before the capture still reads it"
    h.complete(S2)
    for p in (z, keep):
        h.free(p)


@isolated
def test_a_mempool_block_read_by_eager_work_queued_before_a_capture_is_not_reused_in_it():
    mempool, graph = (7, 7), (8, 8)
    h = Host(route="sync")
    h.capture_reuse(True)
    h.begin_pool(mempool, S3)        # torch.cuda.use_mem_pool for S3's eager work: a graph pool
    x = h.malloc(512, S3)            # eager, into the MemPool
    keep = h.malloc(512, S3)         # a neighbour: x stays a block of its own
    h.submit(S2)                     # an eager kernel on S2 reads x, still queued
    h.record_stream(x, S2)
    h.node(5)
    h.capture(S3, 1, [5])            # S3 starts a real capture; S2 joins after its first node
    h.capture(S2, 1, [5])
    h.begin_pool(graph, S3)
    h.free(x)
    h.malloc(512, S3)                # S3 has reached node 5: in-capture reuse would retire x here
    h.end_pool(graph)
    h.capture(S3, 0)
    h.capture(S2, 0)
    z = h.malloc(512, S3)            # eager, still in the MemPool, while S2's read is queued
    assert z != x, "handed out again while eager work queued before the capture still reads it"
    h.complete(S2)
    for p in (z, keep):
        h.free(p)
    h.end_pool(mempool)


@isolated
def test_a_pool_growth_whose_rollback_free_is_refused_is_not_lost():
    h = Host(route="pool", budget=16 * MiB, pool_chunk=32 * MiB)
    h.fail("cuMemFreeAsync", nth=1)     # the rollback of the growth past the budget is refused
    try:
        h.free(h.malloc(1 * MiB, S1))   # the pool grew by 32 MiB; the retry may use what it kept
    except OOM:
        pass
    h.heal()
    h.empty_cache()
    assert h.counters()["allocs"] == 0 and h.reserved() == 0, "the driver still holds the growth"


@isolated
def test_an_allocation_that_waited_for_the_device_is_refused_if_its_tag_was_released_meanwhile():
    import threading

    h = Host(route="vmm", budget=45 * MiB, reuse_before_grow=False)
    s = h.stream(0)
    h.push("vmm", "w")
    a = h.malloc(3 * MiB, s)         # its second granule is half free
    h.pop()
    h.poke(a, b"\x5a" * (3 * MiB))
    x = h.malloc(40 * MiB, s)        # untagged, freed dirty: only a device sync makes it clean
    h.submit(s)
    h.free(x)
    out = {}

    def allocate():
        h.push("vmm", "w")
        try:                         # over the budget: release_cached waits for the device, unlocked
            out["p"] = h.malloc(3 * MiB, s)
        except Exception as e:
            out["p"] = e
        finally:
            h.pop()

    h.hold_syncs(True)
    t = threading.Thread(target=allocate)
    t.start()
    h.hold_syncs(True, wait_for=1)   # the allocation waits in its synchronisation
    h.pass_syncs(10**6)              # the release's own go through
    h.release("w", "pinned")
    h.hold_syncs(False)
    t.join()
    # Served, it would have been memory behind a released tag: the restore copies the backup over
    # the part of it that shares a granule with the released block.
    assert isinstance(out["p"], StateError) and "released" in str(out["p"]), out
    h.restore("w")
    assert h.peek(a, 3 * MiB) == b"\x5a" * (3 * MiB)
    h.free(a)

