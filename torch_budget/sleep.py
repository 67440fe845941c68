"""Sleep and wake: release the device memory behind tags and restore it at the same addresses.

Memory allocated under a tag on the VMM route (`with torch_budget.region("weights"):`)
lives in that tag's own address ranges. `release(tags)` gives its physical memory back to
the driver while the ranges stay reserved, so every tensor, view and captured CUDA graph
that points into them stays valid; `restore(tags)` maps new memory at the same addresses
and, when a backup was asked for, copies the contents back. Graph pools captured under a
tag are released and restored with it.

Backups (`backup=`):
  "pinned"  contents copied to the pinned host pool (reserve_host_pool), the fast path; the default;
  "cpu"     contents copied to pageable host memory;
  "disk"    contents written to files in the directory set_disk_backup_dir() names, through one
            pinned staging buffer (for hosts whose memory cannot hold the backup);
  "memset"  zeros after restore;
  "none"    contents are undefined after restore (a KV cache about to be refilled).
The default keeps contents: losing them must be asked for.

Retained backups (`retain=True`, with "cpu" or "pinned"): the restore keeps the backup and
digests what it restored on the device (128 bits per 2 MiB, at memory speed); the next
release with the same backup and the same allocations copies only what changed since, and
drops the rest at once, so sleeping an unchanged model costs an unmap, not a copy over the
link. A live tag's retained backup shows in tag_states() ("retained", "backup_bytes");
drop_backup() gives it back, and so does empty_cache() once memory the backup describes has
gone back to the driver (its tensors freed): the backup no longer matches the tag. A released
tag's backup goes back the same way, granule by granule, as its tensors are freed while it
sleeps (a cpu or pinned backup's host memory; a disk backup's files stay until the restore, and
all of it stays while a copy=False view of the backup is alive); a backup with such holes is
not retained past the restore.

Discardable allocations (`release(..., discardable=[...])`, storage addresses or tensors of the
released tags): contents the caller writes again after the wake, as vLLM's discardable
allocations (weights it reloads). They are not copied; the restore maps them back at their
addresses with undefined contents. A 2 MiB granule holding a byte of another allocation keeps
its contents, and so does the rest of its mapping (a mapping goes back only whole). Such a
backup is not retained and not written to disk.

Reading a backup (`backup_of(tensor)`): while a tensor's tag is released with a cpu or pinned
backup, or a live tag retains one, the tensor's contents as the backup holds them, as a CPU
tensor: a copy, or (`copy=False`) a view of the backup's host memory itself, which keeps that
memory alive as long as the view lives, past the restore. What is written to a view while
the tag sleeps is what the restore puts back (Note [Reading backups], csrc/core/tag_sleep.h).

Arguments, as everywhere in the package: `tags=None` is every tag (untagged memory is
never released), `device=None` the current device and `device="all"` every device
torch_budget serves.

Rules: release waits for the device's queued work, then returns only once the memory is back
with the driver (`torch.cuda.mem_get_info` shows it). Releasing a released tag or restoring a
live one raises TagStateError before anything is done; allocating under a released tag
raises. A restore that fails half-way (out of memory, a driver failure) gives back what it
mapped, keeps the backup, leaves the tag released and raises; a later restore can succeed.
Tagged memory on the pool or sync routes cannot be released: the error names the route.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import TypedDict

from . import _native, _runtime, _scope
from ._runtime import Device, Tags
from ._validate import boolean, non_negative_int, pool_handle, tag_names
from .errors import BackupFileError, InvalidArgumentError, TagStateError

__all__ = ["BACKUPS", "RETAINABLE", "DEFAULT_BACKUP", "release", "restore", "sleeping", "drop_backup", "tag_states",
           "tag_of", "pool_tag", "backup_of", "set_disk_backup_dir", "disk_backup_dir", "released_tags", "any_released", "check_awake",
           "end_sharing",
           "reserve_host_pool", "free_host_pool", "keep_host_pool", "host_pool_stats", "SleepReport", "TagState",
           "HostPoolStats"]

BACKUPS = {"none": 0, "memset": 1, "cpu": 2, "pinned": 3, "disk": 4}  # csrc/core/tag_sleep.h
RETAINABLE = ("cpu", "pinned")  # backups that keep contents, which release(retain=True) can keep
KEEPS = ("cpu", "pinned", "disk")  # backups that keep contents
_RETAIN = 0x100  # or-ed into a cpu / pinned mode (kBackupRetain)
DEFAULT_BACKUP = "pinned"
STATES = ("live", "released", "restoring")
_LIVE, _RELEASED = 0, 1


class _Report(TypedDict):
    tags: list[str]  # the tags acted on
    devices: list[int]  # the devices acted on
    bytes: int  # device bytes given back to the driver (release) or mapped again (restore)
    backup_bytes: int  # host bytes the backups took (release) or were copied back from (restore)
    allocations: int  # live allocations of those tags on those devices: the tensors acted on
    seconds: float


class SleepReport(_Report, total=False):
    """What release() and restore() did; sleeping() adds the restore's report under "restore"."""
    restore: _Report


