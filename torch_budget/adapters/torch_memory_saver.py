"""torch_memory_saver's interface over torch_budget: change the import, keep the code.

    from torch_budget.adapters.torch_memory_saver import torch_memory_saver
    # or, for code that imports the package: import torch_budget.adapters.torch_memory_saver as torch_memory_saver

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        w = torch.randn(4096, 4096, device="cuda")
    torch_memory_saver.pause("weights")     # device memory back to the driver, contents kept
    torch_memory_saver.resume("weights")    # same addresses, same contents

The mapping (torch_memory_saver name -> what torch_budget does):
  region(tag, enable_cpu_backup, cpu_backup_backend)  torch_budget.region(<tag>, route="vmm");
                         tag "untagged" is torch_budget's "tms_untagged" (torch_budget's own
                         "untagged" memory is never paused)
  pause(tag=None)        torch_budget.release(<tag's tags>, backup=..., device="all"); None or "":
                         every tag a region or cuda_graph of this process used
  resume(tag=None)       torch_budget.restore(<tag's tags>, device="all"); then each tag's cache
                         grows back to the size it had at pause (mapped, nothing copied in), as
                         torch_memory_saver maps back every segment torch's allocator held, used
                         or not: the memory in use after resume is what it was before pause
  cuda_graph(...)        torch.cuda.graph(...) captured inside region(tag): the graph's private
                         pool is tagged, so pause(tag) releases it. A pool takes the tag its
                         first capture ran under: capturing into one of another tag (or
                         untagged) raises InvalidArgumentError, as pause(tag) would miss it
  disable()              the allocations inside are untagged (never paused); the cache is
                         emptied on exit, also when the body raises, as torch_memory_saver
                         drops its pool
  enable_cpu_backup      backup "pinned" at pause (cpu_backup_backend="mmap": "cpu", pageable
                         host memory; no cpu_backup_backend: the enclosing region's, outside
                         one TMS_INIT_CPU_BACKUP_BACKEND's); without it "none": contents are
                         undefined after resume
  retain_cpu_backup      True: a resume keeps the cpu / pinned backups (torch_budget.restore(...,
                         retain=True)), and the next pause copies only what changed since
                         (Note [Retained backups]): an unchanged model pauses without a copy.
                         Read at pause and at resume, as torch_memory_saver reads it at resume;
                         one flag for the process, every instance's; TMS_RETAIN_CPU_BACKUP=1 sets
                         it at start. False: the resume gives the pinned backups' host memory
                         back, as torch_memory_saver frees them: the adapter turns the pinned
                         pool's keeping off (sleep.keep_host_pool(False)) unless install()
                         reserved a host_pool; a backup whose memory was freed goes at the next
                         empty_cache (Note [Stale backups])
  enabled                True
  hook_mode              "preload" or "torch", before first use; both mean torch_budget serves
                         every allocation (cuda_graph works in either)
  configure_subprocess() a context with nothing to set: a child that imports this module installs
                         torch_budget at import, as torch_memory_saver's LD_PRELOAD hooked it

region(), cuda_graph() and disable() (and _impl._with_region_config) are entered once and ended once.
torch_memory_saver's are contextlib generator scopes, which refuse a second entry too; an end without an
entry, which contextlib answers by running the body (a disable() emptied the cache, a cuda_graph() captured)
and raising RuntimeError, and a second end, which it lets pass, raise StateError (a RuntimeError) here and
change nothing. An end out of order (a region ended while one opened inside it is open, as asyncio tasks
interleaving regions on one thread do), where torch_memory_saver fails an assert, raises torch_budget.region()'s
StateError: the getters then say the inner region's, and the refused one ends with it (Note [Saver scopes]).

What torch_budget cannot do raises UnsupportedError (a TorchBudgetError and a
NotImplementedError) instead of running differently: memory_margin_bytes above 0 and its private
_impl (None until the first use, as there), but for what its own tests and slime read: the
tms_get_* configuration getters of its C library (_impl._binary_wrapper.cdll, answered from the
regions in force) and the CUDA runtime functions it links (cudaHostGetFlags, ...);
tms_set_interesting_region, which slime calls around DeepEP's buffers: False leaves this
thread's allocations untagged, True makes them the saver's again (Note [Interesting region]);
_impl._with_region_config (a region without its pool) and _impl._mem_pools (each region key's
_RegionPool, naming the tag that serves it: dropping one frees nothing by itself).
enable_disk_backup is torch_budget's backup "disk" (one file per piece of at most 64 MiB in
the directory set_disk_backup_dir or TMS_DISK_BACKUP_DIR names; TMS_DISK_BACKUP_CHUNK_MB is not
read). get_cpu_backup reads
torch_budget's backups (torch_budget.sleep.backup_of); a zero_copy view keeps the backup's host
memory alive while it lives, so it never dangles after a resume. TMS_INIT_ENABLE=1 puts every
allocation outside a region, on every thread, under tag "default" (torch_budget's default
tag; TMS_INIT_ENABLE_CPU_BACKUP=1 backs it up to host memory, TMS_INIT_ENABLE_DISK_BACKUP=1 to
disk, both together are refused), from the import on.

Importing this module installs torch_budget (torch_budget.install(), settings from
TORCH_BUDGET_CONF) when a CUDA device is there and CUDA is not yet initialised: torch's
allocator can only be replaced before CUDA starts. The first use installs it otherwise, and
raises InstallError, saying so, when CUDA already started on torch's own allocator.
"""
from __future__ import annotations

