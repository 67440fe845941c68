"""The public Python API (install, region, stats, empty_cache, set_budget, release, restore,
sleeping) over the host stand-in: each test installs into a forked child whose torch_budget
serves the host core instead of a GPU (_hostcore.python_api_over)."""
import asyncio
import os
import threading

import pytest
import torch

import torch_budget
from _hostcore import OOM, GiB, MiB, Host, isolated, python_api_over
from torch_budget import sleep
from torch_budget.errors import (ConfigError, InstallError, InvalidArgumentError, NotInstalledError,
                                 StateError, TagStateError)

pytestmark = pytest.mark.built("_host_core")


def _installed_host(devices=1, **install):
    host = Host(configure=False, devices=devices)
    python_api_over(host)
    torch_budget.install(**{"route": "vmm", **install})
    return host


def _tagged(host, tag, nbytes, fill=None, device=0):
    with torch_budget.region(tag):
        p = host.malloc(nbytes, stream=host.stream(device), device=device)
    if fill is not None:
        assert host.poke(p, fill * 4096)
    return p


@isolated
def test_region_charges_its_allocations_to_its_tag_and_route():
    host = _installed_host()
    with torch_budget.region("kv", route="sync"):
        host.malloc(3 * MiB)
        with torch_budget.region(route="vmm"):  # the tag is kept, the route changes
            host.malloc(2 * MiB)
    st = torch_budget.stats()
    assert st["by_tag"]["kv"]["allocated"] == 5 * MiB
    assert st["by_route"]["sync"]["allocated"] == 3 * MiB and st["by_route"]["vmm"]["allocated"] == 2 * MiB


@isolated
def test_the_default_tag_charges_what_every_thread_allocates_outside_a_region():
    from torch_budget import allocator

    host = _installed_host()
    allocator.set_default_tag("everything")
    host.malloc(2 * MiB)
    other = threading.Thread(target=lambda: host.malloc(4 * MiB))  # another thread, no scope of its own
    other.start()
    other.join()
    with torch_budget.region("kv"):
        host.malloc(1 * MiB)
    with torch_budget.region("untagged"):               # an untagged scope inside
        host.malloc(8 * MiB)
    allocator.set_default_tag(None)
    host.malloc(16 * MiB)
    tags = torch_budget.stats()["by_tag"]
    assert tags["everything"]["allocated"] == 6 * MiB and tags["kv"]["allocated"] == 1 * MiB
    assert tags["untagged"]["allocated"] == 24 * MiB
    with pytest.raises(TypeError):
        allocator.set_default_tag(3)


@isolated
def test_install_and_region_take_the_same_routes_through_one_validator():
    host = _installed_host(route="auto")
    with torch_budget.region("a", route="auto"):  # the first route the device supports, as in install()
        host.malloc(MiB)
    assert torch_budget.stats()["by_route"]["vmm"]["allocated"] == MiB
    for bad in ("fast", "AUTO"):
        with pytest.raises(ConfigError, match=f"unknown route '{bad}'"):
            with torch_budget.region("a", route=bad):
                pass
        with pytest.raises(ConfigError, match=f"unknown route '{bad}'"):
            torch_budget.install(route=bad)


@isolated
def test_install_refuses_a_switch_that_is_not_a_bool():
    for bad in ("false", 0, 0.5, []):
        with pytest.raises(ConfigError, match="reuse_before_grow must be True or False"):
            torch_budget.install(reuse_before_grow=bad)
    assert not torch_budget.installed()  # nothing was installed by a refused call


def test_region_checks_its_tag_without_install():
    with pytest.raises(TypeError, match="tag must be a str"):
        with torch_budget.region(5):
            pass
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        with torch_budget.region(""):
            pass
    with torch_budget.region("kv", route="pool"):  # torch's allocator is in charge: nothing to do
        pass


@isolated
def test_a_repeat_install_compares_settings_after_parsing():
    _installed_host(budget="64MiB", map_run="4MiB")
    first = torch_budget.install(budget=64 << 20, map_run=4 * MiB)  # other spellings, same settings
    assert first["budget_bytes"] == 64 * MiB and first["map_run"] == 4 * MiB
    assert torch_budget.install() == first  # asks nothing, so nothing differs
    assert torch_budget.install(route="vmm", reuse_before_grow=True) == first
    with pytest.raises(InstallError) as raised:
        torch_budget.install(budget="32MiB", route="vmm")
    message = str(raised.value)
    assert "already installed with budget 64.0 MiB (67108864 bytes)" in message, message
    assert "this call asks for budget 32.0 MiB (33554432 bytes)" in message, message
    assert "set_budget" in message and "route" not in message.split("set_budget")[0], message
    assert isinstance(raised.value, RuntimeError)


@isolated
def test_a_bad_setting_raises_config_error_naming_it():
    Host(configure=False)
    with pytest.raises(ConfigError, match="map_run"):
        torch_budget.install(map_run="1MiB")
    with pytest.raises(ValueError, match="budget"):  # a ConfigError is a ValueError
        torch_budget.install(budget="lots")


