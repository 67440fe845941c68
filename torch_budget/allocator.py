"""The allocator front: install(), region scopes, the ledger, the budget.

`install()` swaps torch's CUDA allocator for torch_budget's compiled one. It must run
before the first CUDA allocation of the process; afterwards torch's own calls
(memory_stats, memory_allocated, empty_cache, set_per_process_memory_fraction,
memory_snapshot, CUDA graph capture) answer from torch_budget's ledger. Settings are
described in torch_budget.config; `device` arguments follow one rule (None: the current
device; see torch_budget._runtime).
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypedDict

from . import _deprecation, _native, _runtime, _scope, config
from ._validate import INT64_MAX, tag_name, tag_names
from ._runtime import Device, Tags
from .diagnostics import Capabilities, capabilities, route_for
from .errors import ConfigError, InstallError, InvalidArgumentError, StateError
from .units import format_bytes

__all__ = ["install", "installed", "region", "stats", "empty_cache", "set_budget", "Settings", "Stats",
           "RouteStats", "TagStats"]



class Settings(TypedDict):
    """What install() put in force."""
    route: str | None  # the route device 0 serves by default: vmm, pool or sync (None: the driver not started)
    budget_bytes: int | None  # a budget in bytes, or None
    budget_fraction: float | None  # a budget as a fraction of each card, or None (None and None: the card)
    reuse_before_grow: bool
    host_pool: int  # bytes of pinned host memory reserved for sleep backups
    map_run: int  # bytes of the longest VMM mapping one allocation makes
    packing_time: float  # the share of wall-clock time moving memory to pack it may take
    budgets: dict[str, tuple]  # per-tag budgets, {tag: ("bytes", n) or ("fraction", f)}
    capabilities: Capabilities | None  # of device 0 (None: the driver not started, install(start_driver=False))


class RouteStats(TypedDict):
    allocated: int
    reserved: int
    peak_allocated: int
    count: int


class TagStats(TypedDict):
    allocated: int
    requested: int
    peak_allocated: int
    count: int  # allocations served, cumulative
    allocations: int  # live allocations
    state: str  # live | released | restoring
    resident: int  # device bytes mapped behind the tag, graph pools included
    released: int  # bytes waiting to be restored
    backup: str | None  # backup mode of the last release
    backup_bytes: int  # host bytes holding its backup
    retained: bool  # a live tag keeps its backup for the next release (sleep.release(retain=True))
    budget: int | None  # the tag's own budget in bytes (Note [Tag budgets]); None: none
    headroom: int | None  # budget - allocated (its family's, Note [Tag families]); None without a budget


class Stats(TypedDict):
    """The ledger of one device (torch_budget.stats())."""
    device: int
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    budget: int | None  # None: the whole card
    total: int
    graph_pools: int
    by_route: dict[str, RouteStats]
    by_tag: dict[str, TagStats]
    raw: dict[str, Any]  # every counter the core keeps


@dataclass(frozen=True)
class _Requested:
    """install()'s settings after parsing, so that two spellings of one setting compare equal."""
    budget: tuple | None  # ("bytes", n), ("fraction", f) or None (the card); see config.parse_budget
    route: str  # vmm | pool | sync | auto
    reuse_before_grow: bool
    host_pool: int
    map_run: int
    packing_time: float
    budgets: dict  # {tag: parsed budget}

    def shown(self, name: str) -> str:
        value = getattr(self, name)
        if name == "budgets":
            return "{" + ", ".join(f"{t!r}: {config.format_budget(b)}" for t, b in sorted(value.items())) + "}"
        if name == "budget":
            if value is None:
                return "the whole card"
            kind, amount = value
            return f"{amount:g} of the card" if kind == "fraction" else f"{format_bytes(amount)} ({amount} bytes)"
        if name in ("host_pool", "map_run"):
            return f"{format_bytes(value)} ({value} bytes)"
        return repr(value)


_DEFAULTS = {"budget": None, "budgets": {}, "route": config.AUTO, "reuse_before_grow": True, "host_pool": 0,
             "map_run": config.MAP_RUN_DEFAULT, "packing_time": config.PACKING_TIME_DEFAULT}

