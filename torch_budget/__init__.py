"""torch_budget: an exact, enforced budget for CUDA device memory in PyTorch.

A thin facade: names resolve lazily so that `import torch_budget` is cheap and works
on machines without CUDA.
"""
from .errors import __all__ as _ERRORS

_EXPORTS = {
    # allocator shim
    "install": "allocator",
    "installed": "allocator",
    "route": "allocator",
    "stats": "allocator",
    "empty_cache": "allocator",
    "set_budget": "allocator",
    "capabilities": "allocator",
    "route_for": "allocator",
    "segments": "allocator",
    "trim_tag": "allocator",
    "memory_snapshot": "snapshot",
    "dump_snapshot": "snapshot",
    # sleep / wake
    "release": "sleep",
    "restore": "sleep",
    "sleeping": "sleep",
    "tag_states": "sleep",
    "reserve_host_pool": "sleep",
    "free_host_pool": "sleep",
    "host_pool_stats": "sleep",
    # graphs
    "GraphPoolManager": "graphs",
    # eager workspace
    "WorkspaceShrinkPolicy": "eager_workspace",
    "workspace": "eager_workspace",
    "WorkspaceMetadata": "eager_workspace",
    # planner
    "CacheCost": "planner",
    "profile": "planner",
    "plan": "planner",
    # exceptions
    **{name: "errors" for name in _ERRORS},
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_budget' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"torch_budget.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
