"""The compiled allocator torch's allocations go through, and the device arguments of the
modules over it (allocator, sleep, snapshot, diagnostics).

One rule for `device` across the API, torch's: None is the current CUDA device, an int,
"cuda:N" or a torch.device names one device, "cuda" without an index is the current one.
Calls that act on devices (release, restore, sleeping, empty_cache, set_budget) also take
"all": every device torch_budget serves (has served an allocation on); a device first used
later starts from install()'s settings.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Union

from . import _native
from ._validate import is_int
from .errors import InstallError, InvalidArgumentError, NotInstalledError

if TYPE_CHECKING:
    import torch

ALL = "all"

# The argument types of the public API, for annotations.
Device = Union[int, str, "torch.device", None]  # None: the current device; "all" where a call acts on devices
Tags = Union[str, Iterable[str], None]  # a tag name, names, or None: every tag

# Set once install() handed the library to torch; never reset (torch cannot change allocator back).
_installed = False


def library():
    """The library that serves torch (loaded on first use)."""
    return _native.load("_C")


def cuda_devices() -> int:
    """The CUDA devices torch sees, counted through NVML where it can (torch.cuda.device_count):
    torch.cuda.is_available() runs cuInit, after which a forked child cannot start CUDA (Note
    [Installing without the driver], csrc/bridge/torch_allocator.cpp)."""
    import torch

    return 0 if torch.version.cuda is None else torch.cuda.device_count()


def check_can_install() -> None:
    """Raises InstallError unless torch's CUDA allocator can still be replaced in this process."""
    import torch

    if cuda_devices() == 0:
        raise InstallError("torch_budget.install() needs a CUDA device, and torch sees none")
    if torch.cuda.is_initialized():
        raise InstallError(
            "torch's CUDA allocator is already initialised: call torch_budget.install() at process start, "
            "before the first CUDA tensor is created (and before torch.cuda.init() or any CUDA call)")


def mark_installed() -> None:
    global _installed
    _installed = True


def installed() -> bool:
    """Whether torch_budget serves this process's CUDA allocations (loads nothing before install())."""
    return _installed and bool(library().tb_torch_installed())


def require_installed(what: str):
    """The library, or NotInstalledError naming `what` (the call that needs it)."""
    if not installed():
        raise NotInstalledError(f"{what} needs torch_budget.install() first")
    return library()


def current_device() -> int:
    """torch's current CUDA device, without initialising CUDA: until CUDA is initialised
    (torch.cuda.set_device initialises it) the current device is 0."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def device_index(device, what: str = "device") -> int:
    """One device's index: None and "cuda" are the current device (see the module's rule)."""
    if device is None:
        return current_device()
    if isinstance(device, bool):
        raise TypeError(f"{what} must be None, an int, 'cuda:N' or a torch.device, got {device!r}")
    if is_int(device):
        index = device.__index__()
        if index < 0:
            raise InvalidArgumentError(f"{what} must be >= 0, got {index}")
        if index >= 2**31:  # the core takes a C int: a larger one would wrap onto another device
            raise InvalidArgumentError(f"{what} {index} does not exist")
        return index
    if is_all(device):
        raise InvalidArgumentError(f"{what}={ALL!r} is taken by calls that act on devices (release, restore, "
                                   "sleeping, empty_cache, set_budget); this one reads one device: pass its index")
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"{what}: not a device: {device!r}") from None
    if dev.type != "cuda":
        raise InvalidArgumentError(f"{what}: expected a CUDA device, got {device!r}")
    return dev.index if dev.index is not None else current_device()


def served_devices(lib) -> list[int]:
    """The devices torch_budget serves allocations on."""
    return [d for d in range(max(lib.tb_device_count(), 0)) if lib.tb_device_ready(d)]


def is_all(device) -> bool:
    return isinstance(device, str) and device == ALL


def device_indices(lib, device, what: str = "device") -> list[int]:
    """The devices a call acts on: "all" is every served device, anything else one device."""
    if is_all(device):
        return served_devices(lib)
    return [device_index(device, what)]