@isolated
def test_release_and_restore_act_on_the_current_device_unless_told_all():
    host = _installed_host(devices=2)
    on0 = _tagged(host, "w", 4 * MiB, fill=b"a", device=0)
    host.set_current(1)
    on1 = _tagged(host, "w", 2 * MiB, fill=b"b", device=1)
    report = torch_budget.release("w")  # the current device: 1
    assert (report["devices"], report["bytes"]) == ([1], 2 * MiB), report
    assert sleep.tag_states(device=0)["w"]["state"] == "live" and sleep.tag_states()["w"]["state"] == "released"
    with pytest.raises(TagStateError, match="'w' is released on device 1; release needs it live"):
        torch_budget.release("w")
    torch_budget.restore("w")
    report = torch_budget.release("w", device="all")
    assert report["devices"] == [0, 1] and report["bytes"] == 6 * MiB, report
    assert torch_budget.restore("w", device="all")["devices"] == [0, 1]
    # The default backup kept the contents.
    assert host.peek(on0, 4096) == b"a" * 4096 and host.peek(on1, 4096) == b"b" * 4096


@isolated
def test_tags_none_is_every_tag_and_untagged_memory_stays():
    host = _installed_host()
    _tagged(host, "weights", 4 * MiB)
    _tagged(host, "kv", 2 * MiB)
    host.malloc(MiB)
    report = torch_budget.release()
    assert report["tags"] == ["kv", "weights"] and report["bytes"] == 6 * MiB, report
    assert torch_budget.stats()["by_tag"]["untagged"]["allocated"] == MiB
    assert torch_budget.release()["tags"] == []  # nothing is live any more
    assert torch_budget.restore()["tags"] == ["kv", "weights"]
    assert {n: s["state"] for n, s in sleep.tag_states().items() if n != "untagged"} == {"kv": "live", "weights": "live"}


@isolated
def test_release_keeps_contents_by_default_as_sleeping_does():
    host = _installed_host()
    p = _tagged(host, "weights", 4 * MiB, fill=b"w")
    assert torch_budget.release("weights")["backup_bytes"] >= 4096
    assert sleep.released_tags() == {"weights": "pinned"}
    torch_budget.restore("weights")
    assert host.peek(p, 4096) == b"w" * 4096
    with torch_budget.sleeping("weights") as report:
        assert report["backup_bytes"] >= 4096
    assert host.peek(p, 4096) == b"w" * 4096 and report["restore"]["tags"] == ["weights"]


@isolated
def test_sleeping_restores_exactly_what_it_released():
    host = _installed_host()
    _tagged(host, "kv", 2 * MiB)
    _tagged(host, "weights", 4 * MiB)
    torch_budget.release("kv", backup="none")
    with torch_budget.sleeping() as report:  # every live tag: weights
        assert report["tags"] == ["weights"]
    states = sleep.tag_states()
    assert states["weights"]["state"] == "live" and states["kv"]["state"] == "released", states


@isolated
def test_sleeping_wakes_each_tag_it_can_whatever_the_body_did_or_one_tag_refused():
    # A tag the body restored made the exit raise before the others; so did one whose memory
    # could not be had: the tags after it stayed asleep.
    host = _installed_host(budget="12MiB")
    _tagged(host, "a", 2 * MiB)
    kv = _tagged(host, "kv", 6 * MiB, fill=b"k")
    w = _tagged(host, "w", 2 * MiB, fill=b"w")
    with torch_budget.sleeping(["a", "kv", "w"]) as report:
        torch_budget.restore("a")
    assert report["restore"]["tags"] == ["kv", "w"] and not sleep.released_tags()
    with pytest.raises(OOM):
        with torch_budget.sleeping(["kv", "w"]):
            squeeze = host.malloc(5 * MiB)     # 2 + 5 + 6 > 12: kv cannot come back, w can
    states = sleep.tag_states()
    assert (states["kv"]["state"], states["w"]["state"]) == ("released", "live")
    assert host.peek(w, 4096) == b"w" * 4096
    host.free(squeeze)
    torch_budget.restore("kv")
    assert host.peek(kv, 4096) == b"k" * 4096


@isolated
def test_a_tag_in_the_wrong_state_raises_before_anything_is_released():
    host = _installed_host()
    kv = _tagged(host, "kv", 2 * MiB, fill=b"k")
    _tagged(host, "weights", 4 * MiB)
    torch_budget.release("weights")
    with pytest.raises(TagStateError, match="'weights' is released"):
        torch_budget.release(["kv", "weights"], backup="none")
    assert sleep.tag_states()["kv"]["state"] == "live" and host.peek(kv, 4096) == b"k" * 4096
    with pytest.raises(TagStateError, match="'kv' is live on device 0; restore needs it released"):
        torch_budget.restore(["weights", "kv"])
    assert sleep.tag_states()["weights"]["state"] == "released"
    with pytest.raises(InvalidArgumentError, match="unknown tag 'nope'"):
        torch_budget.release("nope")
    with pytest.raises(InvalidArgumentError, match="unknown backup 'tape'"):
        torch_budget.release("kv", backup="tape")


