"""vLLM's sleep mode over torch_budget: a general plugin, CuMemAllocator's surface and a sleep-mode backend.

Installing torch_budget into vLLM's environment is the whole set-up: the package registers the
entry point `torch_budget = torch_budget.adapters.vllm:register` in the group
`vllm.general_plugins`, which vLLM runs in every process before CUDA starts.

    pip install torch_budget
    TORCH_BUDGET_CONF="budget:0.9" vllm serve MODEL --enable-sleep-mode --sleep-mode-backend torch_budget
    # vLLM without pluggable sleep backends: the same without --sleep-mode-backend
    # code that calls the allocator itself:
    from torch_budget.adapters.vllm import CuMemAllocator   # was: from vllm.device_allocator.cumem import ...

The mapping (vLLM name -> what torch_budget does):
  register()                   torch_budget.install() (TORCH_BUDGET_CONF) in every vLLM process, then
                               this CuMemAllocator in vLLM's CuMemAllocator.instance slot (so vLLM's own
                               get_mem_allocator_instance() returns it) and backend "torch_budget"
                               registered with SleepModeBackendFactory where vLLM has one
  use_memory_pool(tag=None)    torch_budget.region(tag, route="vmm"); None: "default"; on exit the tag's
                               freed cache goes back to the driver (empty_cache(tags=tag)). A tag asleep
                               raises TagStateError (wake_up([tag]) first): vLLM maps a fresh allocation
                               there, torch_budget maps a tag back only whole
  sleep(offload_tags=None, discardable=())  every tag used: release(tag, backup="pinned") for offload_tags
                               (None: ("default",)), backup="none" for the rest; then the cache is emptied.
                               `discardable` (vLLM 0.34: storage addresses of the tensors the caller rewrites
                               after waking): the "weights" allocations among them are released without a
                               copy (release(discardable=...)) and mapped back empty, as vLLM discards
                               them; what else "weights" holds (a buffer beside the parameters) keeps its
                               copy, per 2 MiB granule (vLLM: per segment); "weights" with nothing else goes
                               with backup="none"
  discard(tags)                release(tags, backup="none")
  wake_up(tags=None)           gc.collect() and empty_cache(device="all"), then restore(...) of the released
                               tags (None: all); a list wakes those tags and every tag outside
                               DEFERRABLE_TAGS ("weights", "kv_cache"), as vLLM does; then, with
                               VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY, sleep.free_host_pool() where it
                               copied a tag back (the pinned memory no backup holds goes back to the OS)
  get_current_usage()          bytes mapped or released behind the tags (stats()["by_tag"] resident + released)
  use_cudagraph_pool(pool=None) a graph pool handle (vLLM's `pool`, else one of this allocator's) yielded inside
  (also: cudagraph_pool())     torch_budget.region("cudagraph"): the graphs vLLM captures into it (its default
                               "cumem" backend does, in its V2 model runner) are charged to tag "cudagraph",
                               which sleep backs up at every level and every wake maps back, as vLLM's does
  release_cudagraph_pool(pool=None)  after the graphs are destroyed: empty_cache(tags="cudagraph"), and the next
                               capture gets a fresh pool
  pointer_to_data              {address: AllocationData} read from the ledger: each live block under the tags
                               (handle (device, bytes, address, 0), tag, is_asleep, cpu_backup_tensor: a
                               copy of its backup, read when asked); vLLM's tests' mapped_usage sums it
  allocator_and_pools          tag -> an entry per use of the tag's pool, (TagPool, None): TagPool.snapshot()
                               lists the tag's allocations as MemPool.snapshot() would
  release_pools(), close()     drop allocator_and_pools' entries; the memory stays (no MemPool per tag)
  register_tag_hooks(...)      vLLM's own hooks run: before a tag is released, after a wake maps all of it
  TorchBudgetBackend           suspend(discardable=()) as vLLM 0.34's cumem backend: sleep(("weights", "runtime",
                               "cudagraph"), discardable); an int is vLLM 0.33's level (suspend(level)): 1 keeps
                               ("weights", "runtime", "cudagraph"), 2 ("runtime", "cudagraph"); resume(tags) =
                               wake_up(tags); discard(tags); state() RUNNING / SUSPENDED / RESUMING

use_memory_pool() and use_cudagraph_pool() are entered once and ended once. vLLM's are contextlib generator
scopes, which refuse a second entry too; an end without an entry, which contextlib answers by running the
body (the tag listed for every sleep, a pool entry added, a graph pool made) and raising RuntimeError, and a
second end, which it lets pass, raise StateError (a RuntimeError) here and change nothing.

All of it acts on every device. Tags already asleep stay as they are (a sleep asking another backup
logs a warning, as vLLM's does); a failed wake_up puts back to sleep what it had woken, then raises.
What torch_budget cannot do raises UnsupportedError (a TorchBudgetError and a NotImplementedError):
backend options, and devices without VMM.
What vLLM's own tests (tests/basic_correctness/test_cumem.py) check that this adapter cannot match:
  - torch.cuda.host_memory_stats() does not see the backups: they live in torch_budget's pinned host
    pool (torch_budget.sleep.host_pool_stats()), not torch's host caching allocator, so the
    VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY tests' pinned-byte deltas read 0;
  - monkeypatching vllm.device_allocator.cumem.create_and_map (their poisoned wake) changes nothing:
    torch_budget's restore maps the memory, so discarded memory comes back undefined, not poisoned;
  - pointer_to_data has a record per live tensor block (bytes charged, 512 B units), not per 2 MiB
    cuMem segment, and a cpu_backup_tensor only while asleep (a copy, not the backup vLLM keeps).
When CUDA started on torch's own allocator before the plugin ran (a trainer in the same process), register()
logs a warning saying so and vLLM runs on torch's allocator: the CuMemAllocator slot stays vLLM's, and the
torch_budget backend, asked for, raises InstallError with that reason. Importing this module installs
torch_budget when a CUDA device is there and CUDA has not started, as the torch_memory_saver adapter does,
whose UnsupportedError this module shares.
"""
from __future__ import annotations

