"""Adopting clean blocks (Note [Adopting clean blocks], csrc/core/block_cache.h), over the host
stand-in: a request that its own stream's cache cannot serve without new memory takes a clean,
mapped free block of another stream instead of mapping more; a block whose stream may still
use it is never taken; graph pools never adopt; and blocks of two streams left side by side
merge once clean, so empty_cache gives everything back."""
import time

import pytest

from _hostcore import MiB, S1, S2, Host, isolated

pytestmark = pytest.mark.built("_host_core")


def settle(h, stream):
    """`stream`'s queued work is done; the clock learns it from the event it recorded at the
    stream's first free, without a sync (Note [Clean blocks])."""
    h.complete(stream)


@pytest.mark.parametrize("route", ["vmm", "sync"])
@isolated
def test_a_clean_block_of_another_stream_serves_a_request_without_new_memory(route):
    h = Host(route=route)
    p = h.malloc(32 * MiB, S1)
    h.free(p)
    settle(h, S1)
    reserved, maps = h.reserved(), h.counters()["maps"]
    q = h.malloc(32 * MiB, S2)
    assert q == p, "the clean block of S1 was not taken"
    assert h.reserved() == reserved and h.counters()["maps"] == maps
    assert h.stats()["num_adoptions"] == 1
    h.free(q)
    # And back: S1 now finds it under S2's name, clean again.
    settle(h, S2)
    assert h.malloc(32 * MiB, S1) == p


@pytest.mark.parametrize("route", ["vmm", "sync"])
@isolated
def test_a_block_its_stream_may_still_use_is_not_taken(route):
    h = Host(route=route)
    p = h.malloc(32 * MiB, S1)
    h.submit(S1)  # a kernel on S1 that may still read p
    h.free(p)
    time.sleep(0.002)
    reserved = h.reserved()
    q = h.malloc(32 * MiB, S2)
    assert q != p and h.reserved() > reserved and h.stats()["num_adoptions"] == 0
    h.complete(S1)
    h.free(q)


@isolated
def test_without_reuse_before_grow_nothing_is_adopted():
    h = Host(route="vmm", reuse_before_grow=False)
    p = h.malloc(32 * MiB, S1)
    h.free(p)
    settle(h, S1)
    assert h.malloc(32 * MiB, S2) != p


@isolated
def test_graph_pools_never_adopt():
    h = Host(route="vmm")
    p = h.malloc(32 * MiB, S1)
    h.free(p)
    settle(h, S1)
    h.begin_pool((7, 7), S2)
    q = h.malloc(32 * MiB, S2)
    h.end_pool((7, 7))
    assert q != p


@isolated
def test_blocks_of_two_streams_side_by_side_merge_once_clean_and_go_back_whole():
    h = Host(route="vmm")
    a = h.malloc(24 * MiB, S1)
    b = h.malloc(24 * MiB, S1)
    h.free(a)
    settle(h, S1)
    a2 = h.malloc(24 * MiB, S2)  # adopts a: S2's block beside S1's b
    assert a2 == a
    h.submit(S1)
    h.submit(S2)
    h.free(a2)
    h.free(b)  # neighbours of two streams, both dirty: they stay apart
    h.complete(S1)
    h.complete(S2)
    h.empty_cache()
    assert h.reserved() == 0 == h.device_used(), "memory under two unmerged free blocks stayed mapped"


def left_apart(h):
    """Sync route: a 20 MiB segment holding S2's free 4 MiB block (adopted from S1) beside S1's
    free 16 MiB, both streams dirty, so the two stay apart. Returns the segment's address."""
    a = h.malloc(4 * MiB, S1)  # a 20 MiB segment: a, b and a free tail
    b = h.malloc(4 * MiB, S1)
    h.free(a)
    settle(h, S1)
    a2 = h.malloc(4 * MiB, S2)
    assert a2 == a  # adopted
    h.submit(S1)
    h.submit(S2)
    h.free(a2)
    h.free(b)  # beside a2's free block, both dirty: they stay apart
    return a


@isolated
def test_neighbours_of_two_streams_merge_before_the_cache_grows():
    # Sync route: a request larger than either free block but not their union takes the union
    # once both streams are clean, instead of a new cudaMalloc.
    h = Host(route="sync")
    a = left_apart(h)
    h.complete(S1)
    h.complete(S2)
    segments = h.stats()["num_device_alloc"]
    big = h.malloc(20 * MiB, S1)
    assert big == a and h.stats()["num_device_alloc"] == segments, "the cache grew instead of merging"
    h.free(big)


@isolated
def test_a_pair_left_apart_still_merges_after_its_left_block_is_split():
    # As above, then S2 allocates the front of its free block: the remainder is the left of the
    # pair now, and must still merge with S1's block once both are clean.
    h = Host(route="sync")
    a = left_apart(h)  # [4 MiB free, S2][16 MiB free, S1]
    front = h.malloc(2 * MiB, S2)  # S2's own block, split: [2 MiB, S2][2 MiB free, S2][16 MiB free, S1]
    assert front == a
    h.complete(S1)
    h.complete(S2)
    segments = h.stats()["num_device_alloc"]
    big = h.malloc(18 * MiB, S1)  # the union of the remainder and S1's block
    assert big == a + 2 * MiB and h.stats()["num_device_alloc"] == segments, "the cache grew instead of merging"
    h.free(big)
    h.free(front)