@isolated
def test_empty_cache_with_tags_empties_only_their_pools():
    host = _installed_host()
    kv, w = _tagged(host, "kv", 4 * MiB), _tagged(host, "weights", 4 * MiB)
    host.free(kv)
    host.free(w)
    host.complete(host.stream())
    def resident():
        return {tag: torch_budget.stats()["by_tag"][tag]["resident"] for tag in ("kv", "weights")}

    assert resident() == {"kv": 4 * MiB, "weights": 4 * MiB}
    torch_budget.empty_cache(tags="kv")
    assert resident() == {"kv": 0, "weights": 4 * MiB}
    torch_budget.empty_cache(device="all")
    assert resident() == {"kv": 0, "weights": 0}
    with pytest.raises(InvalidArgumentError, match="unknown tag 'nope'"):
        torch_budget.empty_cache(tags=["nope"])


@isolated
def test_set_budget_takes_every_spelling_and_all_devices():
    host = _installed_host(devices=2)
    host.free(host.malloc(MiB, stream=host.stream(1), device=1))  # device 1 is served from here on
    torch_budget.set_budget("1GiB")
    assert torch_budget.stats()["budget"] == GiB
    torch_budget.set_budget(512 * MiB, device="all")
    assert torch_budget.stats(0)["budget"] == torch_budget.stats("cuda:1")["budget"] == 512 * MiB
    with pytest.raises(ConfigError):
        torch_budget.set_budget(None)
    host.malloc(8 * MiB)
    with pytest.raises(ValueError):
        torch_budget.set_budget(4 * MiB)


@isolated
def test_all_devices_includes_those_that_serve_their_first_allocation_later():
    host = _installed_host(devices=3)
    torch_budget.set_budget("256MiB", device="all")            # before any device served
    torch_budget.set_budget("64MiB", device="all", tag="kv")
    host.free(host.malloc(MiB, stream=host.stream(0), device=0))
    assert torch_budget.stats(0)["budget"] == 256 * MiB and torch_budget.stats(0)["by_tag"]["kv"]["budget"] == 64 * MiB
    torch_budget.set_budget("128MiB", device="all")            # device 0 served, 1 and 2 not yet
    host.free(host.malloc(MiB, stream=host.stream(1), device=1))
    assert [torch_budget.stats(d)["budget"] for d in (0, 1)] == [128 * MiB] * 2
    with pytest.raises(OOM):
        _tagged(host, "kv", 96 * MiB, device=1)
    # A refusal on a served device leaves the later devices' budget as it was too.
    _tagged(host, "kv", 48 * MiB, device=1)
    with pytest.raises(InvalidArgumentError, match="device 1"):
        torch_budget.set_budget("32MiB", device="all", tag="kv")
    host.free(host.malloc(MiB, stream=host.stream(2), device=2))
    assert torch_budget.stats(2)["budget"] == 128 * MiB and torch_budget.stats(2)["by_tag"]["kv"]["budget"] == 64 * MiB


@isolated
def test_device_all_is_refused_where_a_call_reads_one_device():
    _installed_host()
    for read in (torch_budget.stats, sleep.tag_states, torch_budget.diagnostics.segments):
        with pytest.raises(InvalidArgumentError, match="reads one device"):
            read(device="all")
    with pytest.raises(InvalidArgumentError, match="CUDA device"):
        torch_budget.stats("cpu")
    with pytest.raises(TypeError):
        torch_budget.stats(True)


@isolated
def test_tags_as_bytes_and_backup_of_copy_as_a_non_bool_are_refused_naming_them():
    import torch

    _installed_host()
    for tags in (b"w", bytearray(b"w")):
        with pytest.raises(TypeError, match="tags must be None, a tag name \\(str\\)"):
            torch_budget.release(tags)
    for copy in (None, 0, "no"):
        with pytest.raises(TypeError, match="backup_of's copy must be True or False"):
            sleep.backup_of(torch.zeros(1), copy=copy)


def test_calls_that_need_install_say_so():
    for call, name in ((torch_budget.stats, "stats"), (torch_budget.release, "release"),
                       (torch_budget.restore, "restore"), (torch_budget.empty_cache, "empty_cache")):
        with pytest.raises(NotInstalledError, match=rf"torch_budget.{name}\(\) needs torch_budget.install\(\) first"):
            call()
    with pytest.raises(RuntimeError):  # what it raised before it had its own class
        torch_budget.set_budget("1GiB")


