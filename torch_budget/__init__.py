"""torch_budget: an exact, enforced budget for CUDA device memory in PyTorch.

The names a user types, at the top level:

    install, installed            torch_budget serves this process's CUDA allocations
    region(tag, route=)           a scope charging its allocations to a tag (and a route)
    stats, empty_cache, set_budget   the ledger, the cache, the budget
    release, restore, sleeping    sleep and wake of tagged memory
    workspace, WorkspaceMetadata  the eager workspace around a forward
    GraphPoolManager              CUDA graphs with bounded private pools
    TorchBudgetError, ...         the exceptions (torch_budget.errors)

Conventions everywhere: `device=None` is the current device and `device="all"` every
device, where a call acts on devices; `tags=None` is every tag; a release keeps contents
(backup="pinned") unless told otherwise. The rest lives in submodules: diagnostics
(capabilities, route_for, segments), snapshot (torch's memory snapshot with the ledger's
names), sleep (tag states, the pinned host pool), planner (plans that apply themselves as
per-tag budgets), resources and scheduling (the resource-manager protocol and the scheduler
that defers what does not fit), graphs, eager_workspace, workspace_resource, config, adapters
(the serving stacks' own interfaces) and startup (TORCH_BUDGET_SERVE: a stack served in every
process it starts).

Names resolve lazily, so `import torch_budget` is cheap and works on machines without CUDA.
"""
from . import _deprecation
from .errors import __all__ as _ERRORS

_EXPORTS = {
    "install": "allocator",
    "installed": "allocator",
    "region": "allocator",
    "stats": "allocator",
    "empty_cache": "allocator",
    "set_budget": "allocator",
    "release": "sleep",
    "restore": "sleep",
    "sleeping": "sleep",
    "workspace": "eager_workspace",
    "WorkspaceMetadata": "eager_workspace",
    "GraphPoolManager": "graphs",
    **{name: "errors" for name in _ERRORS},
}

# Old names that still call their deprecated function, which warns when called.
_RENAMED = {
    "route": "allocator",  # -> region(tag, route=)
    "trim_tag": "allocator",  # -> empty_cache(tags=)
    "memory_snapshot": "snapshot",  # -> snapshot.snapshot()
}

# Old top-level names that moved to a submodule: each access warns.
_MOVED = {
    "capabilities": ("torch_budget.diagnostics", "capabilities"),
    "route_for": ("torch_budget.diagnostics", "route_for"),
    "segments": ("torch_budget.diagnostics", "segments"),
    "dump_snapshot": ("torch_budget.snapshot", "dump_snapshot"),
    "tag_states": ("torch_budget.sleep", "tag_states"),
    "reserve_host_pool": ("torch_budget.sleep", "reserve_host_pool"),
    "free_host_pool": ("torch_budget.sleep", "free_host_pool"),
    "host_pool_stats": ("torch_budget.sleep", "host_pool_stats"),
    "WorkspaceShrinkPolicy": ("torch_budget.eager_workspace", "WorkspaceShrinkPolicy"),
    "CacheCost": ("torch_budget.planner", "CacheCost"),
    "profile": ("torch_budget.planner", "profile"),
    "plan": ("torch_budget.planner", "plan"),
}

# Submodules, importable as attributes without importing them first (torch_budget.diagnostics...).
_SUBMODULES = {"adapters", "allocator", "cli", "config", "demo", "diagnostics", "eager_workspace", "errors", "graphs",
               "planner", "replay", "report", "resources", "scheduling", "sleep", "snapshot", "units",
               "workspace_resource"}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"torch_budget.{name}")
    module = _EXPORTS.get(name) or _RENAMED.get(name)
    if module is None:
        return _deprecation.moved("torch_budget", name, _MOVED, stacklevel=4)  # or AttributeError
    value = getattr(importlib.import_module(f"torch_budget.{module}"), name)
    if name in _EXPORTS:
        globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
