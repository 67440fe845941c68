"""Sharing VMM memory in torch's own expandable-segment format (Note [Sharing run mappings],
csrc/core/route_vmm_share.cpp), over the host stand-in: run mappings of different lengths are
mapped again with handles of one size before the first export, contents, reserved memory and
the budget unchanged, waiting for the device with the allocator's lock released; refused, with
nothing changed, while a capture is open, past the budget, or when the block was freed meanwhile;
only the handles under the block go out, and none is ever mapped again."""
import ctypes
import os
import struct

import pytest

from _hostcore import OOM, MiB, S1, S2, Host, in_child, isolated, while_a_sync_waits
from torch_budget import _native
from torch_budget.errors import StateError

pytestmark = pytest.mark.built("_host_core")


def parse(handle):
    """torch's layout: version, 'e', ShareHeader {pid_t pid; size_t segment_size; size_t
    num_handles} (24 bytes, 4 of padding after the pid), then one int per handle."""
    assert handle[0] == 2 and handle[1:2] == b"e", handle[:2]
    pid, _pad, segment, count = struct.unpack_from("=iiQQ", handle, 2)
    assert len(handle) == 2 + 24 + 4 * count, (len(handle), count)
    fds = list(struct.unpack_from(f"={count}i", handle, 26))
    return pid, segment, fds


def pattern(n, seed):
    """Byte i is (7 i + seed) mod 256: a cycle of 256 bytes repeated (byte by byte in Python, 40 MiB
    took 3 s)."""
    cycle = bytes((i * 7 + seed) & 0xFF for i in range(256))
    return (cycle * (n // 256 + 1))[:n]


@isolated
def test_runs_of_different_lengths_are_shared_as_handles_of_one_size_with_contents_kept():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)                      # mapped as runs of 16, 16 and 8 MiB
    data = pattern(40 * MiB, 3)
    h.poke(t, data)
    reserved, allocs = h.reserved(), h.stats()["num_device_alloc"]
    handle, offset = h.share(t)
    pid, segment, fds = parse(handle)
    assert pid == os.getpid()
    assert segment == 8 * MiB and len(fds) == 5 and offset == 0
    assert len(set(fds)) == 5
    assert h.peek(t, 40 * MiB) == data          # the same bytes, now on five 8 MiB handles
    assert h.reserved() == reserved             # the old runs went back as the new handles came
    assert h.stats()["num_device_alloc"] == allocs + 4
    assert h.share(t) == (handle, offset)       # the same handles the second time, nothing moved
    assert h.stats()["num_device_alloc"] == allocs + 4
    h.free(t)
    h.empty_cache()
    assert h.reserved() == 0 and h.device_used() == 0


@isolated
def test_a_range_of_one_run_length_is_shared_as_it_is():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(32 * MiB)                      # two runs of 16 MiB
    allocs = h.stats()["num_device_alloc"]
    handle, offset = h.share(t)
    _, segment, fds = parse(handle)
    assert segment == 16 * MiB and len(fds) == 2 and offset == 0
    assert h.stats()["num_device_alloc"] == allocs
    h.free(t)


@isolated
def test_a_block_inside_a_run_is_shared_from_the_runs_start():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(16 * MiB)                      # one run of 16 MiB
    base = t
    h.free(t)
    a = h.malloc(6 * MiB)
    b = h.malloc(6 * MiB)                       # both inside the run, b not at its start
    assert base <= a < b < base + 16 * MiB and b != base
    h.poke(b, pattern(6 * MiB, 9))
    handle, offset = h.share(b)
    _, segment, fds = parse(handle)
    assert (segment, len(fds)) == (16 * MiB, 1)
    assert b - offset == base                   # the offset counts from the run's start
    assert h.peek(b, 6 * MiB) == pattern(6 * MiB, 9)
    h.free(a)
    h.free(b)


@isolated
def test_sharing_that_needs_new_handles_is_refused_while_a_capture_is_open():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)
    h.poke(t, pattern(40 * MiB, 5))
    h.begin_pool((0, 3), S2)
    with pytest.raises(StateError, match="capture"):
        h.share(t)
    h.end_pool((0, 3))
    _, segment, fds = parse(h.share(t)[0])
    assert (segment, len(fds)) == (8 * MiB, 5)
    assert h.peek(t, 40 * MiB) == pattern(40 * MiB, 5)
    h.free(t)