class TagState(TypedDict):
    state: str  # live | released | restoring
    resident: int  # device bytes mapped behind the tag, graph pools included
    released: int  # bytes waiting to be restored
    backup: str | None  # mode of the last release
    backup_bytes: int  # bytes its backup holds: host memory, or files for a disk backup
    retained: bool  # live, keeping its backup for the next release (release(retain=True))


class HostPoolStats(TypedDict):
    bytes: int  # pinned bytes held
    used: int  # bytes holding backups
    chunks: int  # pinned allocations
    pinned_at_release: int  # bytes pinned during a release because the pool was too small
    pin_seconds: float  # time spent pinning
    registered: int  # of bytes, pinned by registering memory torch_budget mapped (the fast way)
    keep: bool  # keep_host_pool's setting


# Tags released anywhere in this process (name -> backup): a cheap check for graph replays.
_released: dict[str, str] = {}


def _tag_id(lib, name: str) -> int:
    tag = _native.known_tag(lib, name)
    if tag == 0:
        raise InvalidArgumentError("untagged memory cannot be released; allocate it under a tag")
    return tag


def _info(lib, device, tag) -> tuple[int, ...]:
    """tb_tag_info: life, backup, resident, released, device and backup bytes of the last
    release / restore, backup bytes held."""
    out = (_native.ctypes.c_int64 * 8)()
    _native.check(lib, lib.tb_tag_info(device, tag, out))
    return tuple(out)


def _life(lib, device, tag) -> int:
    return _info(lib, device, tag)[0]


def _targets(lib, tags, device, life: int) -> list[tuple[int, int, str]]:
    """(device, tag id, name) to act on, each checked to be in state `life` before anything is
    done, so that nothing is released or restored twice.

    tags=None: every tag in that state on the devices. Named tags on one device: each must be
    in that state there (TagStateError otherwise). Named tags with device="all": each device
    where the tag is in that state; a tag in that state nowhere is a TagStateError."""
    devices = _runtime.device_indices(lib, device)
    names = tag_names(tags)
    if names is None:
        targets = []
        for dev in devices:
            for name in _native.read_json(lib, lib.tb_stats_json, dev)["tags"]:
                tag = lib.tb_tag_find(name.encode())
                if tag > 0 and _life(lib, dev, tag) == life:
                    targets.append((dev, tag, name))
        return targets
    ids = [(_tag_id(lib, name), name) for name in names]
    verb, want = ("release", "live") if life == _LIVE else ("restore", "released")
    if not _runtime.is_all(device):
        dev = devices[0]
        for tag, name in ids:
            now = _life(lib, dev, tag)
            if now != life:
                raise TagStateError(f"tag {name!r} is {STATES[now]} on device {dev}; {verb} needs it {want}")
        return [(dev, tag, name) for tag, name in ids]
    targets = []
    for tag, name in ids:
        here = [(dev, tag, name) for dev in devices if _life(lib, dev, tag) == life]
        if not here:
            raise TagStateError(f"tag {name!r} is {want} on no device torch_budget serves; {verb} needs it {want}")
        targets += here
    return sorted(targets)


