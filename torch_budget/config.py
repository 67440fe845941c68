"""Settings of the allocator: a budget, a route, the granule-reuse switch.

They come from `torch_budget.install(...)` arguments, else from the environment
variable TORCH_BUDGET_CONF, written like PYTORCH_CUDA_ALLOC_CONF:

    TORCH_BUDGET_CONF="budget:40GiB,route:vmm"
    TORCH_BUDGET_CONF="budget:0.85"            (a fraction of the card)

Keys: budget (bytes with a unit -- B, KiB, MiB, GiB, TiB, or decimal KB, MB, GB, TB;
a bare number is bytes only from 1 MiB up -- or a fraction in (0, 1]), route (vmm | pool | sync | auto),
reuse_before_grow (true | false), map_run (bytes: the longest VMM mapping an allocation
makes, 16MiB by default; shorter packs tighter, longer maps faster), packing_time (the share
of wall-clock time in [0, 1] that moving memory to pack it may take, 0.03 by default), host_pool (bytes of
pinned host memory that install() pins for sleep backups, so that no release pins). An
error in the variable says it came from there; a key given twice is an error.

A budget is one of two things, decided here and nowhere else in Python: ("bytes", n)
or ("fraction", f). The compiled core turns a fraction into bytes of each card.
"""
from __future__ import annotations

import os

from ._validate import is_int, non_negative_int, tag_name
from .units import (BARE_BYTES_MIN, bare_number_message, check_max_bytes, format_bytes, memory_bytes, parse_bytes,
                    parse_size)

ENV_VAR = "TORCH_BUDGET_CONF"
ROUTES = {"vmm": 0, "pool": 1, "sync": 2}  # csrc/core/ledger.h
AUTO = "auto"


def _not_positive(source: str, value) -> str:
    return (f"{source} must be more than 0 bytes or a fraction of the card in (0, 1], got {value!r} "
            "(leave it unset for the whole card)")