import contextlib
import functools
import ctypes
import gc
import importlib
import logging
import threading
from collections.abc import Collection, Iterable
from typing import NamedTuple, Optional, Union

import torch_budget
from torch_budget import _runtime, _scope, diagnostics, sleep
from torch_budget._validate import tag_name
from torch_budget.adapters._common import allocated_anywhere, ensure_installed, install_at_import
from torch_budget.adapters._vllm_allocations import AllocationData, allocations, pool_entry
from torch_budget.errors import (InstallError, InvalidArgumentError, StateError, TagStateError, TorchBudgetError,
                                 UnsupportedError)

__all__ = ["register", "CuMemAllocator", "TorchBudgetBackend", "BACKEND_NAME", "DEFERRABLE_TAGS", "GRAPH_TAG",
           "UnsupportedError"]

BACKEND_NAME = "torch_budget"
DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")  # vllm.device_allocator's: only these wait for a wake
GRAPH_TAG = "cudagraph"  # vLLM's tag of the CUDA graphs captured into the sleep-mode allocator's pool
WEIGHTS_TAG = "weights"
# What vLLM's cumem backend backs up at every sleep level besides the weights: the model runner's state
# and what KV-cache set-up allocated outside the cache (tag "runtime"), and the graphs.
_KEPT_AT_EVERY_LEVEL = ("runtime", GRAPH_TAG)
_OFFLOAD, _DISCARD = "pinned", "none"  # vLLM's pinned CPU copy; no copy

logger = logging.getLogger(__name__)