_lock = threading.Lock()  # guards _in_force and _settings: install() runs once
_in_force: _Requested | None = None
_settings: Settings | None = None


@contextlib.contextmanager
def _config_errors() -> Iterator[None]:
    """config's parsers raise ValueError; torch_budget's own class for a refused setting is ConfigError."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _parse_setting(name: str, value, source: str | None = None):
    """One install() setting, parsed by config's parser for it."""
    source = source or name
    with _config_errors():
        if name in ("budget", "tag budget"):
            return config.parse_budget(value, source, tag=name == "tag budget")
        if name == "route":
            return config.check_route(value, source)
        if name == "host_pool":
            return config.parse_host_pool(value, source)
        if name == "map_run":
            return config.parse_map_run(value, source)
        if name == "packing_time":
            return config.parse_packing_time(value, source)
        if name == "budgets":
            return config.parse_budgets(value, source)
        if not isinstance(value, bool):  # "false" or 0.5 would pass as true
            raise ConfigError(f"{source} must be True or False, got {value!r}")
        return value


def _from_environment() -> dict:
    with _config_errors():
        env = config.from_environment()
    return {name: _parse_setting(name, value, f"{config.ENV_VAR} {name}") for name, value in env.items()}


def install(budget: int | float | str | None = None, route: str | None = None, reuse_before_grow: bool | None = None,
            host_pool: int | str | None = None, map_run: int | str | None = None,
            budgets: dict[str, int | float | str] | None = None, packing_time: float | None = None, *,
            start_driver: bool = True) -> Settings:
    """Makes torch_budget serve every CUDA allocation of this process.

    budget: bytes (int or "40GiB") or a fraction of the card (0.9); None = the card.
    route: "vmm", "pool", "sync" or "auto" (VMM > pool > sync by what each device supports).
    host_pool: bytes (int or "8GiB") of pinned host memory to pin now for sleep backups
    (torch_budget.sleep.reserve_host_pool), so that no release has to pin; None = none yet.
    map_run: bytes (int or "16MiB", at least 2 MiB) of the longest VMM mapping one allocation
    makes; None = 16 MiB. Shorter packs tighter, longer maps with fewer driver calls.
    packing_time: the share of wall-clock time in [0, 1] that moving memory to keep reserved
    within 2 % of the peak may take; None = 0.03. A tight loop of large churn past it packs
    looser instead of slower; 1 packs whatever it costs, 0 moves nothing before the budget refuses.
    budgets: {tag: budget} of per-tag budgets (each as `budget` takes it), on every device:
    an allocation under a tag that would pass its budget raises OutOfMemoryError naming the
    tag, while the other tags keep serving (TORCH_BUDGET_CONF: budget.<tag>:<budget>).

    start_driver: False leaves the CUDA driver to the first allocation, so that this process can
    still fork children that use CUDA (once the driver started, a forked child cannot start it:
    Note [Installing without the driver], csrc/bridge/torch_allocator.cpp). The settings' route
    and capabilities are then None, and host_pool is not pinned, until an install() call that
    starts the driver (a release pins what it needs otherwise).

    Arguments left None come from TORCH_BUDGET_CONF, else the defaults; `budgets` does so per
    tag (a tag the call does not name keeps its budget.<tag> from the variable). Must run before the
    first CUDA allocation; raises InstallError otherwise. A later call compares the arguments
    it gives, after parsing ("60GiB" and 60 << 30 are one budget), with the settings in force:
    equal ones return those settings, others raise InstallError naming both (the budget can
    still change with torch_budget.set_budget()). A bad setting raises ConfigError. Returns
    the settings in force.
    """
    global _in_force, _settings
    if not isinstance(start_driver, bool):
        raise TypeError(f"start_driver must be True or False, got {type(start_driver).__name__} ({start_driver!r})")
    given = {"budget": budget, "route": route, "reuse_before_grow": reuse_before_grow, "host_pool": host_pool,
             "map_run": map_run, "budgets": budgets, "packing_time": packing_time}
    asked = {name: _parse_setting(name, value) for name, value in given.items() if value is not None}
    with _lock:
        if _in_force is not None:
            if "budgets" in asked:  # per tag, as at the first call: tags not given keep theirs
                asked["budgets"] = {**_in_force.budgets, **asked["budgets"]}
            differ = [name for name, value in asked.items() if getattr(_in_force, name) != value]
            if differ:
                wanted = _Requested(**{**vars(_in_force), **asked})
                raise InstallError(
                    "torch_budget is already installed with " +
                    ", ".join(f"{n} {_in_force.shown(n)}" for n in differ) + "; this call asks for " +
                    ", ".join(f"{n} {wanted.shown(n)}" for n in differ) +
                    ". The budget can change with torch_budget.set_budget(); the other settings hold for the process")
            if start_driver and _settings["capabilities"] is None:
                _start_driver(_runtime.library(), _in_force)
            return _settings.copy()
        env = _from_environment()
        if "budgets" in asked:  # per tag: budget.<tag> keys of TORCH_BUDGET_CONF the call does not name stay
            asked["budgets"] = {**env.get("budgets", {}), **asked["budgets"]}
        wanted = _Requested(**{**_DEFAULTS, **env, **asked})
        _runtime.check_can_install()
        lib = _runtime.library()
        budget_bytes, fraction = _for_core(wanted.budget)
        route_id = config.ROUTES["vmm" if wanted.route == config.AUTO else wanted.route]
        _native.check(lib, lib.tb_configure(budget_bytes, fraction, route_id, int(wanted.reuse_before_grow),
                                            wanted.map_run))
        _native.check(lib, lib.tb_configure_packing_time(wanted.packing_time))
        for tag, tag_budget in wanted.budgets.items():
            _native.check(lib, lib.tb_configure_tag_budget(_tag_id(lib, tag), *_for_core(tag_budget)))
        _native.check(lib, lib.tb_torch_install() if start_driver else lib.tb_torch_install_deferred())
        _runtime.mark_installed()
        _in_force = wanted
        _settings = {"route": None, "budget_bytes": budget_bytes if budget_bytes >= 0 else None,
                     "budget_fraction": fraction if fraction > 0 else None,
                     "reuse_before_grow": wanted.reuse_before_grow, "host_pool": wanted.host_pool,
                     "map_run": wanted.map_run, "packing_time": wanted.packing_time,
                     "budgets": dict(wanted.budgets), "capabilities": None}
        if start_driver:
            _start_driver(lib, wanted)
        return _settings.copy()


