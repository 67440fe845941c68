"""Retained backups (Note [Retained backups], csrc/core/tag_sleep.h), over the host stand-in
(which runs the digest kernel on the host): a restore keeps the backup and digests what it
restored; the next release copies only the granules whose contents changed, and falls back
to a whole copy whenever the backup cannot be trusted to match."""
import os

import pytest

from _hostcore import MiB, Host, isolated
from test_core_sleep import fill

pytestmark = pytest.mark.built("_host_core")

GRANULE = 2 * MiB
SIZES = [6 * MiB, 150 * MiB, 1024, 40 * MiB]  # 150 MiB spans several copy pieces


def granules_of(h, blocks):
    """Every (granule address) under the blocks, once, in order."""
    seen = []
    for p, data in blocks:
        start = p // GRANULE * GRANULE
        for g in range(start, p + len(data), GRANULE):
            if g not in seen:
                seen.append(g)
    return seen


def check(h, blocks):
    for p, data in blocks:
        assert h.peek(p, len(data)) == data


def retained_cycle(backup="pinned"):
    """A host with SIZES under tag "weights", released and restored once with a retained
    `backup`: (host, blocks, resident bytes)."""
    h = Host(route="vmm")
    blocks = fill(h, "weights", SIZES)
    resident = h.tag_info("weights")["resident"]
    h.release("weights", backup, retain=True)
    h.restore("weights")
    return h, blocks, resident


def copies_everything(h, blocks, resident, backup="pinned"):
    """The next retained release copies every resident byte; the restore brings the contents back."""
    h.release("weights", backup, retain=True)
    assert h.tag_info("weights")["last_backup"] == resident
    h.restore("weights")
    check(h, blocks)


@pytest.mark.parametrize("backup,sizes", [("pinned", SIZES), ("cpu", SIZES),
                                          ("pinned", SIZES + [520 * MiB])])  # restored as three runs
@isolated
def test_an_unchanged_tag_is_released_again_without_a_copy(backup, sizes):
    h = Host(route="vmm")
    blocks = fill(h, "weights", sizes)
    resident = h.tag_info("weights")["resident"]
    h.release("weights", backup, retain=True)
    assert h.tag_info("weights")["last_backup"] == resident        # the first release copies everything
    h.restore("weights")
    check(h, blocks)
    info = h.tag_info("weights")
    assert info["retained"] == 1 and info["backup_bytes"] == resident   # kept, and counted, while live
    used = h.device_used()
    for cycle in range(3):
        h.release("weights", backup, retain=True)
        info = h.tag_info("weights")
        assert info["last_backup"] == 0, f"cycle {cycle}: an unchanged tag was copied"
        assert info["last_device"] == resident and h.device_used() == used - resident
        h.restore("weights")
        check(h, blocks)


@isolated
def test_one_changed_byte_in_any_granule_is_found_and_only_that_granule_is_copied():
    h, blocks, _ = retained_cycle()
    blocks = [(p, bytearray(data)) for p, data in blocks]  # changed in place, as the device is
    for n, g in enumerate(granules_of(h, blocks)):
        # One byte of this granule that some block covers changes (a weight update).
        owner = next(i for i, (p, data) in enumerate(blocks) if p <= max(g, p) < p + len(data) and
                     max(g, p) < g + GRANULE)
        p, data = blocks[owner]
        at = max(g, p) + (n * 7919) % min(GRANULE - (max(g, p) - g), p + len(data) - max(g, p))
        new = data[at - p] ^ (1 + n % 255)  # never the byte it replaces
        assert h.poke(at, bytes([new]))
        data[at - p] = new
        h.release("weights", "pinned", retain=True)
        assert h.tag_info("weights")["last_backup"] == GRANULE, f"granule {n} at {g:#x}: not exactly it copied"
        h.restore("weights")
        # The changed granule at once; the whole tag every eighth granule and at the end (a restore
        # that damaged another granule leaves it damaged: only changed granules are copied again).
        lo, hi = max(g, p), min(g + GRANULE, p + len(data))
        assert h.peek(lo, hi - lo) == data[lo - p:hi - p], f"granule {n} at {g:#x}"
        if n % 8 == 7:
            check(h, blocks)
    check(h, blocks)