import contextlib
import os
import threading
import types
from collections.abc import Iterator
from typing import Literal, NamedTuple, Optional

import torch_budget
from torch_budget import _runtime, _scope, allocator, sleep
from torch_budget._validate import non_negative_int, tag_name
from torch_budget.adapters._common import TagRegistry, allocated_anywhere, ensure_installed, install_at_import
from torch_budget.errors import InvalidArgumentError, StateError, TagStateError, TorchBudgetError, UnsupportedError

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "UnsupportedError"]

HookMode = Literal["preload", "torch"]
CpuBackupBackend = Literal["mmap", "pinned"]

_TAG_DEFAULT = "default"
_BACKENDS = {"pinned": "pinned", "mmap": "cpu"}  # torch_memory_saver's host shadow -> torch_budget's backup
_UNTAGGED = "untagged"  # the name of tag 0 in torch_budget's ledger: a region under it is untagged
_TMS_UNTAGGED = "tms_untagged"  # torch_budget's name for torch_memory_saver's tag "untagged"


def _env_flag(name: str) -> bool:
    """torch_memory_saver's reading of a boolean variable (unset: False)."""
    value = os.environ.get(name)
    if value is None or value in ("", "0", "false", "FALSE", "no", "NO"):
        return False
    if value in ("1", "true", "TRUE", "yes", "YES"):
        return True
    raise InvalidArgumentError(f"{name}={value!r}: expected 1/true/yes or 0/false/no")


# Note [torch_memory_saver tags]
# torch_memory_saver decides the backup per allocation (the region's enable_cpu_backup), and one
# pause of a tag backs up some allocations and drops others. A torch_budget release takes one
# backup per tag, so each (tag, backup) pair is a torch_budget tag of its own: "kv_cache" (no
# backup), "weights+pinned", "weights+cpu" (mmap). pause(tag) releases all of tag's, each with
# its backup; the registry (adapters._common.TagRegistry) is what pause(None) means by every tag. Names are checked not
# to collide ("a+pinned" without backup against "a" with one). Tag "untagged" is torch_budget's "tms_untagged": under
# torch_budget's own "untagged" nothing would ever pause.
_registry = TagRegistry("backup", rename=lambda tag: _TMS_UNTAGGED if tag == _UNTAGGED else tag)
_retain: Optional[bool] = None  # retain_cpu_backup, one for the process as torch_memory_saver's library keeps it
_resident_at_pause: dict[tuple[str, int], int] = {}  # (torch_budget tag, device) -> bytes mapped at pause, where some cached
_pool_set = False  # whether the first pause set the pinned pool's keeping (_set_host_pool)
_scopes = threading.local()  # stack: the _SaverScopes open on this thread, innermost last (Note [Saver scopes])


class _Config(NamedTuple):
    """What a region asked for, in torch_memory_saver's words (its tms_get_* getters)."""
    interesting: bool  # allocations are the saver's (inside a region, or TMS_INIT_ENABLE=1)
    tag: str
    cpu_backup: bool
    disk_backup: bool
    backend: str  # "pinned" or "mmap"


def _stack() -> list[_SaverScope]:
    try:
        return _scopes.stack
    except AttributeError:
        _scopes.stack = []
        return _scopes.stack


def _current() -> _Config:
    stack = getattr(_scopes, "stack", None)
    return stack[-1].config if stack else _outside()