def requested_route() -> str | None:
    """The route install() was asked for ("auto", "vmm", "pool" or "sync"), read without starting
    the driver; None before install()."""
    return None if _in_force is None else _in_force.route


def _start_driver(lib, wanted: _Requested) -> None:
    """What install() does with the driver: device 0's route and capabilities, the host pool.
    Under _lock."""
    _settings["route"] = route_for(wanted.route, 0)
    _settings["capabilities"] = capabilities(0)
    if wanted.host_pool > 0:
        _native.check(lib, lib.tb_host_pool_reserve(wanted.host_pool))


def _for_core(parsed: tuple | None) -> tuple[int, float]:
    """A parsed budget as the core takes one: (bytes, -1.0), (-1, fraction), or (-1, -1.0) for none."""
    if parsed is None:
        return -1, -1.0
    kind, value = parsed
    return (value, -1.0) if kind == "bytes" else (-1, value)


def _tag_id(lib, tag: str) -> int:
    """The core's id of tag `tag` (registered on first use)."""
    tag_id = lib.tb_tag_id(tag.encode())
    if tag_id < 0:
        raise _native.error(lib, -tag_id)
    return tag_id


def installed() -> bool:
    """Whether torch_budget serves this process's CUDA allocations."""
    return _runtime.installed()


def _route_id(route) -> int:
    name = _parse_setting("route", route)
    return config.ROUTES["vmm" if name == config.AUTO else name]