def _backup_id(backup, retain: bool = False) -> int:
    if not isinstance(backup, str):
        raise TypeError(f"backup must be a str, got {type(backup).__name__}")
    if backup not in BACKUPS:
        raise InvalidArgumentError(f"unknown backup {backup!r}: expected one of {', '.join(BACKUPS)}")
    if not isinstance(retain, bool):
        raise TypeError(f"retain must be a bool, got {type(retain).__name__}")
    if retain and backup not in RETAINABLE:
        raise InvalidArgumentError(f"retain=True keeps a backup past the restore: it needs backup 'cpu' or 'pinned', "
                                   f"not {backup!r}")
    return BACKUPS[backup] | (_RETAIN if retain else 0)


def _moved(lib, device, tag) -> tuple[int, int]:
    """Device bytes and backup bytes the last release / restore of `tag` moved."""
    return _info(lib, device, tag)[4:6]


def _report(lib, targets, moved: int, backed: int, start: float) -> SleepReport:
    seconds = time.perf_counter() - start  # the release / restore, not the ledger read below
    devices = sorted({d for d, _, _ in targets})
    tags = {dev: _native.read_json(lib, lib.tb_stats_json, dev)["tags"] for dev in devices}
    allocations = sum(tags[dev][name]["allocations"]["current"] for dev, _, name in targets)
    return {"tags": sorted({name for _, _, name in targets}), "devices": devices, "bytes": moved,
            "backup_bytes": backed, "allocations": allocations, "seconds": seconds}


def _addresses(discardable, what: str = "discardable") -> list[int]:
    """The storage addresses `discardable` names: ints, or tensors (their storage's); `what` names
    the argument in errors."""
    if isinstance(discardable, (int, str, bytes)) or not isinstance(discardable, Iterable):
        raise TypeError(f"{what} must be a collection of storage addresses or tensors, got "
                        f"{type(discardable).__name__}")
    out = []
    for item in discardable:
        if isinstance(item, bool) or not isinstance(item, int):
            storage = getattr(item, "untyped_storage", None)
            if storage is None:
                raise TypeError(f"{what} holds {type(item).__name__} ({item!r}): expected storage addresses "
                                f"(int) or tensors")
            item = storage().data_ptr()
        if not 0 < item < 2**64:
            raise InvalidArgumentError(f"{what} holds {item}, which is no device address")
        out.append(item)
    return out


def end_sharing(tensors) -> None:
    """Says that no other process maps `tensors` any more (tensors, or their storage addresses):
    every consumer closed what it opened of them. A tensor once sent to another process (torch's
    CUDA IPC: torch.multiprocessing, or the handles of a weight sync) keeps its tag from being
    released for as long as it lives, since this process cannot see a consumer close it (Note
    [Sharing memory between processes], csrc/core/ipc.h). A producer that keeps the tensors
    (weights sent to a rollout engine) calls this once the consumers closed them, and may then
    release their tag. Said of a tensor a consumer still maps, a release and restore leave the
    consumer on the old memory: the two processes no longer see each other's writes."""
    lib = _runtime.require_installed("torch_budget.sleep.end_sharing()")
    for ptr in _addresses(tensors, "tensors"):
        _native.check(lib, lib.tb_end_sharing(_native.ctypes.c_void_p(ptr)))


def _discarding(lib, targets, addresses: list[int]) -> dict[tuple[int, int], list[int]]:
    """`addresses` by the (device, tag) of `targets` each is a live allocation of; one that is none
    of theirs raises InvalidArgumentError naming it."""
    out: dict[tuple[int, int], list[int]] = {(dev, tag): [] for dev, tag, _ in targets}
    for ptr in addresses:
        address = _native.ctypes.c_void_p(ptr)
        dev, tag = lib.tb_ptr_device(address), lib.tb_ptr_tag(address)
        if (dev, tag) not in out:
            names = sorted({name for _, _, name in targets})
            if dev < 0:
                what = "no live allocation of torch_budget's"
            else:
                name = "no tag" if tag == 0 else f"tag {_name_of(lib, dev, tag) or tag!r}"
                if any(t == tag for _, t, _ in targets):  # the tag is released here, but not on that device
                    devices = sorted({d for d, t, _ in targets if t == tag})
                    raise InvalidArgumentError(
                        f"discardable address {ptr:#x} is an allocation on device {dev} under {name}, which this "
                        f"call releases on device(s) {', '.join(map(str, devices))} only")
                what = f"an allocation on device {dev} under {name}"
            raise InvalidArgumentError(f"discardable address {ptr:#x} is {what}, not one of the tags released here "
                                       f"({', '.join(repr(n) for n in names)})")
        out[(dev, tag)].append(ptr)
    return out