def _enclosing() -> _Config:
    """What a scope opened now finds: _current() less the entries whose refused end its opening
    completes (_settle)."""
    stack = getattr(_scopes, "stack", None)
    at = len(stack) if stack else 0
    while at and (stack[at - 1].ended or (stack[at - 1].flip and at > 1 and stack[at - 2].ended)):
        at -= 1
    return stack[at - 1].config if at else _outside()


def _outside() -> _Config:
    # torch_memory_saver's library reads these variables for a thread outside every region
    return _Config(_env_flag("TMS_INIT_ENABLE"), _TAG_DEFAULT, _env_flag("TMS_INIT_ENABLE_CPU_BACKUP"),
                   _env_flag("TMS_INIT_ENABLE_DISK_BACKUP"), _default_backend())


# Note [Saver scopes]
# Each saver scope (region, cuda_graph, disable, a flip of Note [Interesting region]) is one
# torch_budget.region and one entry of its thread's stack, whose innermost entry the getters read.
# The entry follows its region: it goes, by identity, only when the region has ended. An end that
# region() refuses (out of order, as asyncio tasks interleaving regions on one thread do, or from
# another thread) raises its StateError and marks the entry ended; region() ends such a scope once
# every scope opened inside it has ended, and so does _settle, which runs where region() does: as
# a scope of the thread opens and after one ends. A flip left open in a scope goes with it. Only
# torch_budget.region()s opened directly inside a saver scope are not seen here: a refused end
# that waits for one of them leaves the getters reading the scope until the next saver scope.
class _SaverScope:
    """One saver scope: its torch_budget.region and its entry on its thread's stack."""

    __slots__ = ("config", "flip", "ended", "_tag", "_route", "_core", "_stack")

    def __init__(self, tag: str, route: str, config: _Config, flip: bool = False):
        self.config, self.flip, self.ended = config, flip, False
        self._tag, self._route = tag, route

    def __enter__(self) -> _SaverScope:
        stack = _stack()
        _settle(stack)
        core = torch_budget.region(self._tag, route=self._route)
        core.__enter__()
        self._core, self._stack = core, stack
        stack.append(self)
        return self

    def __exit__(self, typ=None, value=None, traceback=None):
        stack = self._stack
        if stack is _stack():
            _settle(stack)
            if len(stack) > 1 and stack[-2] is self and stack[-1].flip:  # a scope puts back what it found
                with contextlib.suppress(StateError):  # refused too: it ends with this one (_settle)
                    stack[-1]._end()
        return self._end(typ, value, traceback)

    def _end(self, typ=None, value=None, traceback=None):
        stack, refused = self._stack, False
        try:
            return self._core.__exit__(typ, value, traceback)
        except StateError:
            refused = self.ended = True
            raise
        finally:
            if not refused:
                for at in range(len(stack) - 1, -1, -1):
                    if stack[at] is self:  # and those above, which region() ended with it
                        del stack[at:]
                        break
                _settle(stack)


def _settle(stack: list[_SaverScope]) -> bool:
    """Drops the innermost entries whose end was refused, as region() ends them, and ends a flip
    left open in one. Says whether it dropped one that region() is yet to end."""
    dropped = False
    while stack:
        top = stack[-1]
        if top.ended:
            stack.pop()
            dropped = True
        elif top.flip and len(stack) > 1 and stack[-2].ended:
            try:
                top._end()
            except StateError:  # a torch_budget.region() opened inside it is still open
                return dropped
        else:
            return dropped
    return dropped


# Note [Interesting region]
# torch_memory_saver keeps, per thread, whether allocations are its own (its "interesting region":
# inside a region, or everywhere with TMS_INIT_ENABLE=1); its library's tms_set_interesting_region
# sets that flag, and a region's exit puts back what the region found. slime turns it off around
# deep_ep.Buffer's allocations. Here setting it opens a scope of the other state, as the innermost
# scope of the thread (a flip): False an untagged one (disable() without emptying the cache), True
# one under the thread's tag and backup. Setting it back closes that scope; a scope closes on exit
# the flip left open inside it (Note [Saver scopes]).
def _set_interesting(value: bool) -> None:
    if _current().interesting == value:
        return
    stack = _stack()
    if _settle(stack) and _current().interesting == value:  # the refused ends alone set it: region() ends them too
        with torch_budget.region():
            pass
        return
    current = _current()
    if stack and stack[-1].flip:  # the innermost scope is a flip: undo it
        stack[-1].__exit__()
    elif value:
        name = _registry.register(current.tag, _backup(current.cpu_backup, current.disk_backup, None))
        _SaverScope(name, "vmm", current._replace(interesting=True), flip=True).__enter__()
    else:
        _SaverScope(_UNTAGGED, torch_budget.install()["route"], current._replace(interesting=False),
                    flip=True).__enter__()


