"""torch's memory snapshot, named with the ledger: each segment says its route, each block its
route and (while it lives) its tag.

`torch.cuda.memory._snapshot()` works under install() as it does natively; these add the
ledger's names for the memory visualiser's readers. The pickle `dump_snapshot` writes is what
torch's `_dump_snapshot` writes, with the extra keys (the visualiser ignores them).
"""
from __future__ import annotations

import bisect
import pickle

from . import _native
from .allocator import _require_installed, segments, stats


def annotate(snapshot: dict, ours: dict, tag_names: dict, tag_of) -> dict:
    """Adds `route` to each segment and block and `tag` to each live block of `snapshot`, in place.

    `ours`: {device: [(address, size, route)]} of torch_budget's segments (VMM arenas cover the
    mapped runs torch reports); `tag_names`: {tag id: name}; `tag_of(address)`: the tag id of
    the live block starting there, -1 if none."""
    index = {dev: sorted(segs) for dev, segs in ours.items()}
    for seg in snapshot.get("segments", []):
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
    return snapshot


def memory_snapshot() -> dict:
    """torch.cuda.memory._snapshot(), annotated (see annotate)."""
    import torch

    lib = _require_installed("torch_budget.memory_snapshot()")
    snap = torch.cuda.memory._snapshot()
    devices = sorted({seg["device"] for seg in snap.get("segments", [])})
    ours = {d: [(s["address"], s["total_size"], s["route"]) for s in segments(d)] for d in devices}
    names = {0: "untagged"}
    for d in devices:
        for name in stats(d)["by_tag"]:
            names[lib.tb_tag_find(name.encode())] = name
    return annotate(snap, ours, names, lambda address: lib.tb_ptr_tag(_native.ctypes.c_void_p(address)))


def dump_snapshot(path: str) -> None:
    """Writes memory_snapshot() as a pickle, as torch.cuda.memory._dump_snapshot does."""
    with open(path, "wb") as f:
        pickle.dump(memory_snapshot(), f)