@isolated
def test_new_allocations_in_the_tag_make_the_next_release_copy_everything():
    h, blocks, _ = retained_cycle()
    blocks += fill(h, "weights", [8 * MiB])
    copies_everything(h, blocks, h.tag_info("weights")["resident"])


@isolated
def test_a_release_without_retain_or_with_another_backup_drops_the_retained_one():
    h, blocks, resident = retained_cycle()
    copies_everything(h, blocks, resident, "cpu")            # another backup: a whole copy
    h.release("weights", "cpu")                               # not retained: freed at the restore
    assert h.tag_info("weights")["last_backup"] == 0          # still the retained backup's
    h.restore("weights")
    check(h, blocks)
    info = h.tag_info("weights")
    assert info["retained"] == 0 and info["backup_bytes"] == 0
    assert h.host_pool()["used"] == 0


@isolated
def test_drop_backup_gives_the_host_memory_back_and_the_next_release_copies_everything():
    h, blocks, resident = retained_cycle()
    assert h.host_pool()["used"] == resident
    h.drop_backup("weights")
    info = h.tag_info("weights")
    assert info["retained"] == 0 and info["backup_bytes"] == 0 and h.host_pool()["used"] == 0
    h.release("weights", "pinned", retain=True)
    assert h.tag_info("weights")["last_backup"] == resident
    with pytest.raises(RuntimeError, match="released"):
        h.drop_backup("weights")                              # it holds the contents now
    h.restore("weights")
    check(h, blocks)


@isolated
def test_a_tensor_freed_during_the_sleep_ends_the_retention():
    h = Host(route="vmm")
    blocks = fill(h, "weights", SIZES)
    h.release("weights", "pinned", retain=True)
    h.free(blocks[1][0])                                      # its granules are not mapped back
    del blocks[1]
    h.restore("weights")
    check(h, blocks)
    assert h.tag_info("weights")["retained"] == 0
    copies_everything(h, blocks, h.tag_info("weights")["resident"])


@isolated
def test_without_digests_a_retained_backup_is_refilled_whole_and_contents_stay_right():
    h, blocks, resident = retained_cycle()
    h.fail("cuLaunchKernel", rate=1.0)                        # digests fail from here on
    p, data = blocks[0]
    assert h.poke(p, b"\x01\x02")
    blocks[0] = (p, b"\x01\x02" + data[2:])
    h.release("weights", "pinned", retain=True)               # cannot tell what changed: copies all
    assert h.tag_info("weights")["last_backup"] == resident
    h.restore("weights")                                      # succeeds; cannot digest: not retained
    check(h, blocks)
    assert h.tag_info("weights")["retained"] == 0
    h.heal()


@isolated
def test_retain_needs_a_backup_that_keeps_contents():
    h = Host(route="vmm")
    fill(h, "weights", [8 * MiB])
    for backup in ("none", "memset"):
        with pytest.raises(ValueError, match="cpu or pinned"):
            h.release("weights", backup, retain=True)
    assert h.tag_info("weights")["life"] == 0


@isolated
def test_whether_the_restore_keeps_the_backup_can_change_while_released():
    h = Host(route="vmm")
    blocks = fill(h, "weights", SIZES)
    h.release("weights", "pinned")                            # not asked to retain
    h.retain("weights", True)                                 # decided before the restore
    h.restore("weights")
    check(h, blocks)
    assert h.tag_info("weights")["retained"] == 1
    h.release("weights", "pinned", retain=True)
    assert h.tag_info("weights")["last_backup"] == 0
    h.retain("weights", False)
    h.restore("weights")
    check(h, blocks)
    assert h.tag_info("weights")["retained"] == 0 and h.host_pool()["used"] == 0
    with pytest.raises(RuntimeError, match="not released"):
        h.retain("weights", True)
    h.release("weights", "memset")
    with pytest.raises(ValueError, match="cpu or pinned"):
        h.retain("weights", True)
    h.restore("weights")