@isolated
def test_release_with_discardable_tensors_copies_only_the_rest_and_refuses_what_is_not_the_tags():
    # Note [Discardable blocks]: parameters the caller reloads after the wake go without a copy; the
    # buffer beside them (its own small-pool page) keeps its contents.
    host = _installed_host()
    params = [_tagged(host, "weights", 8 * MiB, b"p"), _tagged(host, "weights", 6 * MiB, b"q")]
    buffer = _tagged(host, "weights", 64 * 1024, b"b")
    other = _tagged(host, "kv", 2 * MiB, b"k")
    for bad, error, message in [
        (5, TypeError, "collection of storage addresses or tensors"),
        (["x"], TypeError, "holds str"),
        ([0], InvalidArgumentError, "no device address"),
        ([other], InvalidArgumentError, "under tag 'kv', not one of the tags released here"),
        ([params[0] + 4096], InvalidArgumentError, "no live allocation"),
    ]:
        with pytest.raises(error, match=message):
            torch_budget.release("weights", discardable=bad)
        assert sleep.tag_states()["weights"]["state"] == "live"
    with pytest.raises(InvalidArgumentError, match="retained backup cannot have"):
        torch_budget.release("weights", retain=True, discardable=params)
    report = torch_budget.release("weights", discardable=params)
    weights = sleep.tag_states()["weights"]
    assert report["backup_bytes"] == weights["backup_bytes"] == 2 * MiB, (report, weights)
    assert report["bytes"] == weights["released"] >= 16 * MiB
    torch_budget.restore("weights")
    assert host.peek(buffer, 4096) == b"b" * 4096
    assert all(host.poke(p, b"n" * 4096) for p in params)
    # Both tags at once: each address goes to its own tag's release.
    report = torch_budget.release(["weights", "kv"], discardable=params + [other])
    assert report["backup_bytes"] == 2 * MiB
    torch_budget.restore()
    assert host.peek(buffer, 4096) == b"b" * 4096
    with torch_budget.sleeping("weights", discardable=params) as report:  # as release() takes it
        assert report["backup_bytes"] == 2 * MiB
    assert host.peek(buffer, 4096) == b"b" * 4096 and sleep.tag_states()["weights"]["state"] == "live"


@pytest.mark.parametrize("route", ["vmm", "sync"])
def test_inactive_split_counts_backed_free_blocks_of_segments_still_in_use_by_pool(route):
    @isolated
    def body():
        h = Host(route=route)
        a, b = h.malloc(256 * 1024), h.malloc(256 * 1024)   # small, side by side
        big, keep = h.malloc(8 * MiB), h.malloc(8 * MiB)    # large, side by side
        h.free(a)
        h.free(big)
        count, nbytes = h.inactive_split()
        assert count[0] == count[1] + count[2] and nbytes[0] == nbytes[1] + nbytes[2]
        assert count[1] >= 1 and nbytes[1] >= 256 * 1024    # a's block, in the segment b keeps
        assert count[2] >= 1 and nbytes[2] >= 8 * MiB       # big's, beside keep
        # Memory the segments hold: never an arena's unmapped address range.
        assert nbytes[0] <= h.reserved() - h.allocated()
        for p in (b, keep):
            h.free(p)
        assert h.inactive_split() == ([0, 0, 0], [0, 0, 0])  # nothing live: nothing split
    body()


@isolated
def test_a_release_that_failed_halfway_and_left_its_tag_released_is_known_released():
    host = _installed_host(route="vmm")
    ptrs = [_tagged(host, "w", 150 * MiB) for _ in range(4)]
    host.fail("cuMemcpyDtoHAsync", nth=9)  # after the first piece of the window was dropped
    host.fail("cuMemCreate", nth=-1)       # ... and nothing can be mapped back
    with pytest.raises(Exception, match="stays released"):
        torch_budget.release("w")
    host.heal()
    assert sleep.tag_states()["w"]["state"] == "released"
    # The guards and the adapters read this: before, it said nothing was released.
    assert sleep.any_released() and sleep.released_tags() == {"w": "pinned"}
    torch_budget.restore("w")
    assert not sleep.any_released() and host.peek(ptrs[0], 16) is not None


@isolated
def test_a_restore_that_fails_part_way_lists_as_released_only_what_stays_released():
    host = _installed_host(route="vmm")
    a, b = _tagged(host, "a", 2 * MiB, b"A"), _tagged(host, "b", 2 * MiB, b"B")
    torch_budget.release(["a", "b"])
    host.fail("cuMemCreate", nth=-2)         # "a" maps back, "b" cannot
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch_budget.restore(["a", "b"])
    host.heal()
    assert sleep.tag_states()["a"]["state"] == "live" and host.peek(a, 4096) == b"A" * 4096
    assert sleep.released_tags() == {"b": "pinned"}  # it still listed "a", which no adapter could pause again
    torch_budget.release("a")
    torch_budget.restore(["a", "b"])
    assert not sleep.any_released() and host.peek(b, 4096) == b"B" * 4096


