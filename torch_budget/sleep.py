"""Sleep and wake: release the device memory behind tags and restore it at the same addresses.

Memory allocated under a tag on the VMM route (`with torch_budget.route(tag="weights"):`)
lives in that tag's own address ranges. `release(tags)` gives its physical memory back to
the driver while the ranges stay reserved, so every tensor, view and captured CUDA graph
that points into them stays valid; `restore(tags)` maps new memory at the same addresses
and, when a backup was asked for, copies the contents back. Graph pools captured under a
tag are released and restored with it.

Backups (`backup=`):
  "none"    contents are undefined after restore (a KV cache about to be refilled);
  "memset"  zeros after restore;
  "cpu"     contents copied to pageable host memory;
  "pinned"  contents copied to the pinned host pool (reserve_host_pool), the fast path.

Rules: release waits for the device's queued work, then returns only once the memory is back
with the driver (`torch.cuda.mem_get_info` shows it). Allocating under a released tag, releasing
a released tag or restoring a live one raises. A restore that fails half-way (out of memory,
a driver failure) gives back what it mapped, keeps the backup, leaves the tag released and
raises; a later restore can succeed. Tagged memory on the pool or sync routes cannot be
released: the error names the route.
"""
from __future__ import annotations

import contextlib
import time

from . import _native, allocator
from ._validate import non_negative_int

__all__ = ["BACKUPS", "release", "restore", "sleeping", "tag_states", "released_tags", "reserve_host_pool",
           "free_host_pool", "host_pool_stats"]

BACKUPS = {"none": 0, "memset": 1, "cpu": 2, "pinned": 3}  # csrc/core/tag_sleep.h
STATES = ("live", "released", "restoring")

# Tags released anywhere in this process (name -> backup): a cheap check for graph replays.
_released: dict[str, str] = {}


def _tag_names(tags) -> list[str]:
    if isinstance(tags, str):
        tags = [tags]
    try:
        names = list(tags)
    except TypeError:
        raise TypeError(f"tags must be a tag name or an iterable of names, got {type(tags).__name__}") from None
    if not names:
        raise ValueError("tags must name at least one tag")
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"a tag must be a non-empty str, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"tags repeat a name: {names!r}")
    return names


def _tag_ids(lib, names) -> list[int]:
    ids = []
    for name in names:
        tag = lib.tb_tag_find(name.encode())
        if tag < 0:
            raise ValueError(f"unknown tag {name!r}: no memory was ever allocated or scoped under it")
        if tag == 0:
            raise ValueError("untagged memory cannot be released; allocate it under a tag")
        ids.append(tag)
    return ids


def _ready_devices(lib) -> list[int]:
    """The devices torch_budget serves allocations on."""
    return [d for d in range(max(lib.tb_device_count(), 0)) if lib.tb_device_ready(d)]


def _info(lib, device, tag) -> tuple[int, ...]:
    """tb_tag_info: life, backup, resident, released, device and backup bytes of the last
    release / restore, backup bytes held."""
    out = (_native.ctypes.c_int64 * 8)()
    _native.check(lib, lib.tb_tag_info(device, tag, out))
    return tuple(out)


def _life(lib, device, tag) -> int:
    return _info(lib, device, tag)[0]


def _targets(lib, device, ids, names, life) -> list[tuple[int, int]]:
    """(device, tag) pairs to act on. An explicit device: every tag there (the core refuses a
    tag in the wrong state). None: each device where the tag is in state `life`; a tag in
    that state nowhere is an error, so nothing is released or restored twice."""
    if device is not None:
        dev = allocator._device_index(device)
        return [(dev, tag) for tag in ids]
    devices = _ready_devices(lib)
    pairs = []
    for tag, name in zip(ids, names):
        here = [(dev, tag) for dev in devices if _life(lib, dev, tag) == life]
        if not here:
            wrong = "live on every device" if life == 1 else "already released (or restoring) on every device"
            raise _native.TorchBudgetError(f"tag {name!r} is {wrong} that torch_budget serves")
        pairs += here
    return sorted(pairs)


def _backup_id(backup) -> int:
    if not isinstance(backup, str):
        raise TypeError(f"backup must be a str, got {type(backup).__name__}")
    if backup not in BACKUPS:
        raise ValueError(f"unknown backup {backup!r}: expected one of {', '.join(BACKUPS)}")
    return BACKUPS[backup]


def _moved(lib, device, tag) -> tuple[int, int]:
    """Device bytes and backup bytes the last release / restore of `tag` moved."""
    return _info(lib, device, tag)[4:6]


def release(tags, backup: str = "none", device=None) -> dict:
    """Releases the device memory of `tags` (a name or names) on `device` (None: every
    device torch_budget serves where the tag is live). Returns {"tags", "devices", "bytes"
    (returned to the driver), "backup_bytes", "seconds"}. All or nothing: when one tag cannot
    be released, the ones this call released before it are restored and the error raised.
    """
    lib = allocator._require_installed("torch_budget.release()")
    names = _tag_names(tags)
    mode = _backup_id(backup)
    ids = _tag_ids(lib, names)
    pairs = _targets(lib, device, ids, names, life=0)
    start = time.perf_counter()
    moved = backed = 0
    done: list[tuple[int, int]] = []
    try:
        for dev, tag in pairs:
            _native.check(lib, lib.tb_release_tag(dev, tag, mode))
            done.append((dev, tag))
            b, k = _moved(lib, dev, tag)
            moved, backed = moved + b, backed + k
    except BaseException:
        for dev, tag in reversed(done):
            with contextlib.suppress(Exception):
                lib.tb_restore_tag(dev, tag)
        raise
    for name in names:
        _released[name] = backup
    return {"tags": names, "devices": sorted({d for d, _ in pairs}), "bytes": moved, "backup_bytes": backed,
            "seconds": time.perf_counter() - start}