@isolated
def test_sharing_past_the_budget_is_an_out_of_memory_error_and_changes_nothing():
    h = Host(route="vmm", map_run=16 * MiB, budget=48 * MiB)
    t = h.malloc(40 * MiB)
    h.poke(t, pattern(40 * MiB, 1))
    allocs = h.stats()["num_device_alloc"]
    with pytest.raises(OOM, match="budget"):
        h.share(t)                              # re-mapping a 16 MiB run needs 16 MiB more for a moment
    assert h.peek(t, 40 * MiB) == pattern(40 * MiB, 1)
    assert h.reserved() == 40 * MiB and h.stats()["num_device_alloc"] == allocs
    h.set_budget(64 * MiB)
    _, segment, fds = parse(h.share(t)[0])
    assert (segment, len(fds)) == (8 * MiB, 5)
    assert h.reserved() <= 48 * MiB
    h.free(t)


@isolated
def test_a_driver_failure_while_mapping_again_leaves_the_memory_as_it_was():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)
    h.poke(t, pattern(40 * MiB, 2))
    reserved, used = h.reserved(), h.device_used()
    # Each run of 16 MiB: two new handles mapped at a scratch range (maps 1, 2), access, the copy,
    # scratch and old range unmapped (unmaps 1, 2), the new handles mapped in its place (maps 3, 4),
    # access; the second run after (maps 5 to 8); then the exports.
    for entry, nth in [("cuMemCreate", 1), ("cuMemCreate", 2), ("cuMemMap", 1), ("cuMemMap", 3), ("cuMemMap", 4),
                       ("cuMemMap", 7), ("cuMemSetAccess", 1), ("cuMemSetAccess", 2), ("cuMemcpyDtoDAsync", 1),
                       ("cuMemUnmap", 1), ("cuMemUnmap", 2), ("cuMemExportToShareableHandle", 3)]:
        h.fail(entry, nth=nth)
        with pytest.raises(Exception):
            h.share(t)
        h.heal()
        assert h.peek(t, 40 * MiB) == pattern(40 * MiB, 2), (entry, nth)
        assert (h.reserved(), h.device_used()) == (reserved, used), (entry, nth)
    _, segment, fds = parse(h.share(t)[0])
    assert (segment, len(fds)) == (8 * MiB, 5)
    h.free(t)
    h.empty_cache()
    assert h.device_used() == 0


def _serves_again_and_goes_back(h):
    """A 40 MiB allocation where a failed share left its range holds what is written to it, and
    its memory goes back to the driver whole."""
    t = h.malloc(40 * MiB)
    h.poke(t, pattern(40 * MiB, 3))
    assert h.peek(t, 40 * MiB) == pattern(40 * MiB, 3)
    h.free(t)
    h.empty_cache()
    assert h.reserved() == 0 == h.device_used()


@isolated
def test_a_mapping_the_driver_refuses_to_put_back_is_booked_unmapped_and_not_held_for_good():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)                       # runs of 16, 16 and 8 MiB
    h.poke(t, pattern(40 * MiB, 2))
    # Maps 1, 2 stage the first run's new handles; map 3, the first of them at t, fails, and so
    # does every later one: the old handle cannot be mapped back either.
    h.fail("cuMemMap", nth=-3)
    with pytest.raises(Exception, match="contents lost"):
        h.share(t)
    h.heal()
    assert h.peek(t, 16 * MiB) is None           # what the driver left, and what the books say:
    assert h.peek(t + 16 * MiB, 24 * MiB) == pattern(40 * MiB, 2)[16 * MiB:]
    assert h.reserved() == 24 * MiB == h.device_used()
    h.free(t)
    _serves_again_and_goes_back(h)               # maps new memory where the old went


@isolated
def test_new_memory_the_driver_refuses_to_unmap_stays_booked_with_the_contents_copied_into_it():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)
    h.poke(t, pattern(40 * MiB, 2))
    # Map 3 puts the first new 8 MiB handle at t, map 4 fails; unmapping that handle again is
    # refused (unmap 3 on), so the old handle cannot go back over it either (map 5 on).
    h.fail("cuMemMap", nth=-4)
    h.fail("cuMemUnmap", nth=-3)
    with pytest.raises(Exception, match="8388608 bytes .* contents lost"):
        h.share(t)
    h.heal()
    assert h.reserved() == 32 * MiB == h.device_used()  # the books and the driver agree
    assert h.peek(t, 8 * MiB) == pattern(40 * MiB, 2)[:8 * MiB]  # copied before the failure
    h.free(t)
    for _ in range(2):
        _serves_again_and_goes_back(h)