@isolated
def test_a_tag_is_restored_on_all_its_devices_or_on_none():
    host = _installed_host(devices=2)
    a, b = _tagged(host, "kv", 2 * MiB, b"A", device=0), _tagged(host, "kv", 2 * MiB, b"B", device=1)
    torch_budget.release("kv", device="all")
    host.fail("cuMemCreate", nth=-2)         # device 0 maps back, device 1 cannot
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch_budget.restore("kv", device="all")
    host.heal()
    # Half restored, the tag was listed released, and the adapters' next release skipped device 0.
    assert [sleep.tag_states(d)["kv"]["state"] for d in (0, 1)] == ["released", "released"]
    assert sleep.released_tags() == {"kv": "pinned"}
    torch_budget.restore("kv", device="all")
    assert host.peek(a, 4096) == b"A" * 4096 and host.peek(b, 4096) == b"B" * 4096


@isolated
def test_tags_restored_on_several_devices_come_back_whole_tag_by_tag_when_one_refuses():
    # Restored device by device, a refusal of "b" on device 0 left "a" live there and released on
    # device 1; under sleeping() the next device restored "a" alone.
    host = _installed_host(devices=2)
    for d in (0, 1):
        _tagged(host, "a", 2 * MiB, b"a", device=d)
        _tagged(host, "b", 8 * MiB, b"b", device=d)
    torch_budget.release(["a", "b"], device="all")
    torch_budget.set_budget(4 * MiB, device=0)  # device 0 can map "a" back, not "b"
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch_budget.restore(["a", "b"], device="all")
    assert [sleep.tag_states(d)["a"]["state"] for d in (0, 1)] == ["live", "live"]
    assert [sleep.tag_states(d)["b"]["state"] for d in (0, 1)] == ["released", "released"]
    assert sleep.released_tags() == {"b": "pinned"}
    torch_budget.set_budget(1 << 40, device=0)
    torch_budget.restore("b", device="all")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with torch_budget.sleeping("a", device="all"):
            torch_budget.set_budget(9 * MiB, device=0)  # "a" cannot come back on device 0
    assert [sleep.tag_states(d)["a"]["state"] for d in (0, 1)] == ["released", "released"]
    torch_budget.set_budget(1 << 40, device=0)
    torch_budget.restore("a", device="all")


@isolated
def test_a_discardable_address_of_a_tag_released_on_other_devices_only_is_named_so():
    host = _installed_host(devices=2)
    _tagged(host, "w", 8 * MiB, b"w", device=0)
    w1 = _tagged(host, "w", 2 * MiB, b"v", device=1)
    # it said the allocation under tag 'w' was "not one of the tags released here ('w')"
    with pytest.raises(InvalidArgumentError, match=f"discardable address {w1:#x} is an allocation on device 1 "
                                                   "under tag 'w', which this call releases on device.s. 0 only"):
        torch_budget.release("w", device=0, discardable=[w1])
    assert sleep.tag_states(0)["w"]["state"] == "live"


@isolated
def test_a_release_refused_for_want_of_pinned_memory_leaves_the_tags_last_release_as_it_was():
    # It recorded the refused release: backup "pinned", 8 MiB moved.
    host = _installed_host(route="vmm")
    _tagged(host, "w", 8 * MiB, b"w")
    torch_budget.release("w", backup="none")
    torch_budget.restore("w")
    before = sleep.tag_states()["w"]
    host.fail("cuMemHostRegister", nth=-1)
    host.fail("cuMemHostAlloc", nth=-1)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch_budget.release("w", backup="pinned")
    host.heal()
    assert sleep.tag_states()["w"] == before


@isolated
def test_a_producer_that_keeps_shared_tensors_says_when_the_consumers_closed_them_and_releases_their_tag():
    # Weights sent for an RL weight sync stay the producer's: without end_sharing their tag could never go.
    host = _installed_host(route="vmm")
    w = _tagged(host, "weights", 8 * MiB, b"w")
    host.share(w)
    with pytest.raises(StateError, match=r"torch_budget.sleep.end_sharing\(tensors\) said so"):
        torch_budget.release("weights")
    sleep.end_sharing([w])
    torch_budget.release("weights")
    torch_budget.restore("weights")
    assert host.peek(w, 4096) == b"w" * 4096
    with pytest.raises(InvalidArgumentError, match="was not allocated by torch_budget"):
        sleep.end_sharing([w + 4096 * 1024 * 1024])
    # an address inside the block: the message had spoken of a double free
    with pytest.raises(InvalidArgumentError, match="cannot end sharing pointer 0x[0-9a-f]+: it does not start a "
                                                   "live allocation .* give the tensor whose storage was shared"):
        sleep.end_sharing([w + 4096])
    with pytest.raises(TypeError, match="tensors must be a collection"):
        sleep.end_sharing(w)


@isolated
def test_a_half_restore_undone_releases_each_device_with_its_own_backup():
    # The undo took the tag's last release's mode (device 1's "none") for device 0, released "pinned".
    host = _installed_host(devices=2)
    a = _tagged(host, "kv", 2 * MiB, b"A", device=0)
    _tagged(host, "kv", 2 * MiB, b"B", device=1)
    torch_budget.release("kv", backup="pinned", device=0)
    torch_budget.release("kv", backup="none", device=1)
    host.fail("cuMemCreate", nth=-2)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch_budget.restore("kv", device="all")
    host.heal()
    assert sleep.tag_states(0)["kv"]["backup"] == "pinned"
    torch_budget.restore("kv", device="all")
    assert host.peek(a, 4096) == b"A" * 4096