def set_default_tag(tag: str | None) -> None:
    """Charges every allocation made outside all region() scopes, on every thread, to `tag`
    (None: untagged again), as if the whole process ran inside region(tag). Memory under a tag
    can be released only on the VMM route: install()'s route must be "vmm" (or "auto" on a
    device with VMM) for it to sleep. region("untagged") opens an untagged scope inside."""
    lib = _runtime.require_installed("torch_budget.allocator.set_default_tag()")
    tag_id = 0 if tag is None else _tag_id(lib, tag_name(tag))
    _native.check(lib, lib.tb_set_default_tag(tag_id))


_regions = threading.local()  # .open: the region() scopes this thread is inside, innermost last
# Scopes whose end region() refused (out of order, or from another thread): each ends as soon as it
# is the innermost scope of its thread again.
_refused_ends: set[object] = set()


def _end_refused(lib, scopes) -> None:
    while scopes and scopes[-1][0] in _refused_ends:
        _refused_ends.discard(scopes.pop()[0])
        _native.check(lib, lib.tb_pop_scope())


def _shown(tag) -> str:
    return "region()" if tag is None else f"region({tag!r})"


@_scope.once(lambda tag=None, route=None: _shown(tag))
def region(tag: str | None = None, route: str | None = None) -> Iterator[None]:
    """`with torch_budget.region("kv"):` charges the allocations inside to tag "kv" (and
    `route="vmm"` sends them through that route). Scoped, nestable, per thread.

    tag=None keeps the enclosing tag (untagged outside every region); route=None keeps the
    enclosing route (install()'s default outside). route takes install()'s names: "vmm",
    "pool", "sync", or "auto" (VMM, else pool, else sync, by what the device supports).
    Memory under a tag on the VMM route can be released and restored (torch_budget.release).
    Without install() the scope only checks its arguments: torch's allocator is in charge.
    Scopes end innermost first, on the thread that opened them. Ending one while a scope opened
    inside it is still open (asyncio tasks interleaving regions on one thread do), or on another
    thread, raises StateError; the allocations keep the inner scope's tag, and the refused scope
    ends as soon as every scope opened inside it has (on another thread: when its own thread next
    opens or ends a region), so that no scope stays open for good.
    """
    route_id = -1 if route is None else _route_id(route)
    if tag is not None:
        tag_name(tag)
    if not _runtime.installed():
        yield
        return
    lib = _runtime.library()
    tag_id = -1 if tag is None else _tag_id(lib, tag)
    scopes = _regions.__dict__.setdefault("open", [])
    _end_refused(lib, scopes)
    _native.check(lib, lib.tb_push_scope(route_id, tag_id))
    mine = object()
    scopes.append((mine, tag))
    try:
        yield
    finally:
        scopes = _regions.__dict__.setdefault("open", [])
        _end_refused(lib, scopes)  # those inside it ended from another thread end first
        if not any(token is mine for token, _ in scopes):
            _refused_ends.add(mine)
            raise StateError(f"{_shown(tag)} is ended on a thread that did not open it: a scope belongs to its thread "
                             "(it ends when that thread next opens or ends a region)")
        if scopes[-1][0] is not mine:
            _refused_ends.add(mine)
            raise StateError(f"{_shown(tag)} is ended while {_shown(scopes[-1][1])}, opened inside it, is still open: "
                             "end the inner scope first (this one ends once it has)")
        scopes.pop()
        _native.check(lib, lib.tb_pop_scope())
        _end_refused(lib, scopes)


def route(route: str | None = None, tag: str | None = None) -> contextlib.AbstractContextManager[None]:
    """Deprecated: `torch_budget.region(tag=..., route=...)`, the tag first."""
    _deprecation.warn("torch_budget.route()", "write torch_budget.region(tag=..., route=...) (the tag comes first)")
    return region(tag=tag, route=route)