@isolated
def test_new_memory_all_mapped_that_the_driver_refuses_to_unmap_is_said_to_stay_with_nothing_lost():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)
    h.poke(t, pattern(40 * MiB, 2))
    # Both new 8 MiB handles are mapped at t; access for them (access 2) fails, and unmapping
    # them again (unmap 3 on) is refused: they stay, holding the copied contents.
    h.fail("cuMemSetAccess", nth=-2)
    h.fail("cuMemUnmap", nth=-3)
    with pytest.raises(Exception) as e:
        h.share(t)
    h.heal()
    assert "could not be unmapped, so it stays there with the contents copied into it" in str(e.value)
    assert "contents lost" not in str(e.value), e.value  # it said "0 bytes ... unmapped and their contents lost"
    assert h.reserved() == 40 * MiB == h.device_used()
    assert h.peek(t, 40 * MiB) == pattern(40 * MiB, 2)
    h.free(t)
    _serves_again_and_goes_back(h)


@pytest.mark.parametrize("entry_point", ["cuMemUnmap", "cuMemAddressFree"])
@isolated
def test_a_scratch_range_the_driver_will_not_unmap_or_free_stays_booked_and_goes_back_later(entry_point):
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)                       # runs of 16, 16 and 8 MiB
    h.poke(t, pattern(40 * MiB, 2))
    # From its first call on, the driver refuses: unmapping the first run's scratch range (its copy
    # made), which fails the share; or freeing that range's addresses once its handles took the old
    # run's place, which does not.
    h.fail(entry_point, nth=-1)
    if entry_point == "cuMemUnmap":
        with pytest.raises(Exception):
            h.share(t)
    else:
        h.share(t)
    h.heal()
    assert h.peek(t, 40 * MiB) == pattern(40 * MiB, 2)
    assert h.reserved() == h.device_used()       # what the scratch range still holds is booked
    h.free(t)
    h.empty_cache()                              # and goes back with the cache
    counters = h.counters()
    assert (h.reserved(), h.device_used(), counters["mappings"], counters["handles"]) == (0, 0, 0, 0)
    assert counters["reservations"] == 0, "the scratch range's addresses were never freed"


@isolated
def test_a_mapping_put_back_without_access_is_reached_before_its_memory_serves_again():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)
    h.poke(t, pattern(40 * MiB, 2))
    # Access 1: the scratch range; access 2, for the new handles at t, fails, and so does every
    # later one: the old handle goes back without access.
    h.fail("cuMemSetAccess", nth=-2)
    with pytest.raises(Exception):
        h.share(t)
    h.heal()
    assert not h.can_access(0, t) and h.can_access(0, t + 16 * MiB)
    h.free(t)
    t = h.malloc(40 * MiB)                       # the same memory, reached before it serves
    assert h.can_access(0, t) and h.peek(t, 40 * MiB) == pattern(40 * MiB, 2)
    h.free(t)
    h.empty_cache()
    assert h.reserved() == 0 == h.device_used()


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def open_fds():
    return len(os.listdir("/proc/self/fd"))


@isolated
def test_a_block_after_a_split_exports_only_the_handles_under_it_and_they_outlive_its_neighbour():
    h = Host(route="vmm", map_run=16 * MiB)
    base = h.malloc(16 * MiB)                   # one run of 16 MiB
    h.free(base)
    a = h.malloc(14 * MiB)
    b = h.malloc(4 * MiB)                       # 2 MiB in the run, 2 MiB on a mapping of its own
    assert (a, b) == (base, base + 14 * MiB)
    h.poke(b, pattern(4 * MiB, 4))
    handle, offset = h.share(b)                 # the run is cut into 2 MiB handles
    _, segment, fds = parse(handle)
    assert (segment, len(fds), offset) == (2 * MiB, 2, 0)  # b's two handles, none that holds only a
    h.free(a)
    h.empty_cache()                             # a's seven handles go back to the driver
    assert h.reserved() == 4 * MiB
    assert all(is_open(fd) for fd in fds)       # b's descriptors stay open while b lives
    assert h.peek(b, 4 * MiB) == pattern(4 * MiB, 4)
    assert h.share(b) == (handle, offset)
    h.free(b)
    h.empty_cache()
    assert h.reserved() == 0 and h.device_used() == 0


