"""Reading backups (Note [Reading backups], csrc/core/tag_sleep.h), over the host stand-in: while
a tag is released with a cpu or pinned backup, or a live tag retains one, the bytes of a live
block as the backup holds them, copied or in place; a view keeps its host memory alive past the
restore, what is written to it while the tag sleeps is restored, and a retained backup a view
exposed is copied whole at its next release."""
import ctypes

import pytest

from _hostcore import MiB, Host, isolated
from torch_budget import _native
from torch_budget.errors import InvalidArgumentError, TorchBudgetError
from test_core_sleep import fill

pytestmark = pytest.mark.built("_host_core")

SIZES = [6 * MiB, 1000, 150 * MiB, 5 * MiB + 3]  # small, multi-granule, multi-piece, odd


def at(address, n):
    return ctypes.string_at(address, n)


def live_retained(size):
    """A host with one block of `size` under tag "weights", released and restored once with a
    retained pinned backup: (host, ptr, data)."""
    h = Host(route="vmm")
    (p, data), = fill(h, "weights", [size])
    h.release("weights", "pinned", retain=True)
    h.restore("weights")
    return h, p, data


@pytest.mark.parametrize("backup", ["pinned", "cpu"])
@isolated
def test_a_released_tag_backup_reads_back_every_block_copied_and_in_place(backup):
    h = Host(route="vmm")
    blocks = fill(h, "weights", SIZES)
    h.release("weights", backup)
    for p, data in blocks:
        assert h.backup_read(p, len(data)) == data
        host, view = h.backup_view(p, len(data))
        assert at(host, len(data)) == data
        h.backup_view_end(view)
        # A range inside the block, across a granule boundary.
        if len(data) > 3 * MiB:
            lo, n = 2 * MiB - 5, MiB + 10
            assert h.backup_read(p, n, offset=lo) == data[lo:lo + n]
            host, view = h.backup_view(p, n, offset=lo)
            assert at(host, n) == data[lo:lo + n]
            h.backup_view_end(view)
    h.restore("weights")
    for p, data in blocks:
        assert h.peek(p, len(data)) == data


@pytest.mark.parametrize("backup", ["none", "memset"])
@isolated
def test_no_backup_is_read_where_none_holds_contents(backup):
    h = Host(route="vmm")
    (p, data), = fill(h, "weights", [4 * MiB])
    assert h.backup_read(p, len(data)) is None  # live, nothing retained
    assert h.backup_view(p, len(data)) is None
    h.release("weights", backup)
    assert h.backup_read(p, len(data)) is None
    assert h.backup_view(p, len(data)) is None
    h.restore("weights")
    h.release("weights", "pinned")  # not retained: gone after the restore
    h.restore("weights")
    assert h.backup_read(p, len(data)) is None


@isolated
def test_a_view_keeps_a_pinned_backup_alive_past_the_restore_and_gives_it_back_when_it_ends():
    h = Host(route="vmm")
    (p, data), = fill(h, "weights", [8 * MiB])
    h.release("weights", "pinned")
    host, view = h.backup_view(p, len(data))
    h.restore("weights")  # not retained: the tag lets go of its backup
    assert h.tag_info("weights")["backup_bytes"] == 0
    assert h.host_pool()["used"] == 8 * MiB, "the view's memory went back to the pool while the view lived"
    assert at(host, len(data)) == data
    h.release("weights", "pinned")  # a new backup, in other host memory
    assert h.host_pool()["used"] == 16 * MiB
    h.restore("weights")
    h.backup_view_end(view)
    assert h.host_pool()["used"] == 0
    assert h.peek(p, len(data)) == data


@isolated
def test_what_a_view_writes_while_the_tag_sleeps_is_restored():
    h = Host(route="vmm")
    (p, data), = fill(h, "weights", [6 * MiB])
    h.release("weights", "pinned")
    host, view = h.backup_view(p, len(data))
    patch = b"\x5a" * 4096
    ctypes.memmove(host + 3 * MiB, patch, len(patch))
    h.restore("weights")
    h.backup_view_end(view)
    assert h.peek(p, len(data)) == data[:3 * MiB] + patch + data[3 * MiB + len(patch):]


@isolated
def test_a_retained_backup_is_read_while_live_at_the_same_address_and_a_view_makes_the_next_release_copy_all():
    h = Host(route="vmm")
    blocks = fill(h, "weights", SIZES)
    resident = h.tag_info("weights")["resident"]
    p, data = blocks[2]
    h.release("weights", "pinned", retain=True)
    host, view = h.backup_view(p, len(data))
    h.backup_view_end(view)
    h.restore("weights")
    assert h.backup_read(p, len(data)) == data  # live and retained: still readable
    host2, view = h.backup_view(p, len(data))
    assert host2 == host
    h.backup_view_end(view)
    # The views exposed the backup: the next release trusts no digest and copies everything.
    h.release("weights", "pinned", retain=True)
    assert h.tag_info("weights")["last_backup"] == resident
    h.restore("weights")
    # Nothing viewed since: an unchanged release copies nothing again.
    h.release("weights", "pinned", retain=True)
    assert h.tag_info("weights")["last_backup"] == 0
    h.restore("weights")
    for q, d in blocks:
        assert h.peek(q, len(d)) == d


