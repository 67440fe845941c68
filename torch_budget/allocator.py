"""install(), route/tag scopes, the ledger and torch compatibility.

`install()` swaps torch's CUDA allocator for torch_budget's compiled one. It must
run before the first CUDA allocation of the process; afterwards torch's own calls
(memory_stats, memory_allocated, empty_cache, set_per_process_memory_fraction,
memory_snapshot, CUDA graph capture) answer from torch_budget's ledger.

Settings come from install()'s arguments, else from the environment variable
TORCH_BUDGET_CONF in the style of PYTORCH_CUDA_ALLOC_CONF, e.g.
    TORCH_BUDGET_CONF="budget:40GiB,route:vmm"
    TORCH_BUDGET_CONF="budget:0.85"           (a fraction of the card)
Keys: budget (bytes with an optional KiB/MiB/GiB/TiB suffix, or a fraction in
(0, 1]), route (vmm | pool | sync | auto), reuse_before_grow (true | false).
"""
import contextlib
import os
import re
import threading

from . import _native
from ._native import ROUTES, TorchBudgetError

ENV_VAR = "TORCH_BUDGET_CONF"
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_lock = threading.Lock()
_state = {"installed": False, "settings": None}

__all__ = [
    "install", "installed", "route", "stats", "empty_cache", "set_budget", "capabilities", "segments",
    "parse_budget", "parse_conf", "doctor", "TorchBudgetError",
]


def parse_budget(value):
    """Bytes (int, or str with a unit) -> ("bytes", n); a float in (0, 1] -> ("fraction", f)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"budget must be a number of bytes or a fraction of the card, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {value}")
        return ("bytes", value)
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"a fractional budget must be in (0, 1], got {value}")
        return ("fraction", value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not m:
            raise ValueError(f"cannot read budget {value!r}: use bytes with a unit (e.g. 40GiB) or a fraction (0.9)")
        number, unit = m.group(1), m.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {m.group(2)!r} in budget {value!r} (use B, KiB, MiB, GiB or TiB)")
        if unit == "" and "." in number:
            return parse_budget(float(number))
        return parse_budget(int(float(number) * _UNITS[unit]))
    raise ValueError(f"budget must be an int, float or str, got {type(value).__name__}")


def _parse_bool(key, text):
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_VAR}: {key} must be true or false, got {text!r}")


def parse_conf(text):
    """Parses a TORCH_BUDGET_CONF string into install() keyword arguments."""
    out = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        if ":" not in item:
            raise ValueError(f"{ENV_VAR}: expected key:value, got {item!r}")
        key, value = (s.strip() for s in item.split(":", 1))
        if key == "budget":
            out["budget"] = value
        elif key == "route":
            out["route"] = value
        elif key == "reuse_before_grow":
            out["reuse_before_grow"] = _parse_bool(key, value)
        else:
            raise ValueError(f"{ENV_VAR}: unknown key {key!r} (known: budget, route, reuse_before_grow)")
    return out


def _route_id(name):
    if name not in ROUTES:
        raise ValueError(f"unknown route {name!r}: expected one of {', '.join(ROUTES)}")
    return ROUTES[name]


def capabilities(device=0):
    """What the driver offers on `device`: VMM, memory pools, VMM granularity, total bytes."""
    lib = _native.load()
    out = (_native.ctypes.c_int64 * 4)()
    _native.check(lib, lib.tb_capabilities(int(device), out))
    return {"vmm": bool(out[0]), "pools": bool(out[1]), "granularity": int(out[2]), "total_bytes": int(out[3])}


def choose_route(caps):
    """The route install() picks by default: VMM, else the stream-ordered pool, else sync."""
    if caps["vmm"]:
        return "vmm"
    if caps["pools"]:
        return "pool"
    return "sync"


def install(budget=None, route=None, reuse_before_grow=None):
    """Makes torch_budget serve every CUDA allocation of this process.

    budget: bytes (int or "40GiB") or a fraction of the card (0.9); None = the card.
    route: "vmm", "pool", "sync" or None/"auto" (VMM > pool > sync by what the device supports).
    Must run before the first CUDA allocation; raises RuntimeError otherwise.
    Returns the settings in force.
    """
    import torch

    env = parse_conf(os.environ.get(ENV_VAR, ""))
    budget = env.get("budget") if budget is None else budget
    route = env.get("route") if route is None else route
    reuse = env.get("reuse_before_grow", True) if reuse_before_grow is None else bool(reuse_before_grow)
    parsed = parse_budget(budget)
    if route not in (None, "auto"):
        _route_id(route)
    with _lock:
        if _state["installed"]:
            if _state["settings"]["requested"] != (budget, route, reuse):
                raise RuntimeError("torch_budget is already installed with other settings; "
                                   "change the budget with torch_budget.set_budget()")
            return dict(_state["settings"])
        if not torch.cuda.is_available():
            raise RuntimeError("torch_budget.install() needs a CUDA device, and torch sees none")
        if _torch_allocator_initialised():
            raise RuntimeError(
                "torch's CUDA allocator is already initialised: call torch_budget.install() at process start, "
                "before the first CUDA tensor is created (and before torch.cuda.init() or any CUDA call)")
        lib = _native.load()
        caps = capabilities(0)
        chosen = choose_route(caps) if route in (None, "auto") else route
        budget_bytes, fraction = -1, -1.0
        if parsed is not None:
            kind, v = parsed
            if kind == "bytes":
                budget_bytes = v
            else:
                fraction = v
        _native.check(lib, lib.tb_configure(budget_bytes, fraction, ROUTES[chosen], int(reuse)))
        _native.check(lib, lib.tb_torch_install())
        _state["installed"] = True
        _state["settings"] = {"route": chosen, "budget_bytes": budget_bytes if budget_bytes >= 0 else None,
                              "budget_fraction": fraction if fraction > 0 else None,
                              "reuse_before_grow": reuse, "capabilities": caps,
                              "requested": (budget, route, reuse)}
        return dict(_state["settings"])


def _torch_allocator_initialised():
    import torch

    return bool(torch.cuda.is_initialized())


def installed():
    """Whether torch_budget serves this process's CUDA allocations."""
    if not _state["installed"]:
        return False
    lib = _native.load()
    return bool(lib.tb_torch_installed())


