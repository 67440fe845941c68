"""What the adapters share: installing torch_budget on their first use or at import, and the
registry of torch_budget tags a stack's (tag, backup) pairs become."""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch_budget
from torch_budget import _runtime
from torch_budget.errors import InstallError, InvalidArgumentError, TorchBudgetError


def ensure_installed(explain: Callable[[InstallError], str]) -> None:
    """install() unless torch_budget serves this process already; when it cannot, InstallError
    with `explain(error)`, the adapter's own account of what to do. The driver is left to the
    first allocation: the stacks' parent processes fork their workers (Note [Installing without
    the driver])."""
    if torch_budget.installed():
        return
    try:
        torch_budget.install(start_driver=False)
    except InstallError as e:
        raise InstallError(explain(e)) from e


def install_at_import(install: Callable[[], None]) -> None:
    """Calls `install` when a CUDA device is there and CUDA has not started: torch's allocator can
    only be replaced before, and the stacks start CUDA early. A child forked from a process that
    started CUDA cannot start it again (torch calls that a bad fork): it installs nothing, and its
    first CUDA use fails with torch's own message. Devices are counted without starting the
    driver (_runtime.cuda_devices)."""
    import torch

    if _runtime.cuda_devices() > 0 and not torch.cuda.is_initialized() and not torch.cuda._is_in_bad_fork():
        install()


def allocated_anywhere() -> bool:
    """Whether torch_budget has served an allocation on some device: before, the stacks' release
    and restore calls have no allocation to walk and do nothing (their own libraries do nothing
    then either; SGLang pauses its tags whether or not they allocated)."""
    return bool(_runtime.served_devices(_runtime.library()))


class TagRegistry:
    """The torch_budget tag of a stack's (tag, backup): `tag` for backup "none", "tag+<backup>"
    otherwise; two pairs never share one (Note [torch_memory_saver tags]). `mode` names the
    backup in the stack's words in errors ("backup", "restore mode"); `rename` gives the
    torch_budget name of a stack's tag where the stack's own name cannot be used."""

    def __init__(self, mode: str = "backup", rename: Optional[Callable[[str], str]] = None):
        self.mode = mode
        self._rename = rename or (lambda tag: tag)
        self.lock = threading.RLock()  # guards tags and owners; held across a release or restore
        self.tags: dict[str, dict[str, str]] = {}  # stack tag -> {torch_budget tag: backup}
        self.owners: dict[str, tuple[str, str]] = {}  # torch_budget tag -> (stack tag, backup)

    def name(self, tag: str, backup: str) -> str:
        """The torch_budget tag register() would give (tag, backup), registering nothing; raises
        InvalidArgumentError where another pair has that name."""
        base = self._rename(tag)
        name = base if backup == "none" else f"{base}+{backup}"
        with self.lock:
            owner = self.owners.get(name, (tag, backup))
        if owner != (tag, backup):
            raise InvalidArgumentError(
                f"tag {tag!r} with {self.mode} {backup!r} would be torch_budget tag {name!r}, which tag "
                f"{owner[0]!r} with {self.mode} {owner[1]!r} already uses: rename one of the two")
        return name

    def register(self, tag: str, backup: str) -> str:
        with self.lock:
            name = self.name(tag, backup)
            if name not in self.owners:
                # The core takes the name first (it refuses one over 63 bytes, and a 64th tag): a
                # pair it refuses is never recorded, so no later pause or sleep looks for it.
                try:
                    torch_budget.allocator._tag_id(_runtime.library(), name)
                except TorchBudgetError as e:
                    raise type(e)(f"tag {tag!r} with {self.mode} {backup!r} (torch_budget tag {name!r}) cannot be "
                                  f"served: {e}") from None
            self.owners.setdefault(name, (tag, backup))
            self.tags.setdefault(tag, {})[name] = backup
        return name

    def of(self, tag: str | None) -> dict[str, str]:
        """torch_budget tag -> backup for the stack's tag `tag` (None: every tag; unknown: none)."""
        with self.lock:
            if tag is None:
                return {n: b for names in self.tags.values() for n, b in names.items()}
            return dict(self.tags.get(tag, {}))
