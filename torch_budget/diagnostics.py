"""What the driver offers and what the allocator holds, for diagnosis (`torch-budget doctor`
prints them): each device's capabilities, the route an allocation would get there, and
every segment with its blocks.

The ledger itself is torch_budget.stats(); torch's memory snapshot with the ledger's names
is torch_budget.snapshot. `device` follows the package's rule: None is the current device.
"""
from __future__ import annotations

from typing import Any, TypedDict

from . import _native, _runtime, config
from ._runtime import Device

__all__ = ["Capabilities", "capabilities", "route_for", "segments"]

_ROUTE_NAMES = {v: k for k, v in config.ROUTES.items()}


class Capabilities(TypedDict):
    vmm: bool  # CUDA virtual memory management (the VMM route, release / restore of tags)
    pools: bool  # stream-ordered memory pools (the pool route)
    granularity: int  # bytes of one VMM granule
    total_bytes: int  # the card's memory


def capabilities(device: Device = None) -> Capabilities:
    """What the driver offers on `device` (None: the current device); needs no install()."""
    lib = _runtime.library()
    out = (_native.ctypes.c_int64 * 4)()
    _native.check(lib, lib.tb_capabilities(_runtime.device_index(device), out))
    return {"vmm": bool(out[0]), "pools": bool(out[1]), "granularity": int(out[2]), "total_bytes": int(out[3])}


def route_for(route: str = "auto", device: Device = None) -> str:
    """The route ("vmm", "pool" or "sync") an allocation asking for `route` gets on `device`
    (None: the current device) by the core's fallback rule: VMM, else the stream-ordered
    pool, else synchronous. "auto" asks for the first the device supports."""
    name = config.check_route(route)
    lib = _runtime.library()
    got = lib.tb_route_for(_runtime.device_index(device), config.ROUTES["vmm" if name == config.AUTO else name])
    if got < 0:
        raise _native.error(lib, -got)
    return _ROUTE_NAMES[got]


def segments(device: Device = None) -> list[dict[str, Any]]:
    """Every segment torch_budget holds on `device` (None: the current device), with its
    blocks, as the core reports them (csrc/core/ledger_json)."""
    lib = _runtime.require_installed("torch_budget.diagnostics.segments()")
    return _native.read_json(lib, lib.tb_segments_json, _runtime.device_index(device))