def half_released(h):
    """Three tensors that a retained cycle restored as three runs; A and C change, and the next
    retained release fails after dropping only the unchanged B (its digest matched at once) and
    cannot put B back, so B stays released; then the restore. Returns the blocks."""
    (a, a_data), (b, b_data), (c, c_data) = fill(h, "weights", [256 * MiB, 256 * MiB, 88 * MiB])
    h.release("weights", "pinned", retain=True)
    h.restore("weights")
    new_a, new_c = bytes([a_data[0] ^ 0xFF]), bytes([c_data[0] ^ 0xFF])  # differ from the random bytes
    assert h.poke(a, new_a) and h.poke(c, new_c)
    h.fail("cuMemcpyDtoHAsync", nth=5)  # three digest reads and A's copy pass; C's copy fails ...
    h.fail("cuMemCreate", nth=-1)  # ... and the recovery cannot map B again
    with pytest.raises(Exception, match="stays released"):
        h.release("weights", "pinned", retain=True)
    h.heal()
    info = h.tag_info("weights")
    assert info["life"] == 1 and 0 < info["released"] < info["backup_bytes"], info
    h.restore("weights")
    assert h.peek(b, len(b_data)) == b_data
    return (a, new_a + a_data[1:]), (b, b_data), (c, new_c + c_data[1:])


@isolated
def test_the_backup_a_half_done_release_left_still_reads_each_tensor_at_its_place():
    h = Host(route="vmm")
    _, (b, b_data), _ = half_released(h)
    assert h.tag_info("weights")["retained"] == 1
    assert h.backup_read(b, 4 * MiB) == b_data[:4 * MiB], "the backup of B handed out other bytes"


@isolated
def test_after_a_half_done_release_the_next_cycle_keeps_the_contents():
    h = Host(route="vmm")
    (a, _), (b, b_data), (c, _) = half_released(h)
    h.free(a)
    h.free(c)
    h.empty_cache()  # only B's run is left: its place in the backup is not where a new backup starts
    h.release("weights", "pinned", retain=True)
    h.restore("weights")
    assert h.peek(b, len(b_data)) == b_data


@isolated
def test_empty_cache_gives_back_a_retained_backup_once_memory_it_describes_went_to_the_driver():
    # Note [Stale backups]: such a backup can never be taken again; it held its host memory until
    # the next release.
    h, blocks, resident = retained_cycle()
    h.empty_cache()                                           # every granule still under a tensor
    assert h.tag_info("weights")["retained"] == 1 and h.host_pool()["used"] == resident
    for n, (p, _) in enumerate(blocks):
        h.free(p)
        assert h.tag_info("weights")["retained"] == 1, "freed into the cache, still mapped: the backup matches"
        h.empty_cache()
        info = h.tag_info("weights")
        # Kept exactly while every granule it describes is mapped (runs go back only whole).
        assert info["retained"] == (info["resident"] == resident), (n, info)
        assert h.host_pool()["used"] == info["backup_bytes"] == (resident if info["retained"] else 0), (n, info)
        if not info["retained"]:
            break
    assert n < len(blocks) - 1, "freeing the tensors one by one gave some granules back before the last"
    check(h, blocks[n + 1:])
    for p, _ in blocks[n + 1:]:
        h.free(p)
    h.empty_cache()
    assert h.tag_info("weights")["resident"] == 0 and h.host_pool()["used"] == 0
    blocks = fill(h, "weights", SIZES)
    copies_everything(h, blocks, h.tag_info("weights")["resident"])


@pytest.mark.parametrize("backup", ["pinned", "cpu", "disk"])
@isolated
def test_a_released_tag_whose_tensors_were_all_freed_gives_its_backup_back_at_empty_cache(backup, tmp_path):
    h = Host(route="vmm")
    h.set_disk_dir(str(tmp_path))
    blocks = fill(h, "weights", SIZES)
    other = fill(h, "other", [8 * MiB])
    h.release("weights", backup)
    h.release("other", "pinned")
    used, whole = h.host_pool()["used"], h.tag_info("weights")["backup_bytes"]
    for p, _ in blocks[:-1]:
        h.free(p)
    h.empty_cache()  # one tensor left: only its granules' backup stays, or every file of a disk backup
    last = len(blocks[-1][1])
    assert h.tag_info("weights")["backup_bytes"] == (last if backup != "disk" else whole)
    assert h.host_pool()["used"] == (last + 8 * MiB if backup == "pinned" else used)
    h.free(blocks[-1][0])
    h.empty_cache()
    info = h.tag_info("weights")
    assert info["backup_bytes"] == 0 and info["released"] == 0 and info["life"] == 1, info  # still released
    assert h.host_pool()["used"] == 8 * MiB and list(tmp_path.iterdir()) == []
    h.restore("weights")                                      # nothing to map, nothing to copy
    assert h.tag_info("weights")["last_device"] == 0 and h.tag_info("weights")["resident"] == 0
    h.restore("other")
    check(h, other)
    assert h.host_pool()["used"] == 0