def stats(device: Device = None) -> Stats:
    """The ledger of `device` (None: the current device).

    Keys: allocated, reserved, peak_allocated, peak_reserved, budget (None = card),
    total, graph_pools, by_route {name: {allocated, reserved, peak_allocated, count}},
    by_tag {name: {allocated, requested, peak_allocated, count (allocations served, cumulative),
    allocations (live ones), state (live | released | restoring), resident (device bytes mapped behind it), released (bytes awaiting restore), backup, backup_bytes,
    budget (the tag's own, None: none), headroom (budget - allocated: for a tag X, what X and
    every X+<suffix> tag hold together, which its budget bounds)}},
    raw (every counter). Reserved and the budget count resident memory only.
    """
    lib = _runtime.require_installed("torch_budget.stats()")
    raw = _native.read_json(lib, lib.tb_stats_json, _runtime.device_index(device))
    held = {name: t["allocated"]["current"] for name, t in raw["tags"].items()}
    return {
        "device": raw["device"],
        "allocated": raw["allocated_bytes"]["all"]["current"],
        "reserved": raw["reserved_bytes"]["all"]["current"],
        "peak_allocated": raw["allocated_bytes"]["all"]["peak"],
        "peak_reserved": raw["reserved_bytes"]["all"]["peak"],
        "budget": None if raw["budget"] < 0 else raw["budget"],
        "total": raw["total"],
        "graph_pools": raw["graph_pool_reserved"]["current"],
        "by_route": {name: {"allocated": r["allocated"]["current"], "reserved": r["reserved"]["current"],
                            "peak_allocated": r["allocated"]["peak"], "count": r["count"]}
                     for name, r in raw["routes"].items()},
        "by_tag": {name: {"allocated": t["allocated"]["current"], "requested": t["requested"]["current"],
                          "peak_allocated": t["allocated"]["peak"], "count": t["count"],
                          "allocations": t["allocations"]["current"], "state": t["state"],
                          "resident": t["resident"], "released": t["released"], "backup": t["backup"],
                          "backup_bytes": t["backup_bytes"], "retained": bool(t["retained"]),
                          "budget": None if t["budget"] < 0 else t["budget"],
                          "headroom": None if t["budget"] < 0 else t["budget"] - family_allocated(held, name)}
                   for name, t in raw["tags"].items()},
        "raw": raw,
    }


def family_head(tag: str) -> str | None:
    """The tag whose budget also bounds `tag`: "kv" for "kv+cpu" (Note [Tag families] in the core);
    None for a name without '+', or one that starts with it."""
    head, plus, _ = tag.partition("+")
    return head if plus and head else None


def family_allocated(allocated: dict[str, int], tag: str) -> int:
    """What tag `tag` counts against its budget, from {tag: allocated bytes}: its own, and for a name
    that heads a family that of every "<tag>+<suffix>" tag too."""
    if family_head(tag) is not None:
        return allocated.get(tag, 0)
    return sum(n for name, n in allocated.items() if name == tag or family_head(name) == tag)


def _trim(lib, device: int, tag_id: int) -> int:
    """Empties tag `tag_id`'s own VMM pool on `device`; the bytes given back (0 for a tag never on VMM)."""
    out = _native.ctypes.c_int64()
    _native.check(lib, lib.tb_trim_tag(device, tag_id, _native.ctypes.byref(out)))
    return int(out.value)


def empty_cache(device: Device = None, tags: Tags = None) -> None:
    """Returns cached memory of `device` (None: the current device; "all": every device) to
    the driver. With `tags` (a name or names; None: every cache), only those tags' own VMM
    pools are emptied, after waiting for the streams their freed blocks were used on."""
    lib = _runtime.require_installed("torch_budget.empty_cache()")
    names = tag_names(tags)
    # Every tag is known before any is emptied: a refused call changes nothing.
    ids = None if names is None else [_native.known_tag(lib, name) for name in names]
    for dev in _runtime.device_indices(lib, device):
        if ids is None:
            _native.check(lib, lib.tb_empty_cache(dev))
        else:
            for tag_id in ids:
                _trim(lib, dev, tag_id)