@isolated
def test_an_exported_handle_the_driver_would_not_release_is_never_mapped_again():
    h = Host(route="vmm")
    t = h.malloc(2 * MiB)                       # one granule, one handle
    _, _, old = parse(h.share(t)[0])
    h.free(t)                                   # the consumers are done
    h.fail("cuMemRelease", rate=1.0)
    h.empty_cache()                             # unmapped, its release refused: kept to retry
    h.heal()
    u = h.malloc(2 * MiB)                       # must not be mapped on the exported handle
    _, _, new = parse(h.share(u)[0])
    assert is_open(old[0]) and new != old
    h.free(u)
    h.empty_cache()                             # the refused release is retried
    assert not is_open(old[0])
    assert h.reserved() == 0 and h.device_used() == 0


@isolated
def test_a_failed_export_leaves_no_descriptor_behind():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(32 * MiB)                      # two runs of 16 MiB, exported as they are
    before = open_fds()
    h.fail("cuMemExportToShareableHandle", nth=2)
    with pytest.raises(Exception):
        h.share(t)
    h.heal()
    assert open_fds() == before                 # the first handle's descriptor was closed again
    _, _, fds = parse(h.share(t)[0])
    assert len(fds) == 2 and open_fds() == before + 2
    h.free(t)
    h.empty_cache()
    assert open_fds() == before


@isolated
def test_sharing_waits_for_the_device_with_the_allocator_lock_released():
    h = Host(route="vmm", map_run=16 * MiB)
    for passed in (0, 1):                       # waiting before the first copy, and for a copy
        t = h.malloc(40 * MiB)                  # runs of 16, 16 and 8 MiB: mapped again to share
        h.poke(t, pattern(40 * MiB, 6))
        h.free(h.malloc(1 * MiB))               # cached: the next 1 MiB request is a cache hit
        reserved = h.reserved()
        finished, shared, p = while_a_sync_waits(h, lambda: h.share(t), lambda: h.malloc(1 * MiB), passed=passed)
        assert finished, "a cache hit waited for the share's device synchronisation"
        assert not isinstance(shared, Exception), shared
        _, segment, fds = parse(shared[0])
        assert (segment, len(fds)) == (8 * MiB, 5)
        assert h.peek(t, 40 * MiB) == pattern(40 * MiB, 6)
        assert h.reserved() == reserved
        h.free(p)
        h.free(t)
        h.empty_cache()
        assert h.reserved() == 0 and h.device_used() == 0


@isolated
def test_a_block_freed_while_its_share_waits_for_the_device_is_refused_and_nothing_leaks():
    h = Host(route="vmm", map_run=16 * MiB)
    for passed in (0, 1):                       # freed before the first copy, and while one is staged
        t = h.malloc(40 * MiB)
        finished, shared, _ = while_a_sync_waits(h, lambda: h.share(t), lambda: h.free(t), passed=passed)
        assert finished
        assert isinstance(shared, StateError) and "freed" in str(shared), shared
        assert h.reserved() == h.device_used()
        h.empty_cache()
        assert h.reserved() == 0 and h.device_used() == 0


@isolated
def test_a_share_whose_mappings_changed_while_it_waited_starts_again():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)
    h.poke(t, pattern(40 * MiB, 8))
    x = h.malloc(4 * MiB)
    y = h.malloc(4 * MiB)
    h.free(x)                                   # a clean free mapping in t's arena
    h.reset_peaks()
    unmaps = h.counters()["unmaps"]
    # Past the high-water line: the allocation on S2 gives x's mapping back (Note [Packing]).
    finished, shared, z = while_a_sync_waits(h, lambda: h.share(t), lambda: h.malloc(8 * MiB, S2))
    assert finished
    assert h.counters()["unmaps"] > unmaps      # t's arena changed while the share waited
    assert not isinstance(shared, Exception), shared
    _, segment, fds = parse(shared[0])
    assert (segment, len(fds)) == (8 * MiB, 5)
    assert h.peek(t, 40 * MiB) == pattern(40 * MiB, 8)
    assert h.reserved() == h.device_used()
    for p in (t, y, z):
        h.free(p)
    h.empty_cache()
    assert h.reserved() == 0 and h.device_used() == 0


