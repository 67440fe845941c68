"""The allocator front: install(), route/tag scopes, the ledger, torch compatibility.

`install()` swaps torch's CUDA allocator for torch_budget's compiled one. It must run
before the first CUDA allocation of the process; afterwards torch's own calls
(memory_stats, memory_allocated, empty_cache, set_per_process_memory_fraction,
memory_snapshot, CUDA graph capture) answer from torch_budget's ledger. Settings are
described in torch_budget.config.
"""
from __future__ import annotations

import contextlib
import threading

from . import _native, config
from ._native import TorchBudgetError

_lock = threading.Lock()
_state = {"installed": False, "settings": None}

__all__ = ["install", "installed", "route", "stats", "segments", "empty_cache", "trim_tag", "set_budget",
           "capabilities", "route_for", "TorchBudgetError"]


def capabilities(device=0) -> dict:
    """What the driver offers on `device`: VMM, memory pools, VMM granularity, total bytes."""
    lib = _native.load()
    out = (_native.ctypes.c_int64 * 4)()
    _native.check(lib, lib.tb_capabilities(int(device), out))
    return {"vmm": bool(out[0]), "pools": bool(out[1]), "granularity": int(out[2]), "total_bytes": int(out[3])}


def route_for(route: str = "vmm", device=0) -> str:
    """The route an allocation asking for `route` gets on `device` (the core's fallback rule:
    VMM, else the stream-ordered pool, else synchronous)."""
    lib = _native.load()
    got = lib.tb_route_for(int(device), config.ROUTES[config.check_route(route)])
    if got < 0:
        raise _native.error(lib, -got)
    return {v: k for k, v in config.ROUTES.items()}[got]


def install(budget=None, route=None, reuse_before_grow=None, host_pool=None, map_run=None) -> dict:
    """Makes torch_budget serve every CUDA allocation of this process.

    budget: bytes (int or "40GiB") or a fraction of the card (0.9); None = the card.
    route: "vmm", "pool", "sync" or None/"auto" (VMM > pool > sync by what each device supports).
    host_pool: bytes (int or "8GiB") of pinned host memory to pin now for sleep backups
    (torch_budget.reserve_host_pool), so that no release has to pin; None = none yet.
    map_run: bytes (int or "16MiB", at least 2 MiB) of the longest VMM mapping one allocation
    makes; None = 16 MiB. Shorter packs tighter, longer maps with fewer driver calls.
    Arguments left None come from TORCH_BUDGET_CONF. Must run before the first CUDA allocation;
    raises RuntimeError otherwise. Returns the settings in force.
    """
    import torch

    env = config.from_environment()
    budget = env.get("budget") if budget is None else budget
    parsed = config.parse_budget(budget)
    route = config.check_route(env.get("route") if route is None else route)
    reuse = env.get("reuse_before_grow", True) if reuse_before_grow is None else bool(reuse_before_grow)
    host_bytes = env.get("host_pool", 0) if host_pool is None else config.parse_host_pool(host_pool)
    run_bytes = env.get("map_run", 0) if map_run is None else config.parse_map_run(map_run)
    requested = (budget, route, reuse, host_bytes, run_bytes)
    with _lock:
        if _state["installed"]:
            if _state["settings"]["requested"] != requested:
                raise RuntimeError("torch_budget is already installed with other settings; "
                                   "change the budget with torch_budget.set_budget()")
            return dict(_state["settings"])
        if not torch.cuda.is_available():
            raise RuntimeError("torch_budget.install() needs a CUDA device, and torch sees none")
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "torch's CUDA allocator is already initialised: call torch_budget.install() at process start, "
                "before the first CUDA tensor is created (and before torch.cuda.init() or any CUDA call)")
        lib = _native.load()
        asked = "vmm" if route == config.AUTO else route
        budget_bytes, fraction = -1, -1.0
        if parsed is not None:
            kind, value = parsed
            budget_bytes, fraction = (value, -1.0) if kind == "bytes" else (-1, value)
        _native.check(lib, lib.tb_configure(budget_bytes, fraction, config.ROUTES[asked], int(reuse), run_bytes))
        _native.check(lib, lib.tb_torch_install())
        _state["installed"] = True
        if host_bytes > 0:
            _native.check(lib, lib.tb_host_pool_reserve(host_bytes))
        _state["settings"] = {"route": route_for(asked, 0), "budget_bytes": budget_bytes if budget_bytes >= 0 else None,
                              "budget_fraction": fraction if fraction > 0 else None,
                              "reuse_before_grow": reuse, "host_pool": host_bytes,
                              "map_run": run_bytes or (16 << 20),
                              "capabilities": capabilities(0), "requested": requested}
        return dict(_state["settings"])


