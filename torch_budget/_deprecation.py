"""Old names, kept for one release: each still works and says, once per use, what to write instead.

Every message starts "torch_budget.<old name> is deprecated", so a warnings filter can
select them.
"""
from __future__ import annotations

import importlib
import warnings


def warn(old: str, instead: str, stacklevel: int = 3) -> None:
    """Warns that `old` goes in the next release; `instead` says what to write.
    stacklevel 3: the caller of the function that calls this."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release: {instead}",
                  DeprecationWarning, stacklevel=stacklevel)


def moved(module: str, name: str, moves: dict[str, tuple[str, str]], stacklevel: int = 4):
    """Attribute `name` of `module` that moved: `moves` maps an old name to (the module that
    has it now, its name there). Warns and returns the value; AttributeError for a name not
    in `moves`. stacklevel 4: whoever read the attribute from the module's __getattr__."""
    target = moves.get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    where, new = target
    warn(f"{module}.{name}", f"use {where}.{new}", stacklevel=stacklevel)
    return getattr(importlib.import_module(where), new)


def moved_names(module: str, moves: dict[str, tuple[str, str]]):
    """A module `__getattr__` resolving the names of `moves` (see moved), warning on each access."""
    def __getattr__(name: str):
        return moved(module, name, moves)

    return __getattr__