def _backup(enable_cpu_backup, enable_disk_backup, cpu_backup_backend) -> str:
    """The torch_budget backup a region's arguments ask for; refuses what it cannot honour."""
    for what, value in (("enable_cpu_backup", enable_cpu_backup), ("enable_disk_backup", enable_disk_backup)):
        if not isinstance(value, bool):
            raise TypeError(f"{what} must be a bool, got {type(value).__name__} ({value!r})")
    if cpu_backup_backend is not None:
        if not enable_cpu_backup:
            raise InvalidArgumentError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend not in _BACKENDS:
            raise InvalidArgumentError(f"unknown cpu_backup_backend {cpu_backup_backend!r}: expected 'pinned' or 'mmap'")
    if enable_disk_backup:
        if enable_cpu_backup:
            raise InvalidArgumentError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        return "disk"
    if not enable_cpu_backup:
        return "none"
    return _BACKENDS[_backend(cpu_backup_backend)]


def _backend(cpu_backup_backend: Optional[str]) -> str:
    """A region's backend: its own, else the enclosing one's, as torch_memory_saver leaves the
    thread's backend alone when a region names none."""
    return cpu_backup_backend or _enclosing().backend


def _tag_or_all(tag: Optional[str]) -> Optional[str]:
    """pause / resume's tag; "" is every tag, as torch_memory_saver passes it to its library as none."""
    return None if tag is None or tag == "" else tag_name(tag)


def _default_backend() -> str:
    value = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"
    if value not in _BACKENDS:
        raise InvalidArgumentError(f"TMS_INIT_CPU_BACKUP_BACKEND={value!r}: expected 'pinned' or 'mmap'")
    return value


def _check_environment() -> None:
    """torch_memory_saver's variables, checked for values it would refuse."""
    for name in ("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP",
                 "TMS_RETAIN_CPU_BACKUP"):
        _env_flag(name)
    _default_backend()


def _install() -> None:
    """install() unless torch_budget serves this process already; says why when it cannot. Then
    TMS_INIT_ENABLE=1 puts every allocation outside a region under tag 'default'."""
    ensure_installed(lambda e: (
        "torch_budget's torch_memory_saver adapter serves memory through torch_budget, which must replace "
        "torch's CUDA allocator before CUDA starts: import torch_budget.adapters.torch_memory_saver "
        f"(or call torch_budget.install()) before the first CUDA tensor or call. {e}"))
    if _env_flag("TMS_INIT_ENABLE"):
        _init_enable()


def _init_enable() -> None:
    """torch_memory_saver's TMS_INIT_ENABLE: from the start, every allocation of every thread outside
    a region is under tag 'default', backed up when TMS_INIT_ENABLE_CPU_BACKUP=1 (with the backend
    of TMS_INIT_CPU_BACKUP_BACKEND) or to disk when TMS_INIT_ENABLE_DISK_BACKUP=1: torch_budget's
    default tag (allocator.set_default_tag)."""
    cpu, disk = _env_flag("TMS_INIT_ENABLE_CPU_BACKUP"), _env_flag("TMS_INIT_ENABLE_DISK_BACKUP")
    if cpu and disk:  # torch_memory_saver exits at the first allocation outside a region
        raise InvalidArgumentError("TMS_INIT_ENABLE_CPU_BACKUP=1 and TMS_INIT_ENABLE_DISK_BACKUP=1 are mutually "
                                   "exclusive: with TMS_INIT_ENABLE=1, set one of them")
    route = allocator.requested_route()  # at import: read without starting the driver (the process may fork)
    if route not in ("auto", "vmm"):
        raise UnsupportedError(f"TMS_INIT_ENABLE=1 with torch_budget's route {route!r}: only memory of the vmm "
                               "route can be paused; install torch_budget with route='vmm' (the default)")
    backup = _BACKENDS[_default_backend()] if cpu else "disk" if disk else "none"
    allocator.set_default_tag(_registry.register(_TAG_DEFAULT, backup))