def installed() -> bool:
    """Whether torch_budget serves this process's CUDA allocations."""
    if not _state["installed"]:
        return False
    return bool(_native.load().tb_torch_installed())


@contextlib.contextmanager
def route(route=None, tag=None):
    """Scoped, nestable, per-thread: allocations inside go through `route` and are
    charged to `tag` (e.g. `with torch_budget.route("vmm", tag="kv"):`).

    route=None keeps the enclosing route, tag=None keeps the enclosing tag. Without
    install() the scope only validates its arguments: torch's allocator is in charge.
    """
    route_id = -1 if route is None else config.ROUTES[_known_route(route)]
    if tag is not None and (not isinstance(tag, str) or not tag):
        raise ValueError(f"tag must be a non-empty string, got {tag!r}")
    if not installed():
        yield
        return
    lib = _native.load()
    tag_id = -1
    if tag is not None:
        tag_id = lib.tb_tag_id(tag.encode())
        if tag_id < 0:
            raise _native.error(lib, -tag_id)
    _native.check(lib, lib.tb_push_scope(route_id, tag_id))
    try:
        yield
    finally:
        _native.check(lib, lib.tb_pop_scope())


def _known_route(name) -> str:
    if name not in config.ROUTES:
        raise ValueError(f"unknown route {name!r}: expected one of {', '.join(config.ROUTES)}")
    return name


def _device_index(device) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device!r}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _require_installed(what: str):
    if not installed():
        raise RuntimeError(f"{what} needs torch_budget.install() first")
    return _native.load()


def stats(device=None) -> dict:
    """The ledger of one device.

    Keys: allocated, reserved, peak_allocated, peak_reserved, budget (None = card),
    total, graph_pools, by_route {name: {allocated, reserved, peak_allocated, count}},
    by_tag {name: {allocated, requested, peak_allocated, count, state (live | released | restoring),
    resident (device bytes mapped behind it), released (bytes awaiting restore), backup, backup_bytes}},
    raw (every counter). Reserved and the budget count resident memory only.
    """
    lib = _require_installed("torch_budget.stats()")
    raw = _native.read_json(lib, lib.tb_stats_json, _device_index(device))
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
                          "peak_allocated": t["allocated"]["peak"], "count": t["count"], "state": t["state"],
                          "resident": t["resident"], "released": t["released"], "backup": t["backup"],
                          "backup_bytes": t["backup_bytes"]}
                   for name, t in raw["tags"].items()},
        "raw": raw,
    }


def segments(device=None) -> list:
    """Every segment torch_budget holds on `device`, with its blocks."""
    lib = _require_installed("torch_budget.segments()")
    return _native.read_json(lib, lib.tb_segments_json, _device_index(device))


def empty_cache(device=None) -> None:
    """Returns cached memory of `device` to the driver."""
    lib = _require_installed("torch_budget.empty_cache()")
    _native.check(lib, lib.tb_empty_cache(_device_index(device)))


def trim_tag(tag: str, device=None) -> int:
    """Gives the cached memory of `tag`'s own VMM pool on `device` back to the driver at
    once (after waiting for the streams its freed blocks were used on). Returns the bytes
    returned; 0 for a tag never used on the VMM route."""
    lib = _require_installed("torch_budget.trim_tag()")
    tag_id = lib.tb_tag_find(tag.encode()) if isinstance(tag, str) else -1
    if tag_id < 0:
        raise ValueError(f"unknown tag {tag!r}")
    out = _native.ctypes.c_int64()
    _native.check(lib, lib.tb_trim_tag(_device_index(device), tag_id, _native.ctypes.byref(out)))
    return int(out.value)


def set_budget(budget, device=None) -> None:
    """Sets the hard budget of `device` (bytes, "40GiB" or a fraction of the card).

    Raises ValueError when it is below what is allocated now.
    """
    lib = _require_installed("torch_budget.set_budget()")
    parsed = config.parse_budget(budget)
    if parsed is None:
        raise ValueError("budget must be given")
    kind, value = parsed
    bytes_, fraction = (value, -1.0) if kind == "bytes" else (-1, value)
    _native.check(lib, lib.tb_set_budget(_device_index(device), bytes_, fraction))