@isolated
def test_a_write_through_a_view_of_a_live_retained_backup_is_overwritten_by_the_next_release():
    h, p, data = live_retained(6 * MiB)
    host, view = h.backup_view(p, len(data))
    ctypes.memmove(host, b"\x00" * 4096, 4096)  # the device still holds data
    h.release("weights", "pinned", retain=True)  # the view is still alive: copies everything
    assert at(host, len(data)) == data
    h.backup_view_end(view)
    h.restore("weights")
    assert h.peek(p, len(data)) == data


@isolated
def test_a_backup_split_over_host_chunks_is_read_as_a_copy_and_refuses_a_view():
    h = Host(route="vmm")
    _native.check(h.lib, h.lib.tb_host_pool_reserve(2 * MiB))  # the backup below needs a second chunk
    (p, data), = fill(h, "weights", [6 * MiB])
    h.release("weights", "pinned")
    assert h.host_pool()["chunks"] == 2
    assert h.backup_read(p, len(data)) == data
    with pytest.raises(TorchBudgetError, match="separate pieces of host memory"):
        h.backup_view(p, len(data))
    # "not available" (read a copy), which backup_of(copy=False) turns into InvalidArgumentError;
    # the device's wrapper had overwritten it with a tag-state error
    assert h.lib.tb_last_error_code() == _native.NOT_AVAILABLE
    host, view = h.backup_view(p, MiB, offset=3 * MiB)  # within one chunk: a view
    assert at(host, MiB) == data[3 * MiB:4 * MiB]
    h.backup_view_end(view)
    h.restore("weights")


@isolated
def test_bad_ranges_and_pointers_raise_naming_the_problem():
    h = Host(route="vmm")
    (p, data), = fill(h, "weights", [4 * MiB])
    h.release("weights", "pinned")
    with pytest.raises(InvalidArgumentError, match="outside the block"):
        h.backup_read(p, 4 * MiB, offset=1)
    with pytest.raises(InvalidArgumentError, match="no live block"):
        h.backup_read(p + 4096, 16)
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        h.backup_read(p, 16, offset=-1)
    h.restore("weights")
    assert h.peek(p, len(data)) == data


@isolated
def test_a_retained_backup_whose_memory_went_back_is_gone_not_read():
    # The retained backup describes segments; freed and emptied, they go back to the driver, and
    # a new block of the tag (maybe at a recycled address) has no backup.
    h, p, _ = live_retained(8 * MiB)
    h.free(p)
    h.empty_cache()
    (q, _), = fill(h, "weights", [8 * MiB])
    assert h.backup_read(q, 8 * MiB) is None and h.backup_view(q, 8 * MiB) is None
    info = h.tag_info("weights")
    assert info["retained"] == 0 and info["backup_bytes"] == 0


@isolated
def test_a_block_allocated_after_the_restore_has_no_backup_even_where_it_reuses_backed_up_bytes():
    h = Host(route="vmm")
    (first, first_data), (second, second_data) = fill(h, "weights", [8 * MiB, 8 * MiB])
    h.release("weights", "pinned", retain=True)
    h.restore("weights")
    assert h.backup_read(first, 64) == first_data[:64]
    h.free(first)
    (again, again_data), = fill(h, "weights", [8 * MiB])  # best fit: the freed block's place
    assert again == first, "the test needs the new block where the backed-up one was"
    assert h.peek(again, 64) == again_data[:64]
    assert h.backup_read(again, 64) is None, "the backup handed out the old block's bytes for a new one"
    assert h.backup_view(again, 64) is None
    assert h.backup_read(second, 64) == second_data[:64]  # the block the restore kept still has its backup
    h.release("weights", "pinned", retain=True)  # the same granules: only the new block's are copied
    assert h.tag_info("weights")["last_backup"] == 8 * MiB
    assert h.backup_read(again, 64) == again_data[:64]
    h.restore("weights")
    assert h.peek(again, len(again_data)) == again_data and h.peek(second, len(second_data)) == second_data


@isolated
def test_a_half_done_release_reads_what_it_dropped_and_refuses_what_it_left_on_the_device():
    # A copy's completion fails after the first piece was dropped, and nothing can be mapped back:
    # the tag stays released with part of its memory. Its backup holds that part, whole; the rest
    # is still on the device, and a read of it is refused, never answered from the backup.
    h = Host(route="vmm")
    blocks = fill(h, "weights", [100 * MiB, 100 * MiB, 100 * MiB, 40 * MiB])
    h.fail("cuEventSynchronize", nth=3)
    h.fail("cuMemCreate", nth=-1)
    with pytest.raises(TorchBudgetError, match="stays released"):
        h.release("weights", "pinned")
    h.heal()
    info = h.tag_info("weights")
    assert info["life"] == 1 and 0 < info["released"] < sum(len(d) for _, d in blocks), info
    first, first_data = blocks[0]
    assert h.peek(first, 16) is None                          # dropped: its bytes are in the backup
    assert h.backup_read(first, len(first_data)) == first_data
    for p, data in blocks[1:]:
        with pytest.raises(TorchBudgetError, match="the backup does not hold the bytes"):
            h.backup_read(p, len(data))
    h.restore("weights")
    for p, data in blocks:
        assert h.peek(p, len(data)) == data