@isolated
def test_a_half_restore_undone_keeps_the_retention_each_device_had():
    host = _installed_host(devices=2)
    _tagged(host, "kv", 8 * MiB, b"A", device=0)
    _tagged(host, "kv", 8 * MiB, b"B", device=1)
    torch_budget.release("kv", device="all", retain=True)
    host.fail("cuMemCreate", nth=-2)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch_budget.restore("kv", device="all")
    host.heal()
    torch_budget.restore("kv", device="all")
    assert [sleep.tag_states(d)["kv"]["retained"] for d in (0, 1)] == [True, True]


@isolated
def test_a_restore_whose_retention_a_tag_refuses_leaves_the_tags_after_it_as_they_were():
    host = _installed_host(route="vmm")
    for tag in ("a", "b", "c"):
        _tagged(host, tag, 4 * MiB)
    torch_budget.release("a", backup="pinned")
    torch_budget.release("b", backup="memset")  # a memset backup cannot be retained
    torch_budget.release("c", backup="pinned")
    with pytest.raises(InvalidArgumentError, match="only a cpu or pinned backup can be retained"):
        torch_budget.restore(["a", "b", "c"], retain=True)
    states = sleep.tag_states()
    assert states["a"]["state"] == "live" and states["a"]["retained"]  # restored as asked
    assert states["b"]["state"] == states["c"]["state"] == "released"
    torch_budget.restore("c")                   # asks nothing of retention: none is kept
    assert not sleep.tag_states()["c"]["retained"]


@isolated
def test_numbers_past_what_the_core_holds_are_refused_not_wrapped():
    # ctypes keeps the low 64 (or 32) bits: 2**64 bytes became a budget of 0, device 2**32 device 0.
    for kwargs in ({"budget": 2**64}, {"budget": "16777216TiB"}, {"budgets": {"kv": 2**64}}, {"host_pool": 2**70},
                   {"map_run": 2**63}, {"budget": "9" * 400 + "GiB"}, {"host_pool": "9" * 300 + "TiB"}, {"map_run": "9" * 400}):
        with pytest.raises(ConfigError, match="2\\*\\*63"):   # the last three: int(inf)'s OverflowError
            torch_budget.install(**kwargs)
    host = _installed_host()
    _tagged(host, "kv", 4 * MiB)
    with pytest.raises((ConfigError, InvalidArgumentError), match="2\\*\\*63"):
        torch_budget.set_budget(2**64)
    assert torch_budget.stats()["budget"] is None
    for call in (lambda: torch_budget.release("kv", device=2**32), lambda: torch_budget.stats(2**32),
                 lambda: torch_budget.empty_cache(2**32)):
        with pytest.raises(InvalidArgumentError, match="4294967296 does not exist"):
            call()
    assert sleep.tag_states()["kv"]["state"] == "live"
    with pytest.raises(InvalidArgumentError, match="no device address"):
        torch_budget.release("kv", discardable=[2**64 + 4096])


@isolated
def test_a_region_ended_before_the_one_opened_inside_it_is_refused_and_ends_after_it():
    # The refused scope stayed open for good: its context manager was spent.
    host = _installed_host()
    outer, inner = torch_budget.region("a"), torch_budget.region("b")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(StateError, match="region\\('a'\\) is ended while region\\('b'\\), opened inside it"):
        outer.__exit__(None, None, None)
    host.malloc(2 * MiB)             # still inside b
    inner.__exit__(None, None, None)
    host.malloc(4 * MiB)             # a ended with b: outside every region
    tags = torch_budget.stats()["by_tag"]
    assert tags["b"]["allocated"] == 2 * MiB and tags["untagged"]["allocated"] == 4 * MiB
    assert tags["a"]["allocated"] == 0


@isolated
def test_regions_of_interleaved_asyncio_tasks_leave_no_scope_open():
    host = _installed_host()

    async def task(tag, delay):
        with torch_budget.region(tag):
            await asyncio.sleep(delay)

    async def main():
        a = asyncio.create_task(task("a", 0.01))
        await asyncio.sleep(0)
        b = asyncio.create_task(task("b", 0.05))   # opens inside a's scope on the same thread
        return await asyncio.gather(a, b, return_exceptions=True)

    outcome = asyncio.run(main())
    assert isinstance(outcome[0], StateError) and outcome[1] is None, outcome
    host.malloc(2 * MiB)
    assert torch_budget.stats()["by_tag"]["untagged"]["allocated"] == 2 * MiB