def parse_budget(value, source: str = "budget", *, tag: bool = False):
    """A budget as ("bytes", n) or ("fraction", f); None -> None. `source` names where the
    value came from in error messages. One rule wherever a budget is given (install, set_budget,
    TORCH_BUDGET_CONF):

    - bytes: an int, or a str with a unit ("40GiB", "512 MiB", "60GB"); a bare number (an int,
      or a str without a unit) is bytes only from 1 MiB up, since `1` would be one byte;
    - a fraction of the card: a float, or a str with a decimal point ("0.9"), in (0, 1];
    - never 0 or negative: leave the budget unset for the whole card. A tag's budget (`tag`) may
      be ("bytes", 0), written out so: nothing may be allocated under the tag (a plan's line of
      0 bytes, Note [Plan as budgets]).

    A value this returns may be passed again and comes back unchanged.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{source} must be a number of bytes or a fraction of the card, got {value!r}")
    if isinstance(value, tuple) and len(value) == 2 and value[0] in ("bytes", "fraction"):
        kind, amount = value
        if kind == "bytes":
            if not is_int(amount):
                raise TypeError(f"{source} {value!r}: the bytes must be a whole number, got {type(amount).__name__}")
            if tag and amount == 0:
                return ("bytes", 0)
            if amount <= 0:
                raise ValueError(_not_positive(source, value))
            return ("bytes", check_max_bytes(amount.__index__(), source, value))
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise TypeError(f"{source} {value!r}: the fraction must be a number in (0, 1], got {type(amount).__name__}")
        return parse_budget(float(amount), source)
    if is_int(value):
        value = value.__index__()
        if value <= 0:
            raise ValueError(_not_positive(source, value))
        if value < BARE_BYTES_MIN:
            raise ValueError(bare_number_message(source, str(value), fraction=True))
        return ("bytes", check_max_bytes(value, source, value))
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"{source} {value!r} is read as a fraction of the card, which must be in (0, 1]; for "
                             "bytes give an int or a size with a unit, e.g. \"40GiB\"")
        return ("fraction", value)
    if isinstance(value, str):
        number, unit = parse_size(value, source)
        if unit == "" and "." in value:
            return parse_budget(number, source)
        if number <= 0:
            raise ValueError(_not_positive(source, value))
        return ("bytes", memory_bytes(value, source, fraction_hint=True))
    raise TypeError(f"{source} must be an int, float or str, got {type(value).__name__}")


def format_budget(parsed) -> str:
    """A parsed budget as people read it; None is the whole card."""
    if parsed is None:
        return "the whole card"
    kind, value = parsed
    if kind == "fraction":
        return f"{value:g} of the card"
    return f"{format_bytes(value)} ({value} bytes)"


def parse_host_pool(value, source: str = "host_pool") -> int:
    """Bytes of the pinned host pool: an int >= 0, or a str with a unit ("8GiB"); a bare number
    in a str is bytes only from 1 MiB up, as for budgets ("host_pool:64" meant 64 bytes)."""
    if isinstance(value, str):
        return memory_bytes(value, source, zero=True)
    return non_negative_int(value, source)


MAP_RUN_MIN = 2 << 20
MAP_RUN_DEFAULT = 16 << 20
PACKING_TIME_DEFAULT = 0.03  # csrc/core/packing_time.h, Note [Packing time]


def parse_map_run(value, source: str = "map_run") -> int:
    """Bytes (an int or a str with a unit, "16MiB") of the longest VMM mapping an allocation
    makes; at least 2 MiB (a granule; longer values are rounded down to the device's)."""
    n = parse_bytes(value, source) if isinstance(value, str) else non_negative_int(value, source)
    if n < MAP_RUN_MIN:
        raise ValueError(f"{source} must be at least 2MiB (one VMM granule), got {n} bytes")
    return n


def parse_packing_time(value, source: str = "packing_time") -> float:
    """The share of wall-clock time in [0, 1] the VMM route may spend moving memory to pack it
    (0: never before the budget refuses; 1: whenever the packing line asks)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{source} must be a number in [0, 1], got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{source} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_route(route, source: str = "route") -> str:
    """The route name, "auto" for None; ValueError naming `source` for an unknown one."""
    if route is None:
        return AUTO
    if not isinstance(route, str):
        raise TypeError(f"{source} must be a route name (str), got {type(route).__name__} ({route!r})")
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
    """A TORCH_BUDGET_CONF string as install() keyword arguments, each value parsed (the budget
    as parse_budget returns it)."""
    out = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        if ":" not in item:
            raise ValueError(f"{ENV_VAR}: expected key:value, got {item!r}")
        key, value = (s.strip() for s in item.split(":", 1))
        if key in out:
            raise ValueError(f"{ENV_VAR}: {key} is given twice")
        if key.startswith("budget."):
            tag = tag_name(key[len("budget."):], f"{ENV_VAR} {key}: the tag")
            if tag in out.get("budgets", {}):
                raise ValueError(f"{ENV_VAR}: {key} is given twice")
            out.setdefault("budgets", {})[tag] = parse_budget(value, f"{ENV_VAR} {key}")
        elif key == "budget":
            out["budget"] = parse_budget(value, f"{ENV_VAR} budget")
        elif key == "route":
            out["route"] = check_route(value, f"{ENV_VAR} route")
        elif key == "reuse_before_grow":
            out["reuse_before_grow"] = _parse_bool(key, value)
        elif key == "host_pool":
            out["host_pool"] = parse_host_pool(value, f"{ENV_VAR} host_pool")
        elif key == "map_run":
            out["map_run"] = parse_map_run(value, f"{ENV_VAR} map_run")
        elif key == "packing_time":
            out["packing_time"] = parse_packing_time(value, f"{ENV_VAR} packing_time")
        else:
            raise ValueError(f"{ENV_VAR}: unknown key {key!r} "
                             "(known: budget, budget.<tag>, route, reuse_before_grow, map_run, packing_time, host_pool)")
    return out


def parse_budgets(value, source: str = "budgets") -> dict:
    """Per-tag budgets {tag: budget} (Note [Tag budgets]), each budget as parse_budget reads one
    (so what this returns reads back unchanged)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{source} must be a dict of tag name to budget, got {type(value).__name__}")
    return {tag_name(tag, f"{source}: a tag"): parse_budget(b, f"{source}[{tag!r}]", tag=True) for tag, b in value.items()}


def from_environment() -> dict:
    return parse_conf(os.environ.get(ENV_VAR, ""))


def describe(settings: dict) -> list[tuple[str, str]]:
    """(key, value) for every key of TORCH_BUDGET_CONF, as parse_conf returned it; a key it
    lacks shows the value install() uses without it, marked "(default)"."""
    def shown(key, text):
        return (key, text if key in settings else f"{text} (default)")

    host = settings.get("host_pool", 0)
    return [
        shown("budget", format_budget(settings.get("budget"))),
        shown("route", settings.get("route", AUTO) + ("" if settings.get("route", AUTO) != AUTO else
                                                       ": VMM, else pool, else sync, by what each device supports")),
        shown("reuse_before_grow", "true" if settings.get("reuse_before_grow", True) else "false"),
        shown("map_run", format_bytes(settings.get("map_run", MAP_RUN_DEFAULT))),
        shown("packing_time", f"{settings.get('packing_time', PACKING_TIME_DEFAULT):g}"),
        shown("host_pool", f"{format_bytes(host)} ({host} bytes)" if host else "none"),
    ] + [(f"budget.{tag}", format_budget(b)) for tag, b in sorted(settings.get("budgets", {}).items())]