@isolated
def test_a_mapping_another_thread_exports_while_a_share_waits_is_never_cut_from_under_it():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(24 * MiB)                  # mappings of 16 and 8 MiB
    base = t
    h.free(t)
    b = h.malloc(6 * MiB)                   # inside the 16 MiB mapping
    a = h.malloc(18 * MiB)                  # the rest of it and the 8 MiB mapping
    assert (b, a) == (base, base + 6 * MiB)
    h.poke(b, pattern(6 * MiB, 3))
    # a's share stages a cut of the 16 MiB mapping into 8 MiB handles and waits for the device;
    # meanwhile b, wholly on that mapping, is shared as it is: its 16 MiB handle goes out.
    finished, shared_a, shared_b = while_a_sync_waits(h, lambda: h.share(a), lambda: h.share(b), passed=1)
    assert finished and not isinstance(shared_b, Exception), shared_b
    _, segment, fds_b = parse(shared_b[0])
    assert segment == 16 * MiB
    for fd in fds_b:
        os.fstat(fd)                        # still open: the handle it names lives
    if not isinstance(shared_a, Exception):
        assert not set(parse(shared_a[0])[2]) & set(fds_b)
    assert h.share(b) == shared_b           # b still lies on the handle handed out
    assert h.peek(b, 6 * MiB) == pattern(6 * MiB, 3)
    assert h.reserved() == h.device_used()


@isolated
def test_a_capture_begun_while_a_share_waits_refuses_the_share_and_changes_nothing():
    h = Host(route="vmm", map_run=16 * MiB)
    t = h.malloc(40 * MiB)
    h.poke(t, pattern(40 * MiB, 7))
    reserved, used = h.reserved(), h.device_used()
    finished, shared, _ = while_a_sync_waits(h, lambda: h.share(t), lambda: h.begin_pool((0, 3), S2))
    assert finished
    assert isinstance(shared, StateError) and "capture" in str(shared), shared
    assert (h.reserved(), h.device_used()) == (reserved, used)
    assert h.peek(t, 40 * MiB) == pattern(40 * MiB, 7)
    h.end_pool((0, 3))
    _, segment, fds = parse(h.share(t)[0])
    assert (segment, len(fds)) == (8 * MiB, 5)
    h.free(t)


@isolated
def test_a_handle_too_long_for_the_callers_buffer_does_not_mark_the_tensor_shared():
    h = Host(route="vmm")
    h.push("vmm", "weights")
    w = h.malloc(8 * MiB)
    h.pop()
    before = open_fds()
    off = ctypes.c_int64()
    assert h.lib.tb_share(w, ctypes.create_string_buffer(8), 8, ctypes.byref(off)) == -1
    err = _native.error(h.lib)
    assert isinstance(err, ValueError) and "too small" in str(err), err
    assert open_fds() == before                 # nothing was exported either
    h.release("weights", "pinned")              # nothing was shared: the tag may sleep
    h.restore("weights")
    h.free(w)


def vmm_handle(segment, fds, pid=None):
    pid = os.getpid() if pid is None else pid
    return bytes([2]) + b"e" + struct.pack("=iiQQ", pid, 0, segment, len(fds)) + struct.pack(f"={len(fds)}i", *fds)


@isolated
@pytest.mark.parametrize("segment, count, why", [(1 << 62, 8, "address space"), (3 * MiB, 2, "granularity")])
def test_a_handle_with_impossible_sizes_is_refused_before_anything_is_opened(segment, count, why):
    h = Host(route="vmm")
    h.free(h.malloc(2 * MiB))                   # the device exists
    before = open_fds()
    assert h.open_share(vmm_handle(segment, list(range(3, 3 + count)))) == _native.INVALID_ARGUMENT
    assert why in h.lib.tb_last_error().decode()
    assert open_fds() == before


@isolated
def test_a_process_forked_after_cuda_cannot_share_or_open_a_share():
    h = Host(route="vmm", map_run=16 * MiB)
    a = h.malloc(40 * MiB)           # runs of 16, 16 and 8 MiB: its share would cut them anew
    handle, _ = h.share(a)

    def child():
        maps = h.stats()["num_device_alloc"]
        with pytest.raises(StateError, match="forked from one that used CUDA.*'spawn'"):
            h.share(a)
        refused = h.open_share(handle)
        return maps, h.stats()["num_device_alloc"], refused

    before, after, refused = in_child(child)
    assert before == after, "the child remapped the parent's memory"
    assert refused == 5              # kState
    h.free(a)



def _opened_by_a_consumer(h):
    """A 2 MiB tensor holding pattern(2 MiB, 5), shared and opened by a consumer that keeps it:
    (tensor, its offset in the share, the consumer's id for close_opened, the mapping, its bytes)."""
    t = h.malloc(2 * MiB)
    h.poke(t, pattern(2 * MiB, 5))
    handle, offset = h.share(t)
    return (t, offset, *h.open_kept(handle))