def _release(lib, targets, backup: str, retain: bool = False, discardable=()) -> SleepReport:
    mode = _backup_id(backup, retain)
    addresses = _addresses(discardable)
    if addresses and (retain or backup == "disk"):
        raise InvalidArgumentError(f"discardable allocations leave holes in the backup, which a "
                                   f"{'retained' if retain else 'disk'} backup cannot have")
    discard = _discarding(lib, targets, addresses) if addresses else {}
    start = time.perf_counter()
    moved = backed = 0
    done: list[tuple[int, int, str]] = []
    try:
        for dev, tag, name in targets:
            mine = discard.get((dev, tag))
            if mine:
                ptrs = (_native.ctypes.c_uint64 * len(mine))(*mine)
                rc = lib.tb_release_tag_discarding(dev, tag, mode, ptrs, len(mine))
            else:
                rc = lib.tb_release_tag(dev, tag, mode)
            _native.check(lib, rc, state=TagStateError)
            done.append((dev, tag, name))
            b, k = _moved(lib, dev, tag)
            moved, backed = moved + b, backed + k
    except BaseException:
        for dev, tag, _ in reversed(done):
            with contextlib.suppress(Exception):
                lib.tb_restore_tag(dev, tag)
        # A release that failed halfway and could not map back what it had dropped leaves its tag
        # released (its error says so): restored here where it can be now; one that stays released
        # is recorded, so that check_awake() and the adapters see it.
        for dev, tag, name in targets:
            with contextlib.suppress(Exception):
                if _life(lib, dev, tag) != _LIVE:
                    lib.tb_restore_tag(dev, tag)
                if _life(lib, dev, tag) != _LIVE:
                    _released[name] = backup
        raise
    for _, _, name in targets:
        _released[name] = backup
    return _report(lib, targets, moved, backed, start)


def _restore(lib, targets, retain: bool | None = None, go_on: bool = False) -> SleepReport:
    """Restores `targets` in turn. A failure is raised at once, or with `go_on` once every other
    target was tried (the first failure). A tag is restored on all its devices or on none: where
    one refuses, the devices that took it back release it again, with the backup it had."""
    start = time.perf_counter()
    moved = backed = 0
    failed = None
    # (device, tag, name, the backup it had as released, bytes moved, bytes copied)
    restored: list[tuple[int, int, str, int, int, int]] = []
    undone: set[str] = set()  # tags one device refused: the others stay (or went back to) released
    try:
        # Tag by tag, each on all its devices before the next: a failure leaves every tag before it
        # restored everywhere and every tag from it released everywhere.
        for dev, tag, name in sorted(targets, key=lambda t: (t[1], t[0])):
            if name in undone:
                continue
            try:
                backup = _info(lib, dev, tag)[1]  # this device's own: another may hold the tag with another
                # Each tag's retention is set as it is restored: one that refuses it (a backup that cannot
                # be retained) raises with its retention unchanged, as are those of the tags after it.
                if retain is not None:
                    _native.check(lib, lib.tb_retain_tag_backup(dev, tag, int(retain)), state=TagStateError)
                _native.check(lib, lib.tb_restore_tag(dev, tag), state=TagStateError)
            except Exception as e:
                again = [r for r in restored if r[2] == name]
                _release_again(lib, [r[:4] for r in again])
                undone.add(name)
                moved -= sum(r[4] for r in again)  # the report counts what stays restored
                backed -= sum(r[5] for r in again)
                if not go_on:
                    raise
                failed = failed or e
                continue
            info = _info(lib, dev, tag)
            restored.append((dev, tag, name, backup | (_RETAIN if info[7] else 0), info[4], info[5]))
            moved, backed = moved + info[4], backed + info[5]
    finally:
        # Also when one raised: the tags restored before it are live, and listed so no longer.
        served = _runtime.served_devices(lib)
        for _, tag, name in targets:
            if all(_life(lib, dev, tag) == _LIVE for dev in served):
                _released.pop(name, None)
    if failed is not None:
        raise failed
    return _report(lib, targets, moved, backed, start)