@pytest.mark.parametrize("backup", ["pinned", "cpu"])
@pytest.mark.parametrize("retain", [False, True])
@isolated
def test_a_released_tag_gives_back_the_backup_of_each_tensor_freed_while_it_slept(backup, retain):
    # Note [Stale backups]: as torch_memory_saver frees a backup with the allocation it backs.
    h = Host(route="vmm")
    blocks = fill(h, "weights", [40 * MiB, 150 * MiB, 24 * MiB, 8 * MiB])  # whole granules each
    h.release("weights", backup, retain=retain)
    assert h.tag_info("weights")["backup_bytes"] == 222 * MiB
    pinned = h.host_pool()["used"]
    h.free(blocks[1][0])
    assert h.tag_info("weights")["backup_bytes"] == 222 * MiB, "freed into the cache: nothing goes before it does"
    for _ in range(2):  # the second time finds nothing more to give back
        h.empty_cache()
        assert h.tag_info("weights")["backup_bytes"] == 72 * MiB
        assert h.host_pool()["used"] == (pinned - 150 * MiB if backup == "pinned" else pinned)
    h.free(blocks[3][0])
    h.empty_cache()
    assert h.tag_info("weights")["backup_bytes"] == 64 * MiB
    assert h.tag_info("weights")["life"] == 1
    h.restore("weights")
    check(h, [blocks[0], blocks[2]])
    info = h.tag_info("weights")
    assert info["retained"] == 0 and info["backup_bytes"] == 0, "a backup with holes is never retained"
    assert h.host_pool()["used"] == 0
    h.release("weights", backup, retain=retain)  # a fresh backup, whole
    assert h.tag_info("weights")["backup_bytes"] == 64 * MiB
    h.restore("weights")
    check(h, [blocks[0], blocks[2]])


@isolated
def test_a_view_of_a_released_backup_keeps_the_whole_backup_while_it_lives():
    h = Host(route="vmm")
    blocks = fill(h, "weights", [40 * MiB, 150 * MiB, 24 * MiB])
    h.release("weights", "pinned")
    host, view = h.backup_view(blocks[0][0], 4 * MiB)
    h.free(blocks[1][0])
    h.empty_cache()
    assert h.tag_info("weights")["backup_bytes"] == 214 * MiB, "a view may read anywhere in the space"
    h.backup_view_end(view)
    h.empty_cache()
    assert h.tag_info("weights")["backup_bytes"] == 64 * MiB
    h.restore("weights")
    check(h, [blocks[0], blocks[2]])
    assert h.host_pool()["used"] == 0


@isolated
def test_a_backup_with_discarded_blocks_cannot_be_retained_and_the_tag_cycles_on():
    h = Host(route="vmm")
    (x, x_data), (y, _) = fill(h, "weights", [8 * MiB, 4 * MiB])
    h.release("weights", "pinned", discard=[y])      # y's contents need not survive: a hole in the backup
    with pytest.raises(ValueError, match="discardable blocks"):
        h.retain("weights", True)
    h.restore("weights")
    assert h.peek(x, len(x_data)) == x_data
    assert h.tag_info("weights")["retained"] == 0 and h.host_pool()["used"] == 0
    y_data = os.urandom(4 * MiB)
    assert h.poke(y, y_data)                          # the caller fills y again, as after a reload
    for _ in range(2):                                # plain cycles copy everything and restore it
        h.release("weights", "pinned")
        h.restore("weights")
        assert h.peek(x, len(x_data)) == x_data and h.peek(y, len(y_data)) == y_data


@isolated
def test_a_restore_whose_digest_buffers_were_refused_leaves_no_device_memory_behind():
    h = Host(route="vmm")
    fill(h, "w", [6 * MiB, 40 * MiB])
    h.release("w", "pinned", retain=True)
    h.fail("cuMemAlloc", nth=2)      # the digests' addresses are had, the digests themselves refused
    h.restore("w")                   # served, its backup not retained (it has no digests)
    h.heal()
    assert not h.tag_info("w")["retained"]
    assert h.device_used() == h.reserved(), "device memory held outside the ledger"