@contextlib.contextmanager
def route(route=None, tag=None):
    """Scoped, nestable, per-thread: allocations inside go through `route` and are
    charged to `tag` (e.g. `with torch_budget.route("vmm", tag="kv"):`).

    route=None keeps the enclosing route, tag=None keeps the enclosing tag. Without
    install() the scope only validates its arguments: torch's allocator is in charge.
    """
    route_id = -1 if route is None else _route_id(route)
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


def _device_index(device):
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device!r}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _require_installed(what):
    if not installed():
        raise RuntimeError(f"{what} needs torch_budget.install() first")


def stats(device=None):
    """The ledger of one device, read without synchronising it.

    Keys: allocated, reserved, peak_allocated, peak_reserved, budget (None = card),
    total, graph_pools, by_route {name: {allocated, reserved, peak_allocated, count}},
    by_tag {name: {allocated, requested, peak_allocated, count}}, raw (every counter).
    """
    _require_installed("torch_budget.stats()")
    lib = _native.load()
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
                          "peak_allocated": t["allocated"]["peak"], "count": t["count"]}
                   for name, t in raw["tags"].items()},
        "raw": raw,
    }


def segments(device=None):
    """Every segment torch_budget holds on `device`, with its blocks."""
    _require_installed("torch_budget.segments()")
    lib = _native.load()
    return _native.read_json(lib, lib.tb_segments_json, _device_index(device))


def empty_cache(device=None):
    """Returns cached memory to the driver (synchronises the device)."""
    _require_installed("torch_budget.empty_cache()")
    lib = _native.load()
    _native.check(lib, lib.tb_empty_cache(_device_index(device)))


def set_budget(budget, device=None):
    """Sets the hard budget of `device` (bytes, "40GiB" or a fraction of the card).

    Raises ValueError when it is below what is allocated now.
    """
    _require_installed("torch_budget.set_budget()")
    parsed = parse_budget(budget)
    if parsed is None:
        raise ValueError("budget must be given")
    index = _device_index(device)
    kind, v = parsed
    if kind == "fraction":
        v = int(v * capabilities(index)["total_bytes"])
    lib = _native.load()
    _native.check(lib, lib.tb_set_budget(index, v))


def doctor():
    """A report of versions, capabilities and the route install() would choose."""
    import platform

    lines = [f"python        {platform.python_version()}"]
    try:
        import torch
    except ImportError:
        return "\n".join(lines + ["torch         not installed"])
    lines.append(f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})")
    lines.append(f"extension     {'built' if _native.is_built('_C') else 'not built (pip install --no-build-isolation -e .)'}")
    if not torch.cuda.is_available():
        lines.append("devices       none visible: install() needs a CUDA device")
        return "\n".join(lines)
    if not _native.is_built("_C"):
        return "\n".join(lines)
    lib = _native.load()
    n = lib.tb_device_count()
    if n < 0:
        lines.append(f"driver        {_native.error(lib)}")
        return "\n".join(lines)
    try:
        drv = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
    except RuntimeError:
        drv = None
    if drv:
        lines.append(f"driver        {drv}")
    for i in range(n):
        caps = capabilities(i)
        lines.append(
            f"device {i}      {torch.cuda.get_device_name(i)}: {caps['total_bytes'] / 2**30:.1f} GiB, "
            f"VMM {'yes' if caps['vmm'] else 'no'} (granularity {caps['granularity'] >> 20} MiB), "
            f"memory pools {'yes' if caps['pools'] else 'no'}; install() route: {choose_route(caps)}")
    return "\n".join(lines)