@isolated
def test_a_region_ended_on_another_thread_ends_when_its_own_thread_next_uses_a_region():
    host = _installed_host()
    scope = torch_budget.region("a")
    scope.__enter__()
    failed = []

    def end_it():
        try:
            scope.__exit__(None, None, None)
        except StateError as e:
            failed.append(str(e))

    other = threading.Thread(target=end_it)
    other.start()
    other.join()
    assert failed and "did not open it" in failed[0]
    host.malloc(2 * MiB)             # still inside a on its own thread
    with torch_budget.region("b"):   # opening a region ends it first
        host.malloc(4 * MiB)
    host.malloc(8 * MiB)
    tags = torch_budget.stats()["by_tag"]
    assert (tags["a"]["allocated"], tags["b"]["allocated"], tags["untagged"]["allocated"]) == (2 * MiB, 4 * MiB,
                                                                                               8 * MiB)



@isolated
def test_a_region_ended_on_another_thread_inside_one_still_open_ends_before_it():
    # Ending the enclosing region was refused as out of order: the inner one, though ended, was still open,
    # and the thread stayed under its tag until the next region.
    host = _installed_host()
    outer, inner = torch_budget.region("outer"), torch_budget.region("a")
    outer.__enter__()
    inner.__enter__()
    failed = []
    other = threading.Thread(target=lambda: failed.append(pytest.raises(StateError, inner.__exit__, None, None, None)))
    other.start()
    other.join()
    assert failed, "the end on another thread was not refused"
    outer.__exit__(None, None, None)  # ends a, then outer
    host.malloc(2 * MiB)
    tags = torch_budget.stats()["by_tag"]
    assert (tags["a"]["allocated"], tags["outer"]["allocated"], tags["untagged"]["allocated"]) == (0, 0, 2 * MiB)

@isolated
def test_names_and_switches_of_the_wrong_kind_are_refused_by_name():
    _installed_host()
    for bad in ("a\x00b", "\udc80"):
        with pytest.raises(InvalidArgumentError, match="tag"):
            with torch_budget.region(bad):
                pass
    with pytest.raises((TypeError, ConfigError), match="route name"):
        with torch_budget.region(route=["vmm"]):
            pass
    with pytest.raises(TypeError, match="start_driver must be True or False"):
        torch_budget.install(start_driver="no")


@isolated
def test_a_refused_tag_budget_leaves_no_tag_behind():
    _installed_host()
    with pytest.raises(ConfigError):
        torch_budget.set_budget("zz", tag="kv2")
    with pytest.raises(InvalidArgumentError, match="device 7 does not exist"):
        torch_budget.set_budget("1GiB", tag="newtag", device=7)
    assert not {"kv2", "newtag"} & set(torch_budget.stats()["by_tag"])


@isolated
def test_a_budget_refused_on_one_device_of_all_changes_no_device():
    # Device 0 took the budget before device 1 refused it, and kept it.
    host = _installed_host(devices=2)
    _tagged(host, "kv", 8 * MiB, device=1)
    host.malloc(MiB, stream=host.stream(0), device=0)
    torch_budget.set_budget("1GiB", device=0)
    for kwargs in ({}, {"tag": "kv"}):
        with pytest.raises(InvalidArgumentError, match="device 1"):
            torch_budget.set_budget("4MiB", device="all", **kwargs)
    assert [torch_budget.stats(d)["budget"] for d in (0, 1)] == [GiB, None]
    assert [torch_budget.stats(d)["by_tag"].get("kv", {}).get("budget") for d in (0, 1)] == [None, None]
    torch_budget.set_budget("16MiB", device="all", tag="kv")   # what every device admits still lands
    assert [torch_budget.stats(d)["by_tag"]["kv"]["budget"] for d in (0, 1)] == [16 * MiB] * 2


@isolated
def test_empty_cache_knows_every_tag_it_is_given_before_it_empties_any():
    host = _installed_host()
    host.free(_tagged(host, "kv", 4 * MiB))
    host.complete(host.stream())
    with pytest.raises(InvalidArgumentError, match="unknown tag 'nope'"):
        torch_budget.empty_cache(tags=["kv", "nope"])
    assert torch_budget.stats()["by_tag"]["kv"]["resident"] == 4 * MiB   # kv was emptied before the refusal
    torch_budget.empty_cache(tags=["kv"])
    assert torch_budget.stats()["by_tag"]["kv"]["resident"] == 0


@isolated
def test_tag_of_and_pool_tag_refuse_what_is_not_a_tensor_or_a_pool_handle_by_name():
    # tag_of(5) raised AttributeError 'untyped_storage'; pool_tag("ab") int()'s ValueError, (1,) an
    # IndexError, and (2**64, 0) or (-1, 0) were wrapped by ctypes into another pool's id.
    _installed_host()
    for bad in (5, None, "kv"):
        with pytest.raises(TypeError, match="tag_of\\(\\) takes a tensor"):
            sleep.tag_of(bad)
    for bad in ("ab", (1, "x"), [0, 1]):
        with pytest.raises(TypeError, match="graph pool handle"):
            sleep.pool_tag(bad)
    for bad in ((1,), (0, 1, 2), (2**64, 0), (-1, 0)):
        with pytest.raises(InvalidArgumentError, match="graph pool handle"):
            sleep.pool_tag(bad)
    assert sleep.pool_tag((0, 12345)) is None   # a handle no capture used: none yet