def _release_again(lib, done) -> None:
    """Releases again the devices of a tag that took it back before another device refused it
    (_restore), each with the backup it had there (its retention included: a retained backup is
    reused, not copied again); one that refuses leaves the tag live there, and listed released
    while some device holds it released."""
    for dev, tag, _, mode in reversed(done):
        with contextlib.suppress(Exception):
            _native.check(lib, lib.tb_release_tag(dev, tag, mode), state=TagStateError)


def release(tags: Tags = None, backup: str = DEFAULT_BACKUP, device: Device = None, *,
            retain: bool = False, discardable: Iterable = ()) -> SleepReport:
    """Releases the device memory of `tags` (a name or names; None: every live tag) on
    `device` (None: the current device; "all": every device where the tag is live), backing
    the contents up as `backup` says (default "pinned": contents kept); `retain=True` keeps
    the backup past the restore so the next release copies only what changed (see the
    module's notes). Returns {"tags", "devices", "bytes" (returned to the driver),
    "backup_bytes" (bytes this release copied), "allocations" (the live allocations of those
    tags on those devices: how many tensors it acted on), "seconds"}.

    `discardable`: live allocations of those tags (storage addresses, or tensors) whose contents
    the caller writes again after the restore, as vLLM's discardable allocations: they are not
    copied, and the restore maps them back at their addresses with undefined contents. A backup
    with such holes is not retained, not written to disk, and cannot be read where it has none.

    All or nothing: a tag in the wrong state raises TagStateError before anything is
    released; when a release fails, the ones this call did before it are restored and the
    error raised.
    """
    lib = _runtime.require_installed("torch_budget.release()")
    _backup_id(backup, retain)
    return _release(lib, _targets(lib, tags, device, _LIVE), backup, retain, discardable)


def restore(tags: Tags = None, device: Device = None, *, retain: bool | None = None) -> SleepReport:
    """Maps memory back behind `tags` (a name or names; None: every released tag) at the
    addresses they had, on `device` (None: the current device; "all": every device where the
    tag is released), and copies their backups in. `retain` (None: as the release asked) says
    whether a cpu or pinned backup is kept for the next release. Returns the same keys as
    release().

    A tag that is not released raises TagStateError before anything is restored. Raises (tag
    left released, backup kept) when the memory cannot be had, or when `retain` asks to keep a
    backup that cannot be kept; the tags restored before the failure stay restored, with the
    retention asked. A tag whose memory could not be had keeps the retention asked for its next
    restore; one that refused it, and those after it, keep theirs.
    """
    lib = _runtime.require_installed("torch_budget.restore()")
    if retain is not None and not isinstance(retain, bool):
        raise TypeError(f"retain must be a bool or None, got {type(retain).__name__}")
    return _restore(lib, _targets(lib, tags, device, _RELEASED), retain)


@_scope.once(lambda tags=None, *_, **__: "sleeping()" if tags is None else f"sleeping({tags!r})")
def sleeping(tags: Tags = None, backup: str = DEFAULT_BACKUP, device: Device = None, *,
             retain: bool = False, discardable: Iterable = ()) -> Iterator[SleepReport]:
    """`with torch_budget.sleeping("weights"):` releases on entry (as release(), same
    arguments and defaults) and restores exactly what it released on exit, also when the
    body raises. Yields the release report; the restore report is added under "restore".
    A tag the body restored itself is left as it is; a tag that cannot be restored keeps
    none of the others asleep: each is tried, then the first failure is raised."""
    lib = _runtime.require_installed("torch_budget.sleeping()")
    _backup_id(backup, retain)
    targets = _targets(lib, tags, device, _LIVE)
    report = _release(lib, targets, backup, retain, discardable)
    try:
        yield report
    finally:
        asleep = [t for t in targets if _life(lib, t[0], t[1]) != _LIVE]
        report["restore"] = _restore(lib, asleep, go_on=True)


