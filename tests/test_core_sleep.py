"""Sleep and wake in the core, over the host stand-in: release a tag's memory, restore it
at the same addresses with its contents, and fail without losing anything."""
import ctypes
import os

import pytest

from _hostcore import GiB, Host, MiB, OOM, S1, S2, isolated
from torch_budget import _native

pytestmark = pytest.mark.built("_host_core")

SIZES = [3 * MiB + 512, 150 * MiB, 1024, 40 * MiB]  # 150 MiB spans several copy pieces


def fill(h, tag, sizes=SIZES, stream=S1):
    """Allocates `sizes` under `tag` and writes random bytes into each; returns [(ptr, data)]."""
    h.push("vmm", tag)
    try:
        blocks = [h.malloc(n, stream) for n in sizes]
    finally:
        h.pop()
    out = []
    for p, n in zip(blocks, sizes):
        data = os.urandom(min(n, 4 * MiB)) * (n // min(n, 4 * MiB)) + os.urandom(n % min(n, 4 * MiB))
        assert h.poke(p, data)
        out.append((p, data))
    return out


@pytest.mark.parametrize("backup", ["pinned", "cpu"])
@isolated
def test_release_returns_the_memory_and_restore_brings_the_contents_back_at_the_same_addresses(backup):
    h = Host(route="vmm")
    blocks = fill(h, "weights")
    used, reserved = h.device_used(), h.reserved()
    resident = h.tag_info("weights")["resident"]
    assert resident >= sum(SIZES)
    for cycle in range(3):
        h.release("weights", backup)
        info = h.tag_info("weights")
        assert info["life"] == 1 and info["resident"] == 0 and info["released"] == resident
        assert info["backup_bytes"] == resident
        assert h.device_used() == used - resident, "the memory is back with the driver"
        assert h.reserved() == reserved - resident, "the budget counts only resident memory"
        assert h.peek(blocks[0][0], 16) is None, "nothing is mapped behind a released tag"
        h.restore("weights")
        info = h.tag_info("weights")
        assert info["life"] == 0 and info["resident"] == resident and info["backup_bytes"] == 0
        assert h.device_used() == used and h.reserved() == reserved
        for p, data in blocks:
            assert h.peek(p, len(data)) == data, f"cycle {cycle}: contents differ after restore"
    assert h.host_pool()["used"] == 0


@isolated
def test_memset_restores_zeros_and_none_restores_usable_memory():
    h = Host(route="vmm")
    blocks = fill(h, "kv")
    h.release("kv", "memset")
    h.restore("kv")
    for p, data in blocks:
        assert h.peek(p, len(data)) == bytes(len(data))
    h.release("kv", "none")
    h.restore("kv")
    p, data = blocks[1]
    assert h.poke(p, data) and h.peek(p, len(data)) == data


@isolated
def test_misuse_raises_clear_errors_and_nothing_is_released_twice():
    h = Host(route="vmm")
    fill(h, "weights", [8 * MiB])
    with pytest.raises(RuntimeError, match="not released"):
        h.restore("weights")
    h.release("weights", "none")
    used = h.device_used()
    with pytest.raises(RuntimeError, match="already released"):
        h.release("weights", "pinned")
    assert h.device_used() == used
    h.push("vmm", "weights")
    with pytest.raises(RuntimeError, match="'weights' is released"):
        h.malloc(MiB)
    h.pop()
    with pytest.raises(ValueError, match="untagged"):
        _native.check(h.lib, h.lib.tb_release_tag(0, 0, 0))
    with pytest.raises(ValueError, match="backup mode"):
        _native.check(h.lib, h.lib.tb_release_tag(0, h.tag("weights"), 7))
    h.restore("weights")
    with pytest.raises(RuntimeError, match="not released"):
        h.restore("weights")


@isolated
def test_memory_of_a_tag_on_another_route_is_refused_naming_the_route():
    h = Host(route="vmm")
    h.push("sync", "mixed")
    p = h.malloc(4 * MiB)
    h.pop()
    with pytest.raises(RuntimeError, match="pool or sync route"):
        h.release("mixed")
    h.free(p)
    h.release("mixed")  # nothing left off the VMM route
    h.restore("mixed")


@isolated
def test_a_restore_that_runs_out_of_budget_rolls_back_and_a_later_one_succeeds():
    h = Host(route="vmm")
    blocks = fill(h, "weights")
    h.release("weights", "pinned")
    used, reserved = h.device_used(), h.reserved()
    h.set_budget(reserved + 64 * MiB)  # room for part of the tag only
    with pytest.raises(OOM, match="restore of tag 'weights'.*stays released"):
        h.restore("weights")
    info = h.tag_info("weights")
    assert info["life"] == 1 and info["backup_bytes"] > 0
    assert h.device_used() == used and h.reserved() == reserved, "the failed restore kept nothing mapped"
    h.set_budget(8 * GiB)
    h.restore("weights")
    for p, data in blocks:
        assert h.peek(p, len(data)) == data


@pytest.mark.parametrize("entry", ["cuMemMap", "cuMemCreate", "cuMemcpyHtoDAsync", "cuMemSetAccess"])
@isolated
def test_a_restore_failing_in_the_driver_half_way_unmaps_what_it_mapped(entry):
    h = Host(route="vmm")
    blocks = fill(h, "weights", SIZES + [520 * MiB])  # restored as three runs of at most 256 MiB
    h.release("weights", "pinned")
    used = h.device_used()
    # From the third call on: a failing run mapping falls back to granules, which fail too.
    h.fail(entry, nth=-3 if entry in ("cuMemMap", "cuMemCreate", "cuMemSetAccess") else 2)
    with pytest.raises(Exception):
        h.restore("weights")
    h.heal()
    assert h.tag_info("weights")["life"] == 1
    assert h.device_used() == used and h.counters()["mappings"] == 0
    h.restore("weights")
    for p, data in blocks:
        assert h.peek(p, len(data)) == data


@isolated
def test_a_release_whose_copy_fails_puts_back_what_it_had_dropped():
    h = Host(route="vmm")
    blocks = fill(h, "weights", SIZES + [520 * MiB])  # 15 pieces of at most 64 MiB
    used, unmaps = h.device_used(), h.counters()["unmaps"]
    h.fail("cuMemcpyDtoHAsync", nth=9)  # after the first piece of the window was dropped
    with pytest.raises(Exception, match="cuMemcpyDtoHAsync"):
        h.release("weights", "pinned")
    h.heal()
    assert h.counters()["unmaps"] > unmaps, "part of the tag had been dropped before the failure"
    assert h.tag_info("weights")["life"] == 0
    assert h.device_used() == used
    for p, data in blocks:
        assert h.peek(p, len(data)) == data
    assert h.host_pool()["used"] == 0


@isolated
def test_tensors_freed_while_released_are_not_restored():
    h = Host(route="vmm")
    blocks = fill(h, "weights")
    h.release("weights", "pinned")
    h.free(blocks[1][0])  # the 150 MiB one
    h.restore("weights")
    info = h.tag_info("weights")
    assert info["resident"] < 100 * MiB
    for p, data in blocks[:1] + blocks[2:]:
        assert h.peek(p, len(data)) == data


@isolated
def test_a_graph_pool_created_under_a_tag_is_released_whole_and_restored_whole():
    h = Host(route="vmm")
    pool = (1, 2)
    h.push(tag="graphs")
    h.begin_pool(pool, S1)
    a = h.malloc(6 * MiB)
    b = h.malloc(10 * MiB)
    h.free(a)  # a replay still writes here: its granules must come back too
    h.end_pool(pool)
    h.pop()
    resident = h.tag_info("graphs")["resident"]
    assert resident >= 16 * MiB
    h.release("graphs", "none")
    assert h.tag_info("graphs")["resident"] == 0
    with pytest.raises(RuntimeError, match="released"):
        h.push(tag="graphs")
        try:
            h.begin_pool(pool, S1)
            h.malloc(MiB)
        finally:
            h.end_pool(pool)
            h.pop()
    h.restore("graphs")
    assert h.tag_info("graphs")["resident"] == resident
    assert h.poke(a, b"x" * 4096) and h.poke(b, b"y" * 4096)
    h.free(b)
    h.release_pool(pool)


@isolated
def test_release_waits_for_queued_work_first():
    h = Host(route="vmm")
    fill(h, "weights", [8 * MiB])
    h.submit(S1)
    syncs = h.counters()["syncs"]
    h.release("weights", "none")
    assert h.counters()["syncs"] > syncs


@isolated
def test_trim_of_a_tag_returns_its_freed_memory_at_once():
    h = Host(route="vmm")
    h.push("vmm", "workspace")
    big = h.malloc(256 * MiB)
    h.pop()
    h.submit(S1)  # the workspace was used on S1 and is freed with work queued
    h.free(big)
    used = h.device_used()
    returned = h.trim("workspace")
    assert returned >= 256 * MiB
    assert h.device_used() <= used - 256 * MiB


@isolated
def test_trimming_a_tag_gives_back_its_graph_pools_no_graph_holds_and_leaves_other_tags_pools():
    # a graph's private pool takes the tag of the region it was captured in; once its graphs and
    # outputs are gone, empty_cache(tags=...) is how vLLM's release_cudagraph_pool gives it back
    h = Host(route="vmm")
    pools = {}
    for tag, pid in (("cudagraph", (0, 5)), ("other", (0, 6))):
        h.push("vmm", tag)
        h.begin_pool(pid, S1)
        pools[tag] = (pid, [h.malloc(4 * MiB, S1), h.malloc(4 * MiB, S1)])
        h.end_pool(pid)
        h.pop()
    h.submit(S1)  # a replay still running: the dead pools wait in line
    for pid, _ in pools.values():
        h.release_pool(pid)  # the graphs are destroyed
    for _, blocks in pools.values():
        for b in blocks:
            h.free(b)  # then their outputs
    assert h.tag_info("cudagraph")["resident"] == h.tag_info("other")["resident"] == 8 * MiB
    assert h.trim("cudagraph") == 8 * MiB
    assert h.tag_info("cudagraph")["resident"] == 0, "the tag's dead pool went back to the driver"
    assert h.tag_info("other")["resident"] == 8 * MiB, "another tag's pool is not this trim's"
    assert h.trim("cudagraph") == 0


@isolated
def test_pinned_backups_reuse_the_reserved_host_pool():
    h = Host(route="vmm")
    fill(h, "weights")
    _native.check(h.lib, h.lib.tb_host_pool_reserve(256 * MiB))
    assert h.host_pool()["bytes"] >= 256 * MiB
    pinned = h.lib.tb_host_pinned()
    for _ in range(3):
        h.release("weights", "pinned")
        h.restore("weights")
    stats = h.host_pool()
    assert stats["pinned_at_release"] == 0 and h.lib.tb_host_pinned() == pinned
    h.release("weights", "pinned")
    _native.check(h.lib, h.lib.tb_host_pool_free())
    assert h.host_pool()["bytes"] > 0, "a pool holding a backup is not freed"
    h.restore("weights")
    _native.check(h.lib, h.lib.tb_host_pool_free())
    assert h.host_pool()["bytes"] == 0 and h.lib.tb_host_pinned() == 0


@isolated
def test_without_keeping_the_host_pool_unpins_what_a_release_pinned_once_its_backups_are_gone():
    # Note [Keeping pinned memory]: what reserve() pinned stays; what a release pinned goes with
    # its last backup, as torch_memory_saver frees each backup.
    h = Host(route="vmm")
    blocks = fill(h, "weights")
    _native.check(h.lib, h.lib.tb_host_pool_reserve(8 * MiB))
    was = ctypes.c_int(-1)
    _native.check(h.lib, h.lib.tb_host_pool_set_keep(0, ctypes.byref(was)))
    assert was.value == 1 and not h.host_pool()["keep"]
    assert h.lib.tb_host_pool_set_keep(2, None) != 0, "keep is 0 or 1"
    for _ in range(2):
        h.release("weights", "pinned")
        assert h.host_pool()["bytes"] >= sum(SIZES) and h.host_pool()["pinned_at_release"] > 0
        h.restore("weights")
        for p, data in blocks:
            assert h.peek(p, len(data)) == data
        assert h.host_pool()["bytes"] == 8 * MiB == h.lib.tb_host_pinned(), h.host_pool()
    h.release("weights", "pinned")
    address, view = h.backup_view(blocks[0][0], 4096)        # a view keeps its backup's memory
    h.restore("weights")
    assert h.host_pool()["bytes"] > 8 * MiB and ctypes.string_at(address, 4096) == blocks[0][1][:4096]
    h.backup_view_end(view)
    assert h.host_pool()["bytes"] == 8 * MiB
    _native.check(h.lib, h.lib.tb_host_pool_set_keep(1, ctypes.byref(was)))
    assert was.value == 0
    h.release("weights", "pinned")
    h.restore("weights")
    assert h.host_pool()["bytes"] > 8 * MiB, "kept again"


@isolated
def test_the_host_pool_pins_memory_it_maps_itself_and_unmaps_it_when_freed():
    h = Host(route="vmm")
    blocks = fill(h, "weights")
    h.release("weights", "pinned")
    stats = h.host_pool()
    assert stats["bytes"] >= sum(SIZES) and stats["registered"] == stats["bytes"], stats
    assert h.lib.tb_host_pinned() == stats["bytes"], "registered memory is pinned memory"
    h.restore("weights")
    for p, data in blocks:
        assert h.peek(p, len(data)) == data
    _native.check(h.lib, h.lib.tb_host_pool_free())
    assert h.host_pool()["registered"] == 0 and h.lib.tb_host_pinned() == 0


@isolated
def test_where_registering_is_refused_the_host_pool_pins_through_cuMemHostAlloc_and_loses_nothing():
    h = Host(route="vmm")
    blocks = fill(h, "weights")
    h.fail("cuMemHostRegister", nth=-1)
    for _ in range(2):
        h.release("weights", "pinned")
        stats = h.host_pool()
        assert stats["registered"] == 0 and stats["bytes"] >= stats["used"] >= sum(SIZES), stats
        h.restore("weights")
        for p, data in blocks:
            assert h.peek(p, len(data)) == data
    h.fail("")
    _native.check(h.lib, h.lib.tb_host_pool_free())
    assert h.host_pool()["bytes"] == 0 and h.lib.tb_host_pinned() == 0


def _on_a_thread_without_context(fn):
    """fn() on a new thread, which has no current context; its result or its exception."""
    import threading
    out = {}

    def run():
        try:
            out["r"] = fn()
        except Exception as e:  # noqa: BLE001 -- handed back to the test
            out["r"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["r"]


@isolated
@pytest.mark.parametrize("how", ["free_host_pool", "restore", "last_view"])
def test_pinned_memory_is_unpinned_from_a_thread_without_a_context(how):
    h = Host(route="vmm")
    blocks = fill(h, "weights")
    if how == "free_host_pool":
        h.release("weights", "pinned")
        h.restore("weights")
        assert _on_a_thread_without_context(lambda: (h.current(), h.lib.tb_host_pool_free())) == (-1, 0)
    else:
        _native.check(h.lib, h.lib.tb_host_pool_set_keep(0, None))  # unpinned as its last backup goes
        h.release("weights", "pinned")
        if how == "restore":
            assert not isinstance(_on_a_thread_without_context(lambda: h.restore("weights")), Exception)
        else:
            p, data = blocks[2]
            _, view = h.backup_view(p, len(data))
            h.restore("weights")                # the view still holds its chunk
            assert h.lib.tb_host_pinned() > 0
            _on_a_thread_without_context(lambda: h.backup_view_end(view))
    for p, data in blocks:
        assert h.peek(p, len(data)) == data
    assert h.lib.tb_host_pinned() == 0 and h.host_pool()["bytes"] == 0


@isolated
def test_pinned_memory_stays_pinned_while_a_capture_is_open_and_goes_after():
    h = Host(route="vmm")
    blocks = fill(h, "weights")
    _native.check(h.lib, h.lib.tb_host_pool_set_keep(0, None))
    h.release("weights", "pinned")
    p, data = blocks[2]
    _, view = h.backup_view(p, len(data))
    h.restore("weights")                        # the view still holds its chunk
    pinned = h.lib.tb_host_pinned()
    h.begin_pool((0, 9), S2)                    # a capture opens: unpinning would invalidate it
    unregisters = h.counters()["injected"]
    h.fail("cuMemHostUnregister", nth=1)        # counts an unpinning from here on
    h.fail("cuMemFreeHost", nth=1)
    _on_a_thread_without_context(lambda: h.backup_view_end(view))
    assert h.counters()["injected"] == unregisters and h.lib.tb_host_pinned() == pinned > 0
    with pytest.raises(Exception, match="capture may be open .a capture into a private pool or a torch.cuda.use_mem_pool"):
        _native.check(h.lib, h.lib.tb_host_pool_free())
    h.heal()
    h.end_pool((0, 9))
    _native.check(h.lib, h.lib.tb_host_pool_free())
    assert h.lib.tb_host_pinned() == 0


@isolated
def test_a_failed_unregister_keeps_the_chunk_and_a_later_free_gives_it_back():
    h = Host(route="vmm")
    fill(h, "weights")
    h.release("weights", "pinned")
    h.restore("weights")
    pinned = h.lib.tb_host_pinned()
    h.fail("cuMemHostUnregister", nth=1)
    assert h.lib.tb_host_pool_free() != 0, "the driver refused: the call says so"
    assert h.host_pool()["bytes"] == pinned == h.lib.tb_host_pinned() > 0, "nothing leaks, nothing dangles"
    _native.check(h.lib, h.lib.tb_host_pool_free())
    assert h.host_pool()["bytes"] == 0 and h.lib.tb_host_pinned() == 0


@isolated
def test_a_restore_maps_runs_with_one_handle_each_and_they_go_back_only_whole():
    h = Host(route="vmm")
    # 170 granules from the arena's base: a restore maps them as two runs of at most 256 MiB,
    # [0, 128) (a and the front of b) and [128, 170) (the rest of b and c).
    (a, _), (b, b_data), (c, _) = fill(h, "weights", [200 * MiB, 100 * MiB, 40 * MiB])
    granules = h.tag_info("weights")["resident"] // (2 * MiB)
    h.release("weights", "pinned")
    maps = h.counters()["maps"]
    h.restore("weights")
    runs = h.counters()["maps"] - maps
    assert runs == 2 < granules, (runs, granules)  # one mapping per run across the copy pieces
    unmaps = h.counters()["unmaps"]
    h.release("weights", "pinned")  # a second cycle drops whole runs
    assert h.counters()["unmaps"] - unmaps == runs
    h.restore("weights")
    # Freeing part of a run keeps the run mapped; freeing all of it gives it back whole.
    used = h.device_used()
    h.free(a)
    h.free(c)
    h.empty_cache()
    assert h.device_used() == used, "both runs still hold a part of b"
    assert h.peek(b, len(b_data)) == b_data
    h.free(b)  # now both runs are free
    h.empty_cache()
    assert h.device_used() == used - 340 * MiB and h.counters()["mappings"] == 0


@isolated
def test_release_and_restore_racing_allocating_threads_keep_the_ledger_whole():
    import threading

    h = Host(route="vmm")
    blocks = fill(h, "weights", [8 * MiB, 3 * MiB, 20 * MiB])
    stop, errors = threading.Event(), []

    def churn(seed):
        import random
        rng = random.Random(seed)
        mine = []
        try:
            while not stop.is_set():
                tagged = rng.random() < 0.3
                if tagged:
                    h.push("vmm", "weights")
                try:
                    mine.append(h.malloc(rng.choice([4096, 300_000, 5 * MiB])))
                except RuntimeError as e:  # allocating under the tag while it is released
                    assert tagged and "released" in str(e), e
                finally:
                    if tagged:
                        h.pop()
                if len(mine) > 8 or (mine and rng.random() < 0.4):
                    h.free(mine.pop(rng.randrange(len(mine))))
            for p in mine:
                h.free(p)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for cycle in range(30):
        h.release("weights", ("pinned", "cpu")[cycle % 2])
        h.restore("weights")
        for p, data in blocks:
            assert h.peek(p, len(data)) == data, f"cycle {cycle}"
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for p, _ in blocks:
        h.free(p)
    h.empty_cache()
    st = h.stats()
    assert st["allocation"]["all"]["current"] == 0 and h.device_used() == 0, (st["allocation"], h.device_used())


@isolated
def test_a_restore_the_driver_refuses_says_so_rather_than_blaming_the_budget():
    h = Host(route="vmm", capacity=64 * MiB, budget=70 * MiB)  # a budget above what the card has
    fill(h, "w", [16 * MiB])                # one 16 MiB run mapping under tag w
    h.release("w", "cpu")
    h.malloc(60 * MiB)                      # untagged: 60 of the card's 64 MiB, 10 of the budget left
    # The 16 MiB run passes the budget's room; mapped granule by granule, the third finds the
    # card full while the budget still has 6 MiB of room.
    with pytest.raises(OOM) as e:
        h.restore("w")
    assert "driver refused" in str(e.value) and "raise the budget" not in str(e.value), str(e.value)
    assert "retried" not in str(e.value)    # a restore neither empties the cache nor tries again


@isolated
def test_a_release_counts_every_granule_of_a_free_run_mapping_it_gives_back():
    h = Host(route="vmm", map_run=16 * MiB)
    h.push("vmm", "w")
    h.malloc(2 * MiB)
    spare = h.malloc(16 * MiB)       # one run mapping of 16 MiB
    h.pop()
    h.free(spare)
    h.release("w", "pinned")
    assert h.device_used() == 0
    assert h.tag_info("w")["last_device"] == 18 * MiB  # was 4 MiB: one granule per run


@isolated
def test_a_restore_never_reports_success_over_memory_its_device_cannot_reach():
    # Note [Unreachable mappings]: with every access call and every unmap refused, the restore
    # copied into a mapping its device could not touch and reported success.
    h = Host(route="vmm")
    (p, data), = fill(h, "weights", [8 * MiB])
    h.release("weights", "pinned")
    h.fail("cuMemSetAccess", nth=-1)
    h.fail("cuMemUnmap", nth=-1)
    with pytest.raises(Exception, match="cuMemSetAccess"):
        h.restore("weights")
    h.heal()
    assert h.tag_info("weights")["life"] != 0     # still released, its backup kept
    h.restore("weights")                          # the driver agrees again: reached, then restored
    assert h.can_access(0, p) and h.peek(p, len(data)) == data


@pytest.mark.parametrize("phase", ["restore", "release"])
@isolated
def test_a_refused_free_of_the_digest_buffers_is_freed_later_not_left_with_the_driver(phase):
    # The digests' device buffers were forgotten when cuMemFree refused them: memory the driver
    # kept and the ledger never counted, more at each refusal.
    h = Host(route="vmm")
    blocks = fill(h, "weights", [6 * MiB, 150 * MiB, 1024, 40 * MiB])
    h.release("weights", "pinned", retain=True)
    if phase == "release":
        h.restore("weights")
    h.fail("cuMemFree", nth=1)                    # the free at the end of this call's digests
    if phase == "restore":
        h.restore("weights")
    else:
        h.release("weights", "pinned", retain=True)
    h.heal()
    for _ in range(2):
        if h.tag_info("weights")["life"] == 0:
            h.release("weights", "pinned", retain=True)
        h.restore("weights")
    for p, data in blocks:
        assert h.peek(p, len(data)) == data
    assert h.device_used() == h.reserved()


@isolated
def test_released_counts_only_what_the_restore_will_map_back():
    h = Host(route="vmm")
    blocks = fill(h, "w")  # 3 MiB, 150 MiB, 1 KiB, 40 MiB
    h.release("w", "pinned")
    h.free(blocks[1][0])   # freed while the tag sleeps: the restore skips its memory
    h.empty_cache()
    before = h.tag_info("w")
    h.restore("w")
    mapped = h.tag_info("w")["last_device"]
    assert before["released"] == mapped == before["backup_bytes"], (before, mapped)  # it counted the 150 MiB too