def register() -> None:
    """The `vllm.general_plugins` entry point. Idempotent; does nothing where torch sees no CUDA device.
    It runs in vLLM's parent processes too, which fork their workers: it starts no CUDA driver
    (Note [Installing without the driver])."""
    if _runtime.cuda_devices() == 0:
        logger.debug("torch_budget: no CUDA device in this process; nothing to install")
        return
    try:
        _install("vLLM loaded torch_budget's plugin")
    except InstallError as e:
        # An exception here would end vLLM (load_general_plugins does not catch it): vLLM runs
        # on torch's allocator instead, and the backend, if asked for, says why it cannot serve.
        _not_installed.append(str(e))
        logger.warning("%s", e)
        _register_backend()
        return
    _take_cumem_slot()
    _register_backend()


_not_installed: list[str] = []  # why register() could not install, when it could not


def _install(who: str) -> None:
    ensure_installed(lambda e: (
        f"{who}, and torch_budget.install() failed: {e}. torch_budget replaces torch's CUDA allocator, which it "
        "can do only before CUDA starts: let the plugin run first (vLLM loads it at process start, unless "
        "something touched CUDA before), or set VLLM_PLUGINS without torch_budget to run vLLM on torch's "
        "allocator"))


def _take_cumem_slot() -> None:
    try:
        cumem = importlib.import_module("vllm.device_allocator.cumem")
    except ImportError:
        return
    ours = CuMemAllocator.get_instance()
    held = getattr(cumem.CuMemAllocator, "instance", None)
    if held is None:
        cumem.CuMemAllocator.instance = ours
    elif held is not ours:
        raise StateError("vLLM's CuMemAllocator was created before torch_budget's plugin ran: its memory would "
                         "sleep outside torch_budget. Load the plugin at process start (vLLM's load_general_plugins)")


def _register_backend() -> None:
    try:
        backends = importlib.import_module("vllm.device_allocator.sleep_mode_backend")
    except ImportError:
        return  # a vLLM without pluggable sleep backends: CuMemAllocator's slot is the whole hook
    factory = backends.SleepModeBackendFactory
    try:
        factory.register_backend(BACKEND_NAME, __name__, TorchBudgetBackend.__name__)
    except ValueError:
        if factory.get_backend_class(BACKEND_NAME) is not TorchBudgetBackend:
            raise


class _Allocation(NamedTuple):
    """What vLLM's tag hooks read of an allocation (vllm.device_allocator.AllocationData)."""
    tag: str
    is_asleep: bool


@functools.cache
def _vllm_tag_hooks():
    """vllm.device_allocator's run_before_unmap_hooks and run_after_map_hooks, or None."""
    try:
        module = importlib.import_module("vllm.device_allocator")
    except ImportError:
        return None
    before, after = (getattr(module, n, None) for n in ("run_before_unmap_hooks", "run_after_map_hooks"))
    return (before, after) if before and after else None


def _addresses(values, what: str) -> frozenset:
    """A collection of device addresses (ints in [0, 2**64)), as vLLM passes storage data pointers
    (0: an empty parameter's). One outside would reach the core truncated to 64 bits, where it
    may name another allocation, and count as one more allocation rewritten."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a collection of addresses (ints), got {type(values).__name__} ({values!r})")
    values = frozenset(values)
    bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, int)), None)
    if bad is not None:
        raise TypeError(f"{what} must hold device addresses (ints), got {type(bad).__name__} ({bad!r})")
    bad = next((v for v in values if not 0 <= v < 2**64), None)
    if bad is not None:
        raise InvalidArgumentError(f"{what} must hold device addresses (ints in [0, 2**64)), got {bad}")
    return values


def _allocations_under(tag: str, addresses: frozenset) -> list[int]:
    """The addresses that are live allocations under `tag` (on any device), as vLLM's
    discardable_allocations reads only the weights pool's."""
    if not torch_budget.installed():
        return []
    lib = _runtime.library()
    tag_id = lib.tb_tag_find(tag.encode())
    return sorted(a for a in addresses if tag_id > 0 and lib.tb_ptr_tag(ctypes.c_void_p(a)) == tag_id)