def _check_pool_tag(pool, tag: str, backup: str, name: str) -> None:
    """torch_memory_saver tags each allocation of a capture by the region in force; torch_budget charges a
    graph pool to the tag in force when the pool was created. Capturing under `tag` into a pool that
    another tag created would leave this capture's memory out of pause(tag): refused before capturing."""
    created = sleep.pool_tag(pool)
    if created is None or created == name:
        return
    owner = _registry.owners.get(created)
    missed = f"pause({tag!r}) would not free this capture's memory"
    if created == _UNTAGGED:
        where = "is untagged (its first capture ran outside every region)"
    elif owner is not None and owner[0] == tag:
        where = f"belongs to torch_budget tag {created!r} ({_backup_words(owner[1])})"
        missed = (f"pause({tag!r}) would treat this capture's memory as that tag's, not as asked "
                  f"({_backup_words(backup)})")
    else:
        where = f"belongs to torch_budget tag {created!r}" + (
            f" (torch_memory_saver tag {owner[0]!r}, {_backup_words(owner[1])})" if owner else "")
    raise InvalidArgumentError(
        f"torch_memory_saver.cuda_graph(tag={tag!r}): graph pool {tuple(pool)} {where}, and torch_budget charges a "
        f"pool's memory to the tag it was created under: {missed} (torch_budget tag {name!r}). Capture into a pool "
        "of this tag's own (pool=None, or a handle first captured into under this tag and backup), or under the "
        "pool's tag")


def _backup_words(backup: str) -> str:
    return "no backup" if backup == "none" else f"backup {backup!r}"


def _holding(names) -> set[str]:
    """Those of `names` that hold memory on some device: tensors, or a cache. torch_memory_saver
    pauses and resumes allocations, so a tag that holds none is not paused or resumed: a pause or
    resume of it does nothing, and neither refuses because of it."""
    out = set()
    for device in _runtime.served_devices(_runtime.library()):
        by_tag = torch_budget.stats(device)["by_tag"]
        out.update(name for name in names if name in by_tag and (by_tag[name]["allocated"] or by_tag[name]["resident"]))
    return out


def _resident_with_cache(names) -> dict[tuple[str, int], int]:
    """(tag, device) -> bytes mapped behind the tag, where some of them no tensor uses (a cache)."""
    out = {}
    for device in _runtime.served_devices(_runtime.library()):
        by_tag = torch_budget.stats(device)["by_tag"]
        for name in names:
            t = by_tag.get(name)
            if t is not None and t["resident"] > t["allocated"]:
                out[(name, device)] = t["resident"]
    return out


def _regrow_cache(names) -> None:
    """Gives each of `names` back what was mapped behind it at pause that the restore did not map
    back (its own cache: a graph pool's free blocks come back with the restore), where the budgets
    have room: one block allocated under the tag and freed at once, so it stays mapped in the
    tag's cache. Where the device's or the tag's budget has no room, the cache stays smaller
    (torch_budget grows it again on demand)."""
    lib = _runtime.library()
    for (name, device), at_pause in sorted(_resident_at_pause.items()):
        if name not in names:
            continue
        del _resident_at_pause[(name, device)]
        s = torch_budget.stats(device)
        t = s["by_tag"].get(name, {})
        nbytes = at_pause - t.get("resident", at_pause)
        room = (s["budget"] if s["budget"] is not None else s["total"]) - s["reserved"]
        # the tag's own budget and its family's (a "kv+pinned" tag counts toward "kv"'s: Note [Tag families])
        for bound in (t, s["by_tag"].get(allocator.family_head(name) or name, {})):
            if bound.get("headroom") is not None:
                room = min(room, bound["headroom"])
        if nbytes <= 0 or nbytes > room:
            continue
        stream = _current_stream(device)
        with torch_budget.region(name, route="vmm"):
            ptr = lib.tb_malloc(nbytes, device, stream)
        if ptr:  # a refusal leaves the cache as it is: the contents are back either way
            lib.tb_free(ptr, nbytes, device, stream)


def _current_stream(device: int):
    """torch's current stream on `device` (its cache is per stream); the default stream before CUDA started."""
    import torch

    return torch.cuda.current_stream(device).cuda_stream if torch.cuda.is_initialized() else None


def _set_host_pool() -> None:
    """Once, at the first pause (importing the module must not start the driver): the pinned pool
    stops keeping what a release pinned, as torch_memory_saver frees each backup's host memory with
    it, unless install() reserved a host pool (host_pool): that asks for the pinned memory to stay."""
    global _pool_set
    if not _pool_set:
        if not torch_budget.install()["host_pool"]:
            sleep.keep_host_pool(False)
        _pool_set = True