def trim_tag(tag: str, device: Device = None) -> int:
    """Deprecated: torch_budget.empty_cache(tags=tag, device=device). Returns the bytes returned."""
    _deprecation.warn("torch_budget.trim_tag()", "write torch_budget.empty_cache(tags=tag, device=device)")
    lib = _runtime.require_installed("torch_budget.empty_cache()")
    return _trim(lib, _runtime.device_index(device), _native.known_tag(lib, tag_name(tag)))


def _set_on_every_device(lib, devices, read, write, value, none) -> None:
    """write(dev, (bytes, fraction)) on each device in turn. When one refuses, those already set
    get back what read(dev) gave before (bytes, or None for no budget: `none` bytes to the core),
    which raising a budget never refuses: a refused call changes no device's budget."""
    done = []
    try:
        for dev in devices:
            before = read(dev)
            _native.check(lib, write(dev, value))
            done.append((dev, before))
    except BaseException:
        for dev, before in reversed(done):
            _native.check(lib, write(dev, (none if before is None else before, -1.0)))
        raise


def _for_later_devices(lib, device, tag_id: int, value, set_now) -> None:
    """set_now(); with device="all", `value` is first made the budget (tag_id < 0) or the tag's
    budget of every device that serves its first allocation later, put back if set_now() raises."""
    if not _runtime.is_all(device):
        set_now()
        return
    was_bytes, was_fraction = ctypes.c_int64(), ctypes.c_double()
    _native.check(lib, lib.tb_set_later_budget(tag_id, *value, ctypes.byref(was_bytes), ctypes.byref(was_fraction)))
    try:
        set_now()
    except BaseException:
        lib.tb_set_later_budget(tag_id, was_bytes.value, was_fraction.value, ctypes.byref(was_bytes),
                                ctypes.byref(was_fraction))
        raise


def set_budget(budget: int | float | str | None, device: Device = None, tag: str | None = None) -> None:
    """Sets the hard budget of `device` (None: the current device; "all": every device, those
    that serve their first allocation later included): bytes, "40GiB" or a fraction of the
    card. With `tag`, the budget of that tag alone
    (Note [Tag budgets]: what may be allocated under it, inside the device's budget);
    `budget=None` then removes the tag's budget, and `("bytes", 0)` lets nothing be allocated
    under the tag.

    Raises ConfigError for a budget that cannot be read, InvalidArgumentError (both
    ValueErrors) when it is below what is allocated now (under the tag, with `tag`).
    """
    lib = _runtime.require_installed("torch_budget.set_budget()")
    if tag is not None:
        # Everything is checked before the tag is registered: a refused call leaves no tag behind.
        name = tag_name(tag)
        bytes_, fraction = _for_core(None if budget is None else _parse_setting("tag budget", budget, "budget"))
        devices = _runtime.device_indices(lib, device)
        count = lib.tb_device_count()  # as tb_set_tag_budget would: it starts the driver either way
        if devices and 0 <= count <= max(devices):
            raise InvalidArgumentError(f"device {max(devices)} does not exist ({count} visible)")
        tag_id = _tag_id(lib, name)

        def tag_budget(dev):
            return stats(dev)["by_tag"].get(name, {}).get("budget")

        _for_later_devices(lib, device, tag_id, (bytes_, fraction), lambda: _set_on_every_device(
            lib, _runtime.device_indices(lib, device), tag_budget,
            lambda dev, value: lib.tb_set_tag_budget(dev, tag_id, *value), (bytes_, fraction), -1))
        return
    parsed = _parse_setting("budget", budget)
    if parsed is None:
        raise ConfigError("budget must be given: bytes, a size such as \"40GiB\", or a fraction of the card")
    bytes_, fraction = _for_core(parsed)
    _for_later_devices(lib, device, -1, (bytes_, fraction), lambda: _set_on_every_device(
        lib, _runtime.device_indices(lib, device), lambda dev: stats(dev)["budget"],
        lambda dev, value: lib.tb_set_budget(dev, *value), (bytes_, fraction), INT64_MAX))


__getattr__ = _deprecation.moved_names("torch_budget.allocator", {
    "segments": ("torch_budget.diagnostics", "segments"),
    "TorchBudgetError": ("torch_budget.errors", "TorchBudgetError"),
})
