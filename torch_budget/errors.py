"""Every exception torch_budget raises for a condition of its own, under one root.

    TorchBudgetError                         the root (raised itself only for an error code
    │                                        the core never documented)
    ├── InvalidArgumentError (ValueError)    a value torch_budget refuses: out of range, an
    │   │                                    unknown tag, backup or device, a foreign pointer
    │   ├── ConfigError                      a setting: install(), set_budget(), TORCH_BUDGET_CONF
    │   ├── NotWarmedUpError                 workspace metadata used before its warm-up
    │   ├── PlanDoesNotFitError              a plan's tag budgets do not fit the device's budget
    │   └── RequestTooLargeError             a request no resource manager could ever hold
    ├── NotInstalledError (RuntimeError)     a call that needs torch_budget.install() first
    ├── InstallError (RuntimeError)          install() cannot run now: no CUDA device, CUDA
    │                                        already initialised, installed with other settings
    ├── StateError (RuntimeError)            a call not allowed in the current state
    │   ├── TagStateError                    a tag released twice, restored while live,
    │   │                                    replayed while released
    │   ├── PoolInUseError                   a graph pool released while graphs hold it
    │   └── PoolReleasedError                a graph pool handle used after its release
    ├── DriverError (RuntimeError)           the driver failed, or lacks what the call needs
    ├── BackupFileError (OSError)            a disk backup's file could not be written or read
    ├── StaticBufferRebindError (TypeError)  a graph-visible buffer assigned, not written in place
    ├── UnsupportedError (NotImplementedError) another stack's feature an adapter cannot provide
    └── NotBuiltError (ImportError)          the compiled part is not built

Each class also inherits the builtin torch_budget raised before it had its own, so
`except ValueError` / `except RuntimeError` around older code keeps working. A wrong type
is a plain TypeError, as in Python. Running out of memory or budget is torch's own
`torch.cuda.OutOfMemoryError`, whichever path raises it.
"""
from __future__ import annotations

__all__ = [
    "TorchBudgetError",
    "UnsupportedError",
    "InvalidArgumentError",
    "ConfigError",
    "NotWarmedUpError",
    "PlanDoesNotFitError",
    "RequestTooLargeError",
    "NotInstalledError",
    "InstallError",
    "StateError",
    "TagStateError",
    "PoolInUseError",
    "PoolReleasedError",
    "DriverError",
    "BackupFileError",
    "StaticBufferRebindError",
    "NotBuiltError",
]


class TorchBudgetError(Exception):
    """The root of torch_budget's exceptions: `except torch_budget.TorchBudgetError` catches every one."""


class InvalidArgumentError(TorchBudgetError, ValueError):
    """A value torch_budget refuses: out of range, an unknown name, a pointer it did not allocate."""


class ConfigError(InvalidArgumentError):
    """A setting torch_budget refuses (install(), set_budget(), TORCH_BUDGET_CONF); the message names it."""


class NotWarmedUpError(InvalidArgumentError):
    """Workspace metadata used before warm-up created its eager workspace."""


class PlanDoesNotFitError(InvalidArgumentError):
    """Plan.apply(): the plan's per-tag budgets add up to more than the device's budget allows, or
    give a tag less than is allocated under it already; nothing was set. The message has the figures."""


class RequestTooLargeError(InvalidArgumentError):
    """A request needs more than a resource manager's whole capacity, so waiting could never
    serve it (torch_budget.scheduling); the message names the manager's tag and both figures."""


class NotInstalledError(TorchBudgetError, RuntimeError):
    """A call that needs torch_budget.install() to have run in this process."""


class InstallError(TorchBudgetError, RuntimeError):
    """install() cannot run now: no CUDA device, torch's CUDA allocator already initialised, or
    torch_budget already installed with other settings."""


class StateError(TorchBudgetError, RuntimeError):
    """A call not allowed in the current state (during graph capture, on a closed runner, ...)."""


class TagStateError(StateError):
    """A tag in the wrong state for the call: released twice, restored while live, replayed while released."""


class PoolInUseError(StateError):
    """A graph pool was released while graphs still hold it."""


class PoolReleasedError(StateError):
    """A graph pool handle was used after it had been released."""


class DriverError(TorchBudgetError, RuntimeError):
    """The CUDA driver failed, or lacks a capability the call needs; the message names the call."""


class BackupFileError(TorchBudgetError, OSError):
    """A disk backup's file could not be written or read (the disk full, the directory gone)."""


class StaticBufferRebindError(TorchBudgetError, TypeError):
    """A graph-visible buffer was assigned a new tensor instead of being written in place."""


class UnsupportedError(TorchBudgetError, NotImplementedError):
    """Another stack's feature an adapter (torch_budget.adapters) cannot provide; the message
    says what does instead."""


class NotBuiltError(TorchBudgetError, ImportError):
    """The compiled part was not built (pip install --no-build-isolation -e .)."""