class TorchMemorySaver:
    """torch_memory_saver's TorchMemorySaver over torch_budget. Instances share one state, as
    torch_memory_saver's share its library: pause() of one pauses the others' tags."""

    def __init__(self):
        self._hook_mode: HookMode = "preload"
        self._impl: Optional[_Impl] = None  # torch_memory_saver's, None until the first use

    @_scope.once(lambda self, tag=_TAG_DEFAULT, *_, **__: f"torch_memory_saver.region({tag!r})")
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False, enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[CpuBackupBackend] = None):
        """Allocations inside are paused and resumed with `tag`; with enable_cpu_backup their
        contents survive a pause. Nestable: the innermost region decides."""
        _backup(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)  # refused before anything is done
        tag_name(tag)
        self._ensure_initialized()
        with self._impl._with_region_config(tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup) as name:
            backend = _current().backend if enable_cpu_backup else ""
            self._impl._mem_pools.setdefault((tag, enable_cpu_backup, enable_disk_backup, backend,
                                              _runtime.current_device()), _RegionPool(name))
            yield

    @_scope.once(lambda self, cuda_graph=None, pool=None, stream=None, capture_error_mode=None, tag=_TAG_DEFAULT, *_,
                 **__: f"torch_memory_saver.cuda_graph(tag={tag!r})")
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", tag: str = _TAG_DEFAULT,
                   enable_cpu_backup: bool = False, cpu_backup_backend: Optional[CpuBackupBackend] = None):
        """torch.cuda.graph(cuda_graph, pool, stream, capture_error_mode), captured under
        region(tag): the graph's memory is paused and resumed with `tag`."""
        import torch

        backup = _backup(enable_cpu_backup, False, cpu_backup_backend)
        tag_name(tag)
        self._ensure_initialized()
        if pool is not None:  # refused before the tag is registered: pause() then knows nothing of it
            _check_pool_tag(pool, tag, backup, _registry.name(tag, backup))
        name = _registry.register(tag, backup)
        config = _Config(True, tag, enable_cpu_backup, False, _backend(cpu_backup_backend))
        # The region opens before the capture: the private pool takes its tag when capture begins.
        with _SaverScope(name, "vmm", config):
            with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
                yield

    @_scope.once(lambda self: "torch_memory_saver.disable()")
    def disable(self):
        """Inside a region, or anywhere with TMS_INIT_ENABLE=1: allocations here are untagged
        (pause leaves them), and the cache is emptied on exit, so what they freed goes back to
        the driver."""
        self._ensure_initialized()
        enclosing = _enclosing()
        if not enclosing.interesting:
            raise StateError("torch_memory_saver.disable() is for use inside a region() (or with TMS_INIT_ENABLE=1): "
                             "outside one nothing is paused anyway")
        outside = enclosing._replace(interesting=False)
        try:
            with _SaverScope(_UNTAGGED, torch_budget.install()["route"], outside):
                yield
        finally:  # torch_memory_saver's pool goes however the body ends
            torch_budget.empty_cache(device="all")

    def pause(self, tag: Optional[str] = None):
        """Gives the device memory of `tag` (None or "": every tag) back to the driver on every
        device, backing up what enable_cpu_backup asked for. A tag never used: nothing to do."""
        tag = _tag_or_all(tag)
        self._ensure_initialized()
        if not allocated_anywhere():
            return
        with _registry.lock:
            names = _registry.of(tag)
            held, released = _holding(names), sleep.released_tags()
            paused = sorted(n for n in names if n in released and n in held)
            if paused:
                raise TagStateError(f"torch_memory_saver.pause({tag!r}): {', '.join(map(repr, paused))} "
                                    "already paused; resume first")
            names = {n: b for n, b in names.items() if n in held and n not in released}
            by_backup: dict[str, list[str]] = {}
            for name, backup in sorted(names.items()):
                by_backup.setdefault(backup, []).append(name)
            cache = _resident_with_cache(names)
            _set_host_pool()
            done: list[list[str]] = []
            try:
                # Backups that keep contents first: a failure then undoes before any contents were dropped.
                for backup, group in sorted(by_backup.items(), key=lambda item: (item[0] not in sleep.KEEPS, item[0])):
                    torch_budget.release(group, backup=backup, device="all",
                                         retain=_retain and backup in sleep.RETAINABLE)
                    done.append(group)
            except BaseException:
                for group in reversed(done):  # all or nothing, as release() is for one backup
                    with contextlib.suppress(TorchBudgetError):
                        torch_budget.restore(group, device="all")
                raise
            _resident_at_pause.update(cache)

    def resume(self, tag: Optional[str] = None):
        """Maps memory back behind `tag` (None or "": every paused tag) at the same addresses and
        copies the backups in. A tag never used: nothing to do; one not paused: TagStateError."""
        tag = _tag_or_all(tag)
        self._ensure_initialized()
        if not allocated_anywhere():
            return
        with _registry.lock:
            names = _registry.of(tag)
            paused = sorted(n for n in names if n in sleep.released_tags())
            if not paused:
                if tag is not None and _holding(names):
                    raise TagStateError(f"torch_memory_saver.resume({tag!r}): tag {tag!r} is not paused")
                return
            copying = [n for n in paused if names[n] in sleep.RETAINABLE]
            if copying:  # torch_memory_saver decides at resume whether the backups stay
                torch_budget.restore(copying, device="all", retain=_retain)
            rest = [n for n in paused if n not in copying]
            if rest:
                torch_budget.restore(rest, device="all")
            _regrow_cache(paused)

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        raise AttributeError("hook_mode can only be set, as in torch_memory_saver")

    @hook_mode.setter
    def hook_mode(self, hook_mode: HookMode):
        if hook_mode not in ("preload", "torch"):
            raise InvalidArgumentError(f"unknown hook_mode {hook_mode!r}: expected 'preload' or 'torch'")
        if self._impl is not None and hook_mode != self._hook_mode:
            raise StateError(f"hook_mode cannot change after first use (it is {self._hook_mode!r})")
        self._hook_mode = hook_mode

    @property
    def memory_margin_bytes(self):
        raise UnsupportedError("memory_margin_bytes can only be set, as in torch_memory_saver")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        value = non_negative_int(value, "memory_margin_bytes")
        self._ensure_initialized()
        if value > 0:
            raise UnsupportedError(
                f"memory_margin_bytes={value}: torch_budget does not refuse allocations by the device's free "
                "memory; it caps this process's own memory: torch_budget.set_budget(bytes or fraction)")

    @property
    def retain_cpu_backup(self) -> bool:
        self._ensure_initialized()
        return _retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        if not isinstance(value, bool):
            raise TypeError(f"retain_cpu_backup must be a bool, got {type(value).__name__} ({value!r})")
        global _retain
        self._ensure_initialized()
        _retain = value

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """The CPU backup of `x` while its tag is paused with a CPU backup, or while a resumed tag
        retains one (retain_cpu_backup); None while it has none. A copy, or with zero_copy=True
        the backup's host memory itself (torch_budget.sleep.backup_of: the view keeps that memory
        alive, past a resume too)."""
        import torch

        self._ensure_initialized()
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"get_cpu_backup takes a tensor, got {type(x).__name__}")
        return sleep.backup_of(x, copy=not zero_copy)

    def set_disk_backup_dir(self, path: str):
        """The directory disk backups go to (created if needed), for the whole process."""
        self._ensure_initialized()
        sleep.set_disk_backup_dir(path)

    def _ensure_initialized(self):
        global _retain
        if self._impl is not None:
            return
        _check_environment()
        _install()
        if _retain is None:  # the first use of any instance reads it
            _retain = _env_flag("TMS_RETAIN_CPU_BACKUP")
        if os.environ.get("TMS_DISK_BACKUP_DIR") or sleep.disk_backup_dir() is None:
            # torch_memory_saver's own default is /tmp
            sleep.set_disk_backup_dir(os.environ.get("TMS_DISK_BACKUP_DIR") or "/tmp")
        self._impl = _Impl(self)