def drop_backup(tags: Tags = None, device: Device = None) -> int:
    """Gives back the backups that live `tags` (None: every tag) retained on `device` (None:
    the current device; "all": every device) for their next release (release(retain=True));
    that release then copies everything. Returns the host bytes the tags let go of (a view from
    backup_of(copy=False) keeps its backup's memory until the view goes). A released tag raises
    TagStateError: its backup holds its contents."""
    lib = _runtime.require_installed("torch_budget.sleep.drop_backup()")
    devices = _runtime.served_devices(lib) if _runtime.is_all(device) else [_runtime.device_index(device)]
    names = tag_names(tags)
    if names is not None:
        for name in names:
            _tag_id(lib, name)  # an unknown tag raises, as release() does
    freed = 0
    for dev in devices:
        for name, state in tag_states(dev).items():
            if names is not None and name not in names:
                continue
            if state["state"] != "live":
                if names is not None:
                    raise TagStateError(f"tag {name!r} is {state['state']} on device {dev}: its backup holds its "
                                        f"contents until the restore")
                continue
            if state["retained"]:
                _native.check(lib, lib.tb_drop_tag_backup(dev, _tag_id(lib, name)), state=TagStateError)
                freed += state["backup_bytes"]
    return freed


def tag_states(device: Device = None) -> dict[str, TagState]:
    """Every tag on `device` (None: the current device) -> {"state": live | released |
    restoring, "resident" (device bytes mapped behind it, graph pools included), "released"
    (bytes waiting to be restored), "backup" (mode of the last release or None),
    "backup_bytes" (bytes its backup holds: host memory, or files for a disk backup),
    "retained" (live, keeping its backup for the next release)}. The same entries are in
    torch_budget.stats()["by_tag"]."""
    lib = _runtime.require_installed("torch_budget.sleep.tag_states()")
    raw = _native.read_json(lib, lib.tb_stats_json, _runtime.device_index(device))
    return {name: {"state": t["state"], "resident": t["resident"], "released": t["released"],
                   "backup": t["backup"], "backup_bytes": t["backup_bytes"], "retained": bool(t["retained"])}
            for name, t in raw["tags"].items()}


def check_awake(device: Device, pool: tuple[int, int] | None = None, tensors: Iterable = ()) -> None:
    """Raises TagStateError naming the tag when graph pool `pool` (a (id0, id1) pair) or the
    memory of `tensors` on `device` belongs to a released tag: a replay there would touch
    unmapped memory. Graph runners call it before a replay while any tag is released
    (any_released); it returns at once while none is."""
    if not _released:
        return
    lib = _runtime.require_installed("torch_budget.sleep.check_awake()")
    dev = _runtime.device_index(device)
    tags = set()
    if pool is not None:
        tags.add((lib.tb_pool_tag(dev, *pool_handle(pool)), "its graph pool"))
    for t in tensors:
        tags.add((_ptr_tag(lib, t), "a static buffer"))
    for tag, what in sorted(tags, key=lambda x: x[0]):
        life = _life(lib, dev, tag) if tag > 0 else _LIVE
        if life == _LIVE:
            continue
        name = _name_of(lib, dev, tag) or str(tag)
        raise TagStateError(
            f"{what} belongs to tag {name!r}, which is {STATES[life]} on device {dev}: "
            f"torch_budget.restore({name!r}) before replaying")


def _ptr_tag(lib, tensor) -> int:
    """The tag id of the block under `tensor`'s storage (0 untagged, -1 not torch_budget's)."""
    return lib.tb_ptr_tag(_native.ctypes.c_void_p(tensor.untyped_storage().data_ptr()))


def _name_of(lib, device: int, tag: int) -> str | None:
    return next((n for n in tag_states(device) if lib.tb_tag_find(n.encode()) == tag), None)