def _covers_every_allocation(tag: str, covered: list[int]) -> bool:
    """Whether `covered` (live allocations under `tag`) is every live allocation under it, on every device."""
    lib = _runtime.library()
    live = sum(torch_budget.stats(device)["by_tag"].get(tag, {}).get("allocations", 0)
               for device in _runtime.served_devices(lib))
    return live > 0 and len(covered) == live


def _tag_tuple(tags, what: str) -> tuple[str, ...]:
    """A str, or a tuple or list of str, as CuMemAllocator.sleep / discard take them (vLLM tests
    membership only; its engine-core RPC hands tuples over as lists)."""
    if isinstance(tags, str):
        tags = (tags,)
    if not isinstance(tags, (tuple, list)):
        raise TypeError(f"{what} must be a str or a tuple or list of str, got {type(tags).__name__} ({tags!r})")
    return tuple(tag_name(t, f"a tag of {what}") for t in tags)


class CuMemAllocator:
    """vLLM's CuMemAllocator over torch_budget. A singleton (get_instance()), as vLLM's: its tags are
    torch_budget tags of this process."""

    instance: Optional["CuMemAllocator"] = None
    default_tag: str = "default"

    @staticmethod
    def get_instance() -> "CuMemAllocator":
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    def __init__(self):
        self.current_tag: str = CuMemAllocator.default_tag
        self._lock = threading.RLock()  # guards _tags, _pools and _discarded; held across a sleep or wake
        self._tags: dict[str, None] = {}  # every tag a use_memory_pool opened, in order
        self._pools: dict[str, list] = {}  # allocator_and_pools: an entry per use of a tag, until release_pools()
        self._discarded: frozenset[int] = frozenset()  # weights allocations asleep without a copy
        self._graph_pool: Optional[tuple[int, int]] = None  # use_cudagraph_pool's, until released

    @_scope.once(lambda self, tag=None: f"CuMemAllocator.use_memory_pool({tag!r})")
    def use_memory_pool(self, tag: Optional[str] = None):
        """Allocations inside are charged to `tag` (None: "default") on the VMM route. Entered once
        and ended once (see the module's note on scopes)."""
        tag = self.default_tag if tag is None else tag_name(tag)
        if tag == "untagged":
            raise InvalidArgumentError("use_memory_pool('untagged'): 'untagged' is torch_budget's name for memory of "
                                       "no tag, which cannot sleep; give the pool another tag")
        self._check_vmm()
        if tag in sleep.released_tags():
            raise TagStateError(f"use_memory_pool({tag!r}): tag {tag!r} is asleep (sleep() or discard() released it), "
                                f"and torch_budget maps a tag back only whole, so it cannot give it a fresh allocation "
                                f"as vLLM's allocator does: call wake_up([{tag!r}]) first")
        before, self.current_tag = self.current_tag, tag
        try:
            with torch_budget.region(tag, route="vmm"):
                with self._lock:  # only once the region opened: a tag it refused is never slept
                    self._tags.setdefault(tag)
                    self._pools.setdefault(tag, []).append(pool_entry(tag))
                yield
            if tag not in sleep.released_tags():
                torch_budget.empty_cache(device="all", tags=tag)  # vLLM frees what the pool holds unused
        finally:
            self.current_tag = before

    def _check_vmm(self) -> None:
        _install("torch_budget's CuMemAllocator was used")
        if diagnostics.route_for("vmm") != "vmm":
            raise UnsupportedError("this device has no CUDA virtual memory management, which sleep mode needs to "
                                   "give memory back and map it again at the same addresses")

    def sleep(self, offload_tags: Union[tuple[str, ...], str, None] = None, discardable: Collection[int] = ()) -> None:
        """Releases every tag: a pinned host copy of those in `offload_tags` (None: ("default",)) and of
        GRAPH_TAG, no copy of the rest. Tags already asleep keep their backup. `discardable`: storage
        addresses the caller rewrites after waking; "weights" goes without a copy when they cover every
        allocation it holds (vLLM 0.34's discardable_allocations)."""
        offload = (self.default_tag,) if offload_tags is None else _tag_tuple(offload_tags, "offload_tags")
        offload += (GRAPH_TAG,)
        addresses = _addresses(discardable, "discardable")
        wanted = {t: _OFFLOAD if t in offload else _DISCARD for t in self._known()}
        rewritten: list[int] = []  # weights allocations the caller rewrites: released without a copy
        if addresses and wanted.get(WEIGHTS_TAG) == _OFFLOAD:
            rewritten = _allocations_under(WEIGHTS_TAG, addresses)
            if _covers_every_allocation(WEIGHTS_TAG, rewritten):
                wanted[WEIGHTS_TAG], rewritten = _DISCARD, []
        self._release(wanted, "sleep", rewritten)
        gc.collect()
        if torch_budget.installed():
            torch_budget.empty_cache(device="all")

    def discard(self, tags: Union[tuple[str, ...], str]) -> None:
        """Releases `tags` without a copy (their contents are lost); tags asleep stay as they are."""
        wanted = _tag_tuple(tags, "tags")
        self._release({t: _DISCARD for t in self._known() if t in wanted}, "discard")

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Maps the released tags back at their addresses, with their copies, once the cache went back
        to the driver (as vLLM's wake empties it first). `tags` limits the wake to those, plus every
        tag outside DEFERRABLE_TAGS. All or nothing. With vLLM's VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY, a wake
        that copied tags back unpins the host pool's memory no backup holds any more."""
        if tags is not None:
            if isinstance(tags, str) or not isinstance(tags, Iterable):
                raise TypeError(f"tags must be None or a list of tag names, got {type(tags).__name__} ({tags!r})")
            tags = [tag_name(t, "a tag of tags") for t in tags]
        with self._lock:
            asleep = sleep.released_tags()
            names = [t for t in self._tags if t in asleep
                     and (tags is None or t in tags or t not in DEFERRABLE_TAGS)]
            if names:  # as vLLM's wake: what was freed while asleep may sit in the cache the tags need
                gc.collect()
                torch_budget.empty_cache(device="all")
            done: list[str] = []
            try:
                for name in names:
                    torch_budget.restore(name, device="all")
                    done.append(name)
            except BaseException:
                for name in reversed(done):
                    with contextlib.suppress(TorchBudgetError):
                        torch_budget.release(name, backup=asleep[name], device="all")
                raise
            if WEIGHTS_TAG in done:
                self._discarded = frozenset()
            if any(asleep[name] == _OFFLOAD for name in done) and _release_host_memory():
                sleep.free_host_pool()  # what held the woken tags' copies; backups still asleep stay
            hooks = _vllm_tag_hooks()
            if hooks:  # idempotent: every wake runs them, so one that failed before is retried
                hooks[1](self._allocations())

    def get_current_usage(self) -> int:
        """Bytes behind the tags, mapped or released (vLLM counts an allocation while it sleeps too)."""
        with self._lock:
            if not torch_budget.installed():
                return 0
            total = 0  # every device, as vLLM counts every allocation: a pool opened on one may allocate on others
            for device in _runtime.served_devices(_runtime.library()):
                states = sleep.tag_states(device)
                total += sum(states[t]["resident"] + states[t]["released"] for t in self._tags if t in states)
            return total

    @property
    def pointer_to_data(self) -> dict[int, AllocationData]:
        """vLLM's {address: AllocationData}: each live allocation under the tags, on every device, with
        its handle (device, bytes, address, 0), tag, is_asleep and cpu_backup_tensor (a copy of its
        backup, read when asked). Read-only; a new dict at each read."""
        with self._lock:
            return allocations(list(self._tags), self._discarded)

    @property
    def allocator_and_pools(self) -> dict[str, list]:
        """vLLM's tag -> [(pool, allocator)], an entry per use of the tag's pool (use_memory_pool, the one
        graph pool) until release_pools(); each pool's snapshot() lists the tag's allocations. Read-only."""
        with self._lock:
            return {tag: list(entries) for tag, entries in self._pools.items()}

    def release_pools(self) -> None:
        """Drops allocator_and_pools' entries, as vLLM's; the memory stays (torch_budget keeps no MemPool per tag)."""
        with self._lock:
            self._pools.clear()

    def close(self) -> None:
        """release_pools(), as vLLM's."""
        self.release_pools()

    @_scope.once(lambda self, pool=None: f"CuMemAllocator.use_cudagraph_pool({'' if pool is None else pool})")
    def use_cudagraph_pool(self, pool: Optional[tuple[int, int]] = None):
        """Yields the pool to capture CUDA graphs into (`pool` where vLLM passes its own, else this
        allocator's one graph pool); what the captures inside allocate is charged to GRAPH_TAG
        ("cudagraph"), which sleep always backs up (a replay does not rewrite all of a graph's
        memory) and every wake maps back at its addresses, as vLLM's cuMem graph pool."""
        import torch

        self._check_vmm()
        with self._lock:
            if pool is None:
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
                pool = self._graph_pool
            self._tags.setdefault(GRAPH_TAG)  # once nothing can refuse it: sleep() releases every tag listed
            self._pools.setdefault(GRAPH_TAG, [pool_entry(GRAPH_TAG)])  # vLLM's one graph pool
        before, self.current_tag = self.current_tag, GRAPH_TAG
        try:
            # The region opens before the capture: the private pool takes its tag when capture begins.
            with torch_budget.region(GRAPH_TAG, route="vmm"):
                yield pool
        finally:
            self.current_tag = before

    cudagraph_pool = use_cudagraph_pool  # the name in other vLLM versions

    def release_cudagraph_pool(self, pool: Optional[tuple[int, int]] = None) -> None:
        """Once the graphs captured into `pool` (None: this allocator's graph pool) are destroyed, their
        memory goes back to the driver, and the next capture starts from a fresh pool."""
        with self._lock:
            if pool is None or pool == self._graph_pool:
                self._graph_pool = None
            if GRAPH_TAG in self._tags and torch_budget.installed() and GRAPH_TAG not in sleep.released_tags():
                gc.collect()  # graphs vLLM dropped but the collector holds
                torch_budget.empty_cache(device="all", tags=GRAPH_TAG)

    def _known(self) -> list[str]:
        with self._lock:
            return list(self._tags)

    def _allocations(self) -> list[_Allocation]:
        asleep = sleep.released_tags()
        return [_Allocation(t, t in asleep) for t in self._tags]

    def _release(self, wanted: dict[str, str], verb: str, discardable: list[int] = ()) -> None:
        """Releases each tag of `wanted` (tag -> backup) that is live, the offloaded ones without a copy of
        the allocations in `discardable` (Note [Discardable blocks]); all or nothing."""
        if not wanted:
            return
        _install("torch_budget's CuMemAllocator was used")
        if not allocated_anywhere():  # nothing to release yet, as vLLM's allocator has no allocation then
            return
        with self._lock:
            asleep = sleep.released_tags()
            kept = sorted(t for t, b in wanted.items() if t in asleep and (asleep[t] == _DISCARD) != (b == _DISCARD))
            if kept:
                logger.warning("CuMemAllocator: %s cannot change the backup of tags already asleep (%s); "
                               "they keep theirs", verb, ", ".join(kept))
            live = {t: b for t, b in wanted.items() if t not in asleep}
            hooks = _vllm_tag_hooks()
            if hooks and live:
                hooks[0](self._allocations(), list(live))
            done: list[str] = []
            try:
                for backup in (_OFFLOAD, _DISCARD):
                    group = [t for t, b in live.items() if b == backup]
                    if group:
                        extra = {"discardable": discardable} if backup == _OFFLOAD and WEIGHTS_TAG in group else {}
                        torch_budget.release(group, backup=backup, device="all", **extra)
                        done += group
                        if extra:
                            self._discarded = frozenset(discardable)
            except BaseException:
                if done:  # all or nothing, as one release() is
                    with contextlib.suppress(TorchBudgetError):
                        torch_budget.restore(done, device="all")
                if hooks and live:  # the before-unmap hooks ran: the memory is mapped again, so the after-map ones run
                    with contextlib.suppress(Exception):
                        hooks[1](self._allocations())
                raise



class TorchBudgetBackend:
    """vLLM's sleep-mode backend interface (vllm.device_allocator.sleep_mode_backend.SleepModeBackend)
    over CuMemAllocator, behaving as vLLM's "cumem" backend does. Registered as "torch_budget"."""

    def __init__(self, **options):
        if _not_installed and not torch_budget.installed():  # register() could not install
            raise InstallError(f"the torch_budget sleep-mode backend cannot serve this process: {_not_installed[-1]}")
        if options:
            raise UnsupportedError(f"sleep_mode_backend_options {sorted(options)}: the torch_budget backend takes "
                                   "none; torch_budget's own settings come from TORCH_BUDGET_CONF")
        self._state = "RUNNING"

    def suspend(self, discardable: Collection[int] = (), *, level: Optional[int] = None) -> None:
        """As vLLM's cumem backend: the weights, the runtime state and the graphs keep a pinned host copy,
        the rest (KV cache, workspaces) is discarded. vLLM 0.34 passes `discardable`, the storage addresses
        of the parameters a level-2 sleep's weight update rewrites; vLLM 0.33 passed the level instead
        (suspend(level=1): 1 keeps the weights, 2 discards them), positionally or by its keyword, which
        is taken here too."""
        if level is not None:
            if discardable != ():
                raise TypeError("suspend() takes discardable or level, not both")
            discardable = level
        allocator = CuMemAllocator.get_instance()
        if isinstance(discardable, int) and not isinstance(discardable, bool):
            level = discardable
            if level not in (1, 2):
                raise InvalidArgumentError(f"sleep level must be 1 or 2, got {level}")
            allocator.sleep(offload_tags=((WEIGHTS_TAG,) if level == 1 else ()) + _KEPT_AT_EVERY_LEVEL)
        else:
            allocator.sleep((WEIGHTS_TAG,) + _KEPT_AT_EVERY_LEVEL, discardable)  # sleep() checks the addresses
        self._state = "SUSPENDED"

    def resume(self, tags: Optional[list[str]] = None) -> None:
        self._state = "RESUMING"
        try:
            CuMemAllocator.get_instance().wake_up(tags)  # frees the host pool where vLLM asks for it
        except BaseException:
            self._state = "SUSPENDED"
            raise
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        CuMemAllocator.get_instance().discard(tags)
        self._state = "SUSPENDED"

    def state(self) -> str:
        return self._state

    @classmethod
    def is_supported(cls) -> bool:
        try:
            return diagnostics.capabilities()["vmm"]
        except (TorchBudgetError, OSError):
            return False

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # NCCL's buffers are untagged: a sleep leaves them

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        return False

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        return False

    @classmethod
    def supports_durable_storage(cls) -> bool:
        return False

    @classmethod
    def supports_selective_offload(cls) -> bool:
        return False


def _release_host_memory() -> bool:
    """vLLM's VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY, read through vllm.envs (False without vLLM)."""
    try:
        envs = importlib.import_module("vllm.envs")
    except ImportError:
        return False
    return bool(getattr(envs, "VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY", False))


install_at_import(lambda: _install("importing torch_budget.adapters.vllm"))
