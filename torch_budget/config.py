"""Settings of the allocator: a budget, a route, the granule-reuse switch.

They come from `torch_budget.install(...)` arguments, else from the environment
variable TORCH_BUDGET_CONF, written like PYTORCH_CUDA_ALLOC_CONF:

    TORCH_BUDGET_CONF="budget:40GiB,route:vmm"
    TORCH_BUDGET_CONF="budget:0.85"            (a fraction of the card)

Keys: budget (bytes with an optional unit -- B, KiB, MiB, GiB, TiB, or decimal KB,
MB, GB, TB -- or a fraction in (0, 1]), route (vmm | pool | sync | auto),
reuse_before_grow (true | false), map_run (bytes: the longest VMM mapping an allocation
makes, 16MiB by default; shorter packs tighter, longer maps faster), host_pool (bytes of
pinned host memory that install() pins for sleep backups, so that no release pins). An
error in the variable says it came from there.

A budget is one of two things, decided here and nowhere else in Python: ("bytes", n)
or ("fraction", f). The compiled core turns a fraction into bytes of each card.
"""
from __future__ import annotations

import os

from ._validate import is_int, non_negative_int
from .units import UNITS, parse_bytes, parse_size

ENV_VAR = "TORCH_BUDGET_CONF"
ROUTES = {"vmm": 0, "pool": 1, "sync": 2}  # csrc/core/ledger.h
AUTO = "auto"


def parse_budget(value, source: str = "budget"):
    """Bytes (int, or str with a unit) -> ("bytes", n); a fraction in (0, 1] -> ("fraction", f);
    None -> None. `source` names where the value came from in error messages."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{source} must be a number of bytes or a fraction of the card, got {value!r}")
    if is_int(value):
        value = value.__index__()
        if value < 0:
            raise ValueError(f"{source} must be >= 0 bytes, got {value}")
        return ("bytes", value)
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"{source}: a fractional budget must be in (0, 1], got {value}")
        return ("fraction", value)
    if isinstance(value, str):
        number, unit = parse_size(value, source)
        if unit == "" and "." in value:
            return parse_budget(number, source)
        return parse_budget(int(number * UNITS[unit]), source)
    raise TypeError(f"{source} must be an int, float or str, got {type(value).__name__}")


def parse_host_pool(value, source: str = "host_pool") -> int:
    """Bytes of the pinned host pool: an int >= 0, or a str with a unit ("8GiB")."""
    if isinstance(value, str):
        return parse_bytes(value, source)
    return non_negative_int(value, source)


MAP_RUN_MIN = 2 << 20


def parse_map_run(value, source: str = "map_run") -> int:
    """Bytes (an int or a str with a unit, "16MiB") of the longest VMM mapping an allocation
    makes; at least 2 MiB (a granule; longer values are rounded down to the device's)."""
    n = parse_bytes(value, source) if isinstance(value, str) else non_negative_int(value, source)
    if n < MAP_RUN_MIN:
        raise ValueError(f"{source} must be at least 2MiB (one VMM granule), got {n} bytes")
    return n


def check_route(route, source: str = "route") -> str:
    """The route name, "auto" for None; ValueError naming `source` for an unknown one."""
    if route is None:
        return AUTO
    if route != AUTO and route not in ROUTES:
        raise ValueError(f"{source}: unknown route {route!r}: expected one of {', '.join([*ROUTES, AUTO])}")
    return route


def _parse_bool(key: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_VAR}: {key} must be true or false, got {text!r}")


def parse_conf(text: str | None) -> dict:
    """A TORCH_BUDGET_CONF string as install() keyword arguments, each value checked."""
    out = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        if ":" not in item:
            raise ValueError(f"{ENV_VAR}: expected key:value, got {item!r}")
        key, value = (s.strip() for s in item.split(":", 1))
        if key == "budget":
            parse_budget(value, f"{ENV_VAR} budget")
            out["budget"] = value
        elif key == "route":
            out["route"] = check_route(value, f"{ENV_VAR} route")
        elif key == "reuse_before_grow":
            out["reuse_before_grow"] = _parse_bool(key, value)
        elif key == "host_pool":
            out["host_pool"] = parse_host_pool(value, f"{ENV_VAR} host_pool")
        elif key == "map_run":
            out["map_run"] = parse_map_run(value, f"{ENV_VAR} map_run")
        else:
            raise ValueError(f"{ENV_VAR}: unknown key {key!r} "
                             "(known: budget, route, reuse_before_grow, map_run, host_pool)")
    return out


def from_environment() -> dict:
    return parse_conf(os.environ.get(ENV_VAR, ""))