def restore(tags, device=None) -> dict:
    """Maps memory back behind `tags` at the addresses they had (on `device`; None: every
    device where the tag is released) and copies their backups in. Returns the same keys as
    release(). Raises (tag left released, backup kept) when the memory cannot be had; the
    tags restored before the failure stay restored."""
    lib = allocator._require_installed("torch_budget.restore()")
    names = _tag_names(tags)
    ids = _tag_ids(lib, names)
    pairs = _targets(lib, device, ids, names, life=1)
    start = time.perf_counter()
    moved = backed = 0
    for dev, tag in pairs:
        _native.check(lib, lib.tb_restore_tag(dev, tag))
        b, k = _moved(lib, dev, tag)
        moved, backed = moved + b, backed + k
    for tag, name in zip(ids, names):
        if all(_life(lib, dev, tag) == 0 for dev in _ready_devices(lib)):
            _released.pop(name, None)
    return {"tags": names, "devices": sorted({d for d, _ in pairs}), "bytes": moved, "backup_bytes": backed,
            "seconds": time.perf_counter() - start}


@contextlib.contextmanager
def sleeping(tags, backup: str = "pinned", device=None):
    """`with torch_budget.sleeping("weights"):` releases on entry and restores on exit (also
    when the body raises). Yields the release report; the restore report is added under
    "restore" on exit."""
    report = release(tags, backup=backup, device=device)
    try:
        yield report
    finally:
        report["restore"] = restore(tags, device=device)


def tag_states(device=None) -> dict:
    """Every tag on `device` -> {"state": live | released | restoring, "resident" (device
    bytes mapped behind it, graph pools included), "released" (bytes waiting to be
    restored), "backup" (mode of the last release or None), "backup_bytes" (host bytes
    held)}."""
    lib = allocator._require_installed("torch_budget.tag_states()")
    raw = _native.read_json(lib, lib.tb_stats_json, allocator._device_index(device))
    return {name: {"state": t["state"], "resident": t["resident"], "released": t["released"],
                   "backup": t["backup"], "backup_bytes": t["backup_bytes"]}
            for name, t in raw["tags"].items()}


def check_awake(device, pool=None, tensors=()) -> None:
    """Raises TorchBudgetError naming the tag when graph pool `pool` (a (id0, id1) pair) or
    the memory of `tensors` on `device` belongs to a released tag: a replay there would
    touch unmapped memory. Graph runners call it while any tag is released."""
    lib = allocator._require_installed("torch_budget.sleep.check_awake()")
    dev = allocator._device_index(device)
    tags = set()
    if pool is not None:
        tags.add((lib.tb_pool_tag(dev, int(pool[0]), int(pool[1])), "its graph pool"))
    for t in tensors:
        tags.add((lib.tb_ptr_tag(_native.ctypes.c_void_p(t.untyped_storage().data_ptr())), "a static buffer"))
    for tag, what in sorted(tags, key=lambda x: x[0]):
        life = _life(lib, dev, tag) if tag > 0 else 0
        if life == 0:
            continue
        name = next((n for n in tag_states(dev) if lib.tb_tag_find(n.encode()) == tag), str(tag))
        raise _native.TorchBudgetError(
            f"{what} belongs to tag {name!r}, which is {STATES[life]} on device {dev}: "
            f"torch_budget.restore({name!r}) before replaying")


def released_tags() -> dict:
    """Tags released anywhere in this process -> their backup mode (no driver call)."""
    return dict(_released)


def reserve_host_pool(nbytes) -> int:
    """Pins host memory now so that pinned backups never pin at release time; grows the
    pool to at least `nbytes` (it never shrinks here). Returns the pool's size in bytes."""
    nbytes = non_negative_int(nbytes, "nbytes")
    lib = _native.load()
    _native.check(lib, lib.tb_host_pool_reserve(nbytes))
    return host_pool_stats()["bytes"]


def free_host_pool() -> int:
    """Unpins every part of the pinned host pool that holds no backup. Returns the bytes
    still pinned (held by released tags)."""
    lib = _native.load()
    _native.check(lib, lib.tb_host_pool_free())
    return host_pool_stats()["bytes"]


def host_pool_stats() -> dict:
    """{"bytes": pinned bytes held, "used": bytes holding backups, "chunks": pinned
    allocations, "pinned_at_release": bytes that had to be pinned during a release because
    the pool was too small, "pin_seconds": time spent pinning}."""
    lib = _native.load()
    out = (_native.ctypes.c_int64 * 8)()
    _native.check(lib, lib.tb_host_pool_stats(out))
    return {"bytes": int(out[0]), "used": int(out[1]), "chunks": int(out[2]), "pinned_at_release": int(out[3]),
            "pin_seconds": out[4] / 1e9}