@isolated
def test_emptying_the_cache_of_a_device_that_does_not_exist_is_refused():
    # A device nothing was allocated on has nothing cached; one that is not there is a mistake.
    host = _installed_host(devices=2)
    _tagged(host, "kv", 4 * MiB)
    torch_budget.empty_cache(1)              # the stand-in's second device: exists, holds nothing
    for call in (lambda: torch_budget.empty_cache(7), lambda: torch_budget.empty_cache(7, tags="kv")):
        with pytest.raises(InvalidArgumentError, match="device 7 does not exist"):
            call()


@isolated
def test_drop_backup_of_an_unknown_tag_and_a_file_as_backup_directory_are_refused(tmp_path):
    _installed_host()
    with pytest.raises(InvalidArgumentError, match="unknown tag 'nope'"):
        sleep.drop_backup("nope")
    afile = tmp_path / "a_file"
    afile.write_text("")
    with pytest.raises(InvalidArgumentError, match="is a file"):
        sleep.set_disk_backup_dir(afile)


@isolated
def test_a_stray_exit_of_a_region_raises_and_leaves_the_scopes_as_they_were():
    # contextlib ran the body of a region never entered (its scope opened and closed again) and
    # raised RuntimeError("generator didn't stop"); a second exit of a region said nothing.
    host = _installed_host()
    with pytest.raises(StateError, match="region\\('a'\\) was never entered"):
        torch_budget.region("a").__exit__(None, None, None)
    with torch_budget.region("b"):
        scope = torch_budget.region("a")
        with pytest.raises(StateError, match="region\\('a'\\) was never entered"):
            scope.__exit__(None, None, None)
        host.malloc(2 * MiB)         # still inside b
        with scope:
            host.malloc(4 * MiB)
            with pytest.raises(StateError, match="region\\('a'\\) is open already"):
                scope.__enter__()
            host.malloc(8 * MiB)     # still inside a
        with pytest.raises(StateError, match="region\\('a'\\) has ended already"):
            scope.__exit__(None, None, None)
        host.malloc(16 * MiB)        # back in b
    host.malloc(32 * MiB)
    tags = torch_budget.stats()["by_tag"]
    assert (tags["b"]["allocated"], tags["a"]["allocated"], tags["untagged"]["allocated"]) == (18 * MiB, 12 * MiB,
                                                                                               32 * MiB)


@isolated
def test_a_stray_exit_of_sleeping_raises_and_neither_releases_nor_restores():
    # contextlib ran the body of a sleeping() never entered: a release and a restore of every tag
    # it names, which with backup="none" lost their contents, then RuntimeError.
    host = _installed_host()
    p = _tagged(host, "w", 4 * MiB, fill=b"w")
    with pytest.raises(StateError, match="sleeping\\('w'\\) was never entered"):
        torch_budget.sleeping("w", backup="none").__exit__(None, None, None)
    assert host.peek(p, 4096) == b"w" * 4096, "the stray exit released the tag without a backup"
    assert sleep.tag_states()["w"]["state"] == "live" and sleep.tag_states()["w"]["backup"] is None
    scope = torch_budget.sleeping("w")
    with scope as report:
        assert sleep.tag_states()["w"]["state"] == "released"
    with pytest.raises(StateError, match="sleeping\\('w'\\) has ended already"):
        scope.__exit__(None, None, None)
    assert report["restore"]["tags"] == ["w"] and host.peek(p, 4096) == b"w" * 4096
    assert sleep.tag_states()["w"]["state"] == "live"


@isolated
def test_a_disk_backup_directory_is_any_path_and_one_that_cannot_be_made_is_named(tmp_path):
    # bytes were refused as "must be a non-empty path", a name with undecodable bytes raised
    # UnicodeEncodeError after the directory was made, and a path under a file raised a bare
    # NotADirectoryError.
    from torch_budget.errors import BackupFileError

    _installed_host()
    sleep.set_disk_backup_dir(bytes(tmp_path / "as-bytes"))
    assert sleep.disk_backup_dir() == str(tmp_path / "as-bytes") and (tmp_path / "as-bytes").is_dir()
    odd = str(tmp_path) + "/odd-\udcff"       # a name of bytes that are not UTF-8, as os.fsdecode gives it
    sleep.set_disk_backup_dir(odd)
    assert sleep.disk_backup_dir() == odd and os.path.isdir(odd)
    afile = tmp_path / "a_file"
    afile.write_text("")
    with pytest.raises(BackupFileError, match="cannot make the disk backup directory .*a_file/sub"):
        sleep.set_disk_backup_dir(afile / "sub")
    for bad in ("", b"", "a\x00b"):
        with pytest.raises(InvalidArgumentError, match="disk backup directory"):
            sleep.set_disk_backup_dir(bad)
    with pytest.raises(TypeError, match="disk backup directory"):
        sleep.set_disk_backup_dir(5)
    assert sleep.disk_backup_dir() == odd    # every refusal left the directory set before