def tag_of(tensor) -> str | None:
    """The tag `tensor`'s memory was allocated under; None when untagged or not torch_budget's."""
    if not callable(getattr(tensor, "untyped_storage", None)):
        raise TypeError(f"tag_of() takes a tensor, got {type(tensor).__name__} ({tensor!r})")
    lib = _runtime.require_installed("torch_budget.sleep.tag_of()")
    tag = _ptr_tag(lib, tensor)
    return _name_of(lib, tensor.device.index, tag) if tag > 0 else None


def pool_tag(pool: tuple[int, int], device: Device = None) -> str | None:
    """The tag graph pool `pool` (a (id0, id1) pair: torch.cuda.graph_pool_handle(), CUDAGraph.pool())
    on `device` (None: the current device) is released and restored with: the tag in force when
    its first capture created it ("untagged" outside every region); None while torch_budget has
    no such pool (a handle no capture used yet)."""
    lib = _runtime.require_installed("torch_budget.sleep.pool_tag()")
    ids = pool_handle(pool)
    dev = _runtime.device_index(device)
    tag = lib.tb_pool_tag(dev, *ids)
    return None if tag < 0 else _name_of(lib, dev, tag) or str(tag)


def set_disk_backup_dir(path) -> None:
    """The directory release(backup="disk") writes to, one file per piece (about 64 MiB; a piece
    ends where a mapping ends, so with the default map_run one can reach 320 MiB), deleted by the restore (Note [Disk backups],
    csrc/core/disk_backup.h); created if missing. A path is a str, bytes or os.PathLike, as os
    takes it; None forgets it. A directory that cannot be made raises BackupFileError naming it,
    as a failed write or read does naming the file."""
    import os

    global _disk_dir
    lib = _runtime.require_installed("torch_budget.sleep.set_disk_backup_dir()")
    if path is None:
        _native.check(lib, lib.tb_set_disk_backup_dir(None))
        _disk_dir = None
        return
    try:
        path = os.fsdecode(path)
    except TypeError:
        raise TypeError(f"a disk backup directory is a path (str, bytes or os.PathLike) or None, "
                        f"got {type(path).__name__}") from None
    if not path or "\0" in path:
        raise InvalidArgumentError(f"a disk backup directory must be a non-empty path without NUL bytes, got {path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidArgumentError(f"a disk backup directory must be a directory; {path!r} is a file")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BackupFileError(e.errno, f"cannot make the disk backup directory {path!r}: {e.strerror}") from None
    _native.check(lib, lib.tb_set_disk_backup_dir(os.fsencode(os.path.abspath(path))))
    _disk_dir = os.path.abspath(path)


_disk_dir: str | None = None  # what set_disk_backup_dir named last


def disk_backup_dir() -> str | None:
    """The directory release(backup="disk") writes to (set_disk_backup_dir); None while none is set."""
    return _disk_dir


class _BackupView:
    """Keeps a zero-copy view's backup memory alive (tb_backup_view) until it is collected."""

    def __init__(self, lib, handle):
        self._lib, self._handle = lib, handle

    def __del__(self):
        self._lib.tb_backup_view_end(self._handle)


def backup_of(tensor, *, copy: bool = True):
    """The contents of a contiguous CUDA `tensor` as its backup holds them: a CPU tensor of the
    same dtype and shape while the tensor's tag is released with a cpu or pinned backup, or
    while a live tag retains its backup; None while there is no backup with contents in host
    memory (a live tag without a retained backup, a tensor allocated after the restore that
    retained it, a release with backup "none", "memset" or "disk", untagged memory).

    copy=False returns a view of the backup's host memory instead (zero copy, pinned for a
    pinned backup): it keeps that memory alive while it lives, also after the restore drops the
    backup; written while the tag sleeps, it is what the restore puts back; and a retained
    backup with a view taken copies everything at its next release. A backup that holds the
    tensor's bytes in separate pieces of host memory has no view (InvalidArgumentError: read a
    copy)."""
    import torch

    lib = _runtime.require_installed("torch_budget.sleep.backup_of()")
    copy = boolean(copy, "backup_of's copy")  # a view where a copy was meant would be written through
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"backup_of takes a tensor, got {type(tensor).__name__}")
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise InvalidArgumentError(f"backup_of takes a contiguous CUDA tensor, got {tensor.device} tensor "
                                   f"with shape {tuple(tensor.shape)} and stride {tensor.stride()}")
    base = tensor.untyped_storage().data_ptr()
    offset, nbytes = tensor.data_ptr() - base, tensor.nbytes
    c = _native.ctypes
    if copy:
        out = torch.empty(tensor.shape, dtype=tensor.dtype)
        found = c.c_int(0)
        _native.check(lib, lib.tb_backup_read(c.c_void_p(base), offset, nbytes, c.c_void_p(out.data_ptr()),
                                              c.byref(found)), state=TagStateError)
        return out if found.value else None
    host, handle = c.c_void_p(), c.c_void_p()
    rc = lib.tb_backup_view(c.c_void_p(base), offset, nbytes, c.byref(host), c.byref(handle))
    if rc == _native.NOT_AVAILABLE:
        raise InvalidArgumentError(_native.error(lib, rc).args[0])
    _native.check(lib, rc, state=TagStateError)
    if not handle.value:
        return None
    keep = _BackupView(lib, handle.value)
    if nbytes == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)  # nothing to view; the handle ends here
    buf = (c.c_uint8 * nbytes).from_address(host.value)
    buf.keep = keep  # the view's storage holds buf, buf holds the handle
    return torch.frombuffer(buf, dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)