class _PrivateError(UnsupportedError, AttributeError):
    """A private name of torch_memory_saver's that torch_budget does not have: an AttributeError
    too, as ctypes' for a missing symbol, so hasattr() and getattr(..., default) answer."""


def _private(what: str) -> UnsupportedError:
    return _PrivateError(f"torch_memory_saver's private {what}: torch_budget implements its public API, "
                            "the tms_get_* configuration getters and tms_set_interesting_region only; read "
                            "torch_budget.sleep.tag_states() for the state of each tag")


class _ConfigLibrary:
    """The tms_get_* getters of torch_memory_saver's C library, for the region in force on this
    thread, and its tms_set_interesting_region (Note [Interesting region])."""

    def __init__(self, saver: TorchMemorySaver):
        self._saver = saver

    def tms_get_interesting_region(self) -> bool:
        return _current().interesting

    def tms_set_interesting_region(self, is_interesting_region: bool) -> None:
        _set_interesting(bool(is_interesting_region))

    def tms_get_current_tag(self) -> bytes:
        return _current().tag.encode()

    def tms_get_enable_cpu_backup(self) -> bool:
        return _current().cpu_backup

    def tms_get_enable_disk_backup(self) -> bool:
        return _current().disk_backup

    def tms_get_cpu_backup_backend(self) -> bytes:
        return _current().backend.encode()

    def tms_get_retain_cpu_backup(self) -> bool:
        return bool(self._saver.retain_cpu_backup)

    def __getattr__(self, name: str):
        if name.startswith("cuda"):  # torch_memory_saver's library links the CUDA runtime: ctypes finds its functions
            return getattr(_cuda_runtime(name), name)
        raise _private(f"C library function {name}")


