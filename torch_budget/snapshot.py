"""torch's memory snapshot, named with the ledger: each segment says its route, each block its
route and (while it lives) its tag.

`torch.cuda.memory._snapshot()` works under install() as it does natively; `snapshot()` is
that dict with the ledger's names added, for the memory visualiser's readers, and
`dump_snapshot(path)` writes it as torch's `_dump_snapshot` does (the visualiser ignores
the extra keys). `torch.cuda.memory_snapshot()`, torch's list of segments, is unchanged.
"""
from __future__ import annotations

import bisect
import pickle
from typing import Any

from . import _deprecation, _native, _runtime
from .diagnostics import segments

__all__ = ["annotate", "snapshot", "dump_snapshot"]


def annotate(snap: dict[str, Any], ours: dict, tag_names: dict, tag_of) -> dict[str, Any]:
    """Adds `route` to each segment and block and `tag` to each live block of torch's snapshot
    dict `snap`, in place; returns it.

    `ours`: {device: [(address, size, route)]} of torch_budget's segments (VMM arenas cover the
    mapped runs torch reports); `tag_names`: {tag id: name}; `tag_of(address)`: the tag id of
    the live block starting there, -1 if none."""
    index = {dev: sorted(segs) for dev, segs in ours.items()}
    for seg in snap.get("segments", []):
        segs = index.get(seg["device"], [])
        i = bisect.bisect_right(segs, (seg["address"], float("inf"), "")) - 1
        route = segs[i][2] if i >= 0 and seg["address"] < segs[i][0] + segs[i][1] else None
        seg["route"] = route
        address = seg["address"]
        for block in seg["blocks"]:
            block["route"] = route
            if block["state"] != "inactive":
                block["tag"] = tag_names.get(tag_of(address))
            address += block["size"]
    return snap


def snapshot() -> dict[str, Any]:
    """torch.cuda.memory._snapshot() (the dict the memory visualiser reads), annotated (see annotate)."""
    import torch

    lib = _runtime.require_installed("torch_budget.snapshot.snapshot()")
    snap = torch.cuda.memory._snapshot()
    devices = sorted({seg["device"] for seg in snap.get("segments", [])})
    ours = {d: [(s["address"], s["total_size"], s["route"]) for s in segments(d)] for d in devices}
    names = {0: "untagged"}
    for d in devices:
        for name in _native.read_json(lib, lib.tb_stats_json, d)["tags"]:
            names[lib.tb_tag_find(name.encode())] = name
    return annotate(snap, ours, names, lambda address: lib.tb_ptr_tag(_native.ctypes.c_void_p(address)))


def dump_snapshot(path: str) -> None:
    """Writes snapshot() as a pickle, as torch.cuda.memory._dump_snapshot does. The snapshot is
    taken first: a call that fails leaves a file already at `path` as it was."""
    snap = snapshot()
    with open(path, "wb") as f:
        pickle.dump(snap, f)


def memory_snapshot() -> dict[str, Any]:
    """Deprecated: torch_budget.snapshot.snapshot() (torch.cuda.memory_snapshot() is torch's segment list)."""
    _deprecation.warn("torch_budget.memory_snapshot()",
                      "write torch_budget.snapshot.snapshot(), torch.cuda.memory._snapshot() with the ledger's names "
                      "(torch.cuda.memory_snapshot() is torch's list of segments)")
    return snapshot()