def released_tags() -> dict[str, str]:
    """Tags released anywhere in this process -> their backup mode (no driver call)."""
    return dict(_released)


def any_released() -> bool:
    """Whether any tag is released anywhere in this process (no driver call; for hot paths)."""
    return bool(_released)


def reserve_host_pool(nbytes: int) -> int:
    """Pins host memory now so that pinned backups never pin at release time; grows the
    pool to at least `nbytes` (it never shrinks here). Returns the pool's size in bytes.
    install(host_pool=...) does the same at install."""
    nbytes = non_negative_int(nbytes, "nbytes")
    lib = _runtime.library()
    _native.check(lib, lib.tb_host_pool_reserve(nbytes))
    return host_pool_stats()["bytes"]


def free_host_pool() -> int:
    """Unpins every part of the pinned host pool that holds no backup. Returns the bytes
    still pinned (held by released tags)."""
    lib = _runtime.library()
    _native.check(lib, lib.tb_host_pool_free())
    return host_pool_stats()["bytes"]


def keep_host_pool(keep: bool) -> bool:
    """Whether the pinned host pool keeps the memory a release pinned once its backups are gone
    (True, the default: the next release copies into it without pinning again, which is slower
    than the copy) or unpins it as the last backup in it goes back (False: at the restore that
    does not retain the backup, at drop_retained, and when the memory the backup held is freed
    and the cache emptied). What reserve_host_pool or install(host_pool=...) pinned stays either
    way. Returns the previous setting."""
    if not isinstance(keep, bool):
        raise TypeError(f"keep must be a bool, got {type(keep).__name__} ({keep!r})")
    lib = _runtime.library()
    was = _native.ctypes.c_int(0)
    _native.check(lib, lib.tb_host_pool_set_keep(int(keep), _native.ctypes.byref(was)))
    return bool(was.value)


def host_pool_stats() -> HostPoolStats:
    """{"bytes": pinned bytes held, "used": bytes holding backups, "chunks": pinned
    allocations, "pinned_at_release": bytes that had to be pinned during a release because
    the pool was too small, "pin_seconds": time spent pinning, "registered": of bytes, those
    pinned by registering memory torch_budget mapped, the fast way; the rest came from
    cuMemHostAlloc, where registering was refused, "keep": keep_host_pool's setting}."""
    lib = _runtime.library()
    out = (_native.ctypes.c_int64 * 8)()
    _native.check(lib, lib.tb_host_pool_stats(out))
    return {"bytes": int(out[0]), "used": int(out[1]), "chunks": int(out[2]), "pinned_at_release": int(out[3]),
            "pin_seconds": out[4] / 1e9, "registered": int(out[5]), "keep": bool(out[6])}