_cudart = None  # ctypes' handle on the CUDA runtime, once found


def _cuda_runtime(wanted: str):
    """The CUDA runtime library torch loaded into this process, through ctypes."""
    global _cudart
    if _cudart is None:
        import ctypes

        paths: list[str] = []
        with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
            paths = [line.rsplit(None, 1)[-1] for line in maps]
        path = next((p for p in paths if os.path.basename(p).startswith("libcudart.so")), None)
        if path is None:
            raise UnsupportedError(f"{wanted}: the CUDA runtime is not loaded in this process (torch loads it "
                                   "with CUDA)")
        _cudart = ctypes.CDLL(path)
    return _cudart


class _Impl:
    """torch_memory_saver's private implementation (TorchMemorySaver._impl, None until the first use),
    as far as its own tests and slime read it: its C library's configuration getters, the CUDA
    runtime functions it links and tms_set_interesting_region (_impl._binary_wrapper.cdll),
    _with_region_config and _mem_pools. Everything else raises UnsupportedError."""

    def __init__(self, saver: TorchMemorySaver):
        self._binary_wrapper = types.SimpleNamespace(cdll=_ConfigLibrary(saver))
        # (tag, enable_cpu_backup, enable_disk_backup, backend or "", device) -> _RegionPool
        self._mem_pools: dict[tuple, _RegionPool] = {}

    @_scope.once(lambda self, tag=None, *_, **__: f"torch_memory_saver._impl._with_region_config({tag!r})")
    def _with_region_config(self, tag: str, enable_cpu_backup: bool, cpu_backup_backend: Optional[CpuBackupBackend],
                            enable_disk_backup: bool = False) -> Iterator[str]:
        """A region without its pool: the allocations inside (and the frees, which need no
        region here) are the saver's under `tag`. Yields the torch_budget tag serving them."""
        backup = _backup(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        tag_name(tag)
        name = _registry.register(tag, backup)
        config = _Config(True, tag, enable_cpu_backup, enable_disk_backup, _backend(cpu_backup_backend))
        with _SaverScope(name, "vmm", config):
            yield name

    def __getattr__(self, name: str):
        raise _private(f"_impl.{name}")


class _RegionPool:
    """What torch_memory_saver keeps for each key of _impl._mem_pools: a MemPool holding the
    region's memory. torch_budget keeps that memory in its tag's own arena, so this names the tag
    only, and dropping it frees nothing: the memory goes back to the driver when its tensors are
    freed and the cache is emptied, and their backups with it (Note [Stale backups] in
    csrc/core/tag_arenas.cpp; the pinned memory is unpinned then, sleep.keep_host_pool)."""

    __slots__ = ("tag",)

    def __init__(self, tag: str):
        self.tag = tag

    def __repr__(self) -> str:
        return f"_RegionPool(tag={self.tag!r})"


@contextlib.contextmanager
def configure_subprocess():
    """torch_memory_saver set LD_PRELOAD here so that the processes started inside were hooked
    from their start. Nothing to set for torch_budget: a child that imports this module
    installs torch_budget then, before its CUDA starts."""
    yield


torch_memory_saver = TorchMemorySaver()
# Code written for torch_memory_saver allocates (and starts CUDA) before its first region.
install_at_import(_install)
