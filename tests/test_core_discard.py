"""Discardable blocks (Note [Discardable blocks], csrc/core/tag_sleep.h), over the host stand-in: a
release told which live allocations the caller writes again after the wake copies only the rest,
maps every allocation back at its address, and refuses what it cannot honour without losing
anything."""
import os
import tempfile

import pytest

from _hostcore import MiB, Host, isolated
from torch_budget.errors import InvalidArgumentError, StateError

pytestmark = pytest.mark.built("_host_core")

G = 2 * MiB  # the stand-in's granule


def allocate(h, tag, sizes):
    """[(ptr, data)] of `sizes` under `tag`, each filled with random bytes."""
    h.push("vmm", tag)
    try:
        ptrs = [h.malloc(n) for n in sizes]
    finally:
        h.pop()
    out = []
    for p, n in zip(ptrs, sizes):
        data = os.urandom(n)
        assert h.poke(p, data)
        out.append((p, data))
    return out


@isolated
def test_only_the_kept_allocations_are_copied_and_every_one_comes_back_at_its_address():
    # vLLM's weights at level 2: the parameters are reloaded after the wake; a small buffer beside
    # them (its own small-pool page here) is not, and keeps its contents.
    h = Host(route="vmm")
    params = allocate(h, "weights", [64 * MiB, 48 * MiB, 96 * MiB])
    buffers = allocate(h, "weights", [256 * 1024])
    used, resident = h.device_used(), h.tag_info("weights")["resident"]
    h.release("weights", "pinned", discard=[p for p, _ in params])
    info = h.tag_info("weights")
    assert info["life"] == 1 and info["released"] == resident and h.device_used() == used - resident
    assert info["backup_bytes"] == G and info["last_backup"] == G, info  # the buffer's page only
    assert h.host_pool()["used"] == G
    h.restore("weights")
    assert h.tag_info("weights")["resident"] == resident and h.device_used() == used
    p, data = buffers[0]
    assert h.peek(p, len(data)) == data
    for p, data in params:  # mapped again, for the caller to write
        assert h.poke(p, data) and h.peek(p, len(data)) == data
    assert h.host_pool()["used"] == 0
    # The next release, told nothing, keeps everything.
    h.release("weights", "pinned")
    assert h.tag_info("weights")["backup_bytes"] == resident
    h.restore("weights")
    for p, data in params + buffers:
        assert h.peek(p, len(data)) == data


@isolated
def test_a_mapping_holding_a_kept_allocation_is_copied_whole_and_the_rest_not_at_all():
    # A 3 MiB buffer between parameters shares a run mapping with them (runs of 16 MiB): that run
    # is copied whole (a mapping goes back only whole); the parameters' other runs are not copied.
    h = Host(route="vmm")
    first = allocate(h, "weights", [40 * MiB])
    buffer = allocate(h, "weights", [3 * MiB])
    second = allocate(h, "weights", [120 * MiB])
    discard = [first[0][0], second[0][0]]
    h.release("weights", "cpu", discard=discard)
    info = h.tag_info("weights")
    assert 0 < info["backup_bytes"] <= 2 * 16 * MiB, info["backup_bytes"] / MiB
    assert info["backup_bytes"] < info["released"] // 4
    h.restore("weights")
    p, data = buffer[0]
    assert h.peek(p, len(data)) == data
    for p, data in first + second:
        assert h.poke(p, data)


@isolated
def test_all_allocations_discardable_copy_nothing():
    h = Host(route="vmm")
    blocks = allocate(h, "weights", [20 * MiB, 1024, 70 * MiB])
    h.release("weights", "pinned", discard=[p for p, _ in blocks])
    info = h.tag_info("weights")
    assert info["backup_bytes"] == 0 and info["last_backup"] == 0 and h.host_pool()["used"] == 0
    h.restore("weights")
    for p, data in blocks:
        assert h.poke(p, data) and h.peek(p, len(data)) == data


@isolated
def test_the_backup_of_a_discarded_allocation_cannot_be_read_and_a_kept_one_can():
    h = Host(route="vmm")
    params = allocate(h, "weights", [32 * MiB])
    buffers = allocate(h, "weights", [4096])
    h.release("weights", "pinned", discard=[params[0][0]])
    p, data = buffers[0]
    assert h.backup_read(p, len(data)) == data
    with pytest.raises(StateError, match="does not hold"):
        h.backup_read(params[0][0], 4096)
    h.restore("weights")


@isolated
def test_allocations_freed_while_released_are_not_restored_and_their_kept_backup_goes_back():
    h = Host(route="vmm")
    params = allocate(h, "weights", [32 * MiB, 32 * MiB])
    buffers = allocate(h, "weights", [64 * MiB])
    h.release("weights", "pinned", discard=[params[0][0]])
    backup = h.tag_info("weights")["backup_bytes"]
    assert backup >= 64 * MiB
    h.free(params[0][0])  # a discarded one
    h.free(buffers[0][0])  # a kept one: its backup is stale
    h.empty_cache()
    assert h.tag_info("weights")["backup_bytes"] < backup
    h.restore("weights")
    p, data = params[1]
    assert h.peek(p, len(data)) == data


@isolated
def test_a_release_whose_copy_fails_leaves_every_allocation_as_it_was_the_discardable_ones_too():
    # Discarded pieces are dropped only once every copy is done: the caller, whose sleep failed,
    # finds its parameters as they were.
    h = Host(route="vmm")
    params = allocate(h, "weights", [100 * MiB])
    buffers = allocate(h, "weights", [200 * MiB, 150 * MiB])  # pieces of at most 64 MiB
    used = h.device_used()
    h.fail("cuMemcpyDtoHAsync", nth=3)
    with pytest.raises(Exception, match="cuMemcpyDtoHAsync"):
        h.release("weights", "pinned", discard=[params[0][0]])
    h.heal()
    assert h.tag_info("weights")["life"] == 0 and h.device_used() == used
    for p, data in buffers + params:
        assert h.peek(p, len(data)) == data
    assert h.host_pool()["used"] == 0


@isolated
def test_misuse_is_refused_naming_the_problem_and_releases_nothing():
    h = Host(route="vmm")
    params = allocate(h, "weights", [32 * MiB])
    other = allocate(h, "kv", [8 * MiB])
    h.push("sync", "weights")
    try:
        off_route = h.malloc(MiB)
    finally:
        h.pop()
    h.free(off_route)
    p = params[0][0]
    cases = [
        (dict(discard=[p + 4096]), "not the start of a live allocation"),
        (dict(discard=[other[0][0]]), "under tag 'kv'"),
        (dict(discard=[p], retain=True), "holes in the backup, which a retained backup cannot have"),
        (dict(discard=[p], backup="disk"), "holes in the backup, which a disk backup cannot have"),
    ]
    h.set_disk_dir(tempfile.mkdtemp())
    used = h.device_used()
    for kwargs, message in cases:
        kwargs.setdefault("backup", "pinned")
        with pytest.raises(InvalidArgumentError, match=message):
            h.release("weights", **kwargs)
        assert h.tag_info("weights")["life"] == 0 and h.device_used() == used
    assert h.peek(p, len(params[0][1])) == params[0][1]
    h.free(other[0][0])
    with pytest.raises(InvalidArgumentError, match="not the start of a live allocation"):
        h.release("weights", "pinned", discard=[other[0][0]])  # freed
    h.release("weights", "pinned", discard=[p, p])  # named twice: the same block
    h.restore("weights")