def _freed_and_given_back(h, t):
    """Frees the producer's tensor: its memory goes back to the driver, and no reservation stays."""
    h.free(t)
    h.empty_cache()
    assert h.reserved() == 0 == h.device_used()
    assert h.import_counts()["reservations"] == 0


@isolated
def test_a_consumer_reads_the_producers_bytes_and_its_close_gives_the_memory_back():
    h = Host(route="vmm")
    t, offset, opened, ptr, size = _opened_by_a_consumer(h)
    assert size >= 2 * MiB and h.peek(ptr + offset, 2 * MiB) == pattern(2 * MiB, 5)
    h.close_opened(opened)
    _freed_and_given_back(h, t)


@isolated
def test_a_consumers_close_the_driver_refuses_once_is_retried_and_the_memory_goes_back():
    h = Host(route="vmm")
    t, _, opened, _, _ = _opened_by_a_consumer(h)
    h.fail("cuMemUnmap", nth=1)  # one transient refusal: the mapping held the producer's memory until exit
    h.close_opened(opened)
    h.heal()
    _freed_and_given_back(h, t)


@isolated
def test_a_share_opened_before_a_fork_is_closed_in_the_child_without_a_driver_call():
    h = Host(route="vmm")
    _, _, opened, _, _ = _opened_by_a_consumer(h)

    def child():
        before = h.counters()
        h.close_opened(opened)  # the parent's mapping, on the parent's context: ignored as a free is
        return before, h.counters()

    before, after = in_child(child)
    assert after == before, (before, after)
    h.close_opened(opened)


@isolated
def test_a_consumers_close_during_a_capture_waits_for_the_capture_to_end_before_it_unmaps():
    h = Host(route="vmm")
    t, _, opened, _, _ = _opened_by_a_consumer(h)
    h.begin_pool((0, 3), S2)
    before = h.counters()
    h.close_opened(opened)  # queued work may still read the mapping; the device cannot be synchronised now
    during = h.counters()
    assert (during["unmaps"], during["syncs"]) == (before["unmaps"], before["syncs"]), (before, during)
    h.end_pool((0, 3))
    after = h.counters()
    assert after["unmaps"] > during["unmaps"] and after["syncs"] > during["syncs"], (during, after)
    h.release_pool((0, 3))
    _freed_and_given_back(h, t)


@isolated
def test_a_consumers_close_whose_context_cannot_be_made_current_is_kept_and_done_at_the_next_close():
    # It had returned at once, and the caller dropped the mapping: the producer's memory stayed until exit.
    h = Host(route="vmm")
    t, _, opened, _, _ = _opened_by_a_consumer(h)
    before = h.import_counts()["reservations"]
    h.fail("cuCtxGetCurrent", nth=1)  # once: retried, as the context's restore is
    h.close_opened(opened)
    h.heal()
    assert h.import_counts()["reservations"] == before - 1  # closed now, not at the next close
    u, _, first, _, _ = _opened_by_a_consumer(h)
    v, _, second, _, _ = _opened_by_a_consumer(h)
    h.fail("cuCtxGetCurrent", nth=-1)  # for good, while the first closes
    h.close_opened(first)
    h.heal()
    h.close_opened(second)  # closes the one kept too
    h.free(u)
    h.free(v)
    _freed_and_given_back(h, t)


@isolated
def test_a_capture_that_begins_while_deferred_closes_run_waits_for_them():
    # The closes checked for captures once, then synchronised and unmapped inside one begun meanwhile.
    import threading

    h = Host(route="vmm")
    _, _, first, _, _ = _opened_by_a_consumer(h)
    _, _, second, _, _ = _opened_by_a_consumer(h)
    h.begin_pool((0, 3), S2)
    h.close_opened(first)
    h.close_opened(second)  # both wait for the capture to end
    h.hold_syncs(True)
    ender = threading.Thread(target=h.end_pool, args=((0, 3),))
    ender.start()
    h.hold_syncs(True, wait_for=1)  # the first deferred close waits in its sync
    at_begin = []
    starter = threading.Thread(target=lambda: (h.begin_pool((0, 4), S1), at_begin.append(h.counters())))
    starter.start()
    starter.join(0.5)
    assert starter.is_alive() and not at_begin  # the capture waits for the closes under way
    h.hold_syncs(False)
    ender.join()
    starter.join()
    assert at_begin[0]["unmaps"] == h.counters()["unmaps"]  # nothing unmapped once it began
    h.end_pool((0, 4))
