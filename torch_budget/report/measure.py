"""Reading what a device holds, for a measured ledger.

torch's allocated and reserved bytes, the device-wide used bytes (`mem_get_info`, which
counts memory outside torch and other processes too) and the bytes CUDA-graph private
pools hold beyond their live blocks: under torch_budget from its segments; on torch's
native allocator from the pool id torch's snapshot gives each segment.

A tag of the ledger (`torch_budget.stats()["by_tag"][name]`) may be released
(torch_budget.sleep): `tag_bytes` and `tag_state` read its entry, and read an entry without
the sleep keys (an older ledger) as live. A tag may have a budget of its own: `tag_budgets`
reads those into the ledger's budget table.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_budget.planner.ledger import TagBudget
from torch_budget.units import format_bytes


@dataclass
class Reading:
    """One look at the device: torch's allocated/reserved bytes, device-wide used, and what graph
    pools hold beyond their live blocks (graph_pool_bytes)."""

    allocated: int
    reserved: int
    used: int
    pools: int


def tag_bytes(entry: dict, key: str = "allocated") -> int:
    """The `key` bytes of a by_tag entry that are on the device: all of them while the tag is
    live, at most its resident bytes while it is released or restoring."""
    value = int(entry.get(key, 0))
    if entry.get("state", "live") == "live":
        return value
    return min(value, int(entry.get("resident", 0)))


def tag_state(entry: dict) -> str:
    """What of a by_tag entry is not resident, for a ledger line's state: empty while the tag is
    live (or the entry has no sleep keys), else e.g. 'released 1.20 GiB, backup pinned (1.20 GiB
    on host)'."""
    state = entry.get("state", "live")
    if state == "live":
        return ""
    text = f"{state} {format_bytes(int(entry.get('released', 0)))}"
    backup = entry.get("backup")
    if backup:
        text += f", backup {backup}"
        held = int(entry.get("backup_bytes", 0))
        if held:
            text += f" ({format_bytes(held)} on host)"
    return text


def tag_budgets(by_tag: dict, bounds: dict | None = None) -> list[TagBudget]:
    """The tags of a ledger (`torch_budget.stats()["by_tag"]`) that have a budget, in name order:
    budget, allocated now (with its family's tags), peak (None once another tag of its family has
    allocated: the ledger keeps no family's peak). `bounds` maps a tag to (ledger category, the lines it bounds)
    for the picture's colour and the table's last column."""
    from torch_budget.allocator import family_allocated, family_head

    held = {tag: int(entry["allocated"]) for tag, entry in by_tag.items()}
    out = []
    for tag, entry in sorted(by_tag.items()):
        if entry.get("budget") is None:
            continue
        category, lines = (bounds or {}).get(tag, ("reserve", ""))
        # what the budget bounds: the tag and its family (Note [Tag families]); the ledger keeps each
        # tag's own peak, which is the family's only while no other tag of it has allocated
        members = [m for name, m in by_tag.items() if family_head(name) == tag]
        peak = entry.get("peak_allocated")
        if any(m.get("peak_allocated", 0) or m.get("allocated", 0) for m in members):
            peak = None
        out.append(TagBudget(tag=tag, budget=int(entry["budget"]), used=family_allocated(held, tag),
                             peak=None if peak is None else int(peak), category=category, lines=lines))
    return out


def graph_pool_bytes(device, installed: bool) -> int:
    """Bytes CUDA-graph private pools on `device` hold beyond their live blocks: what replays
    reuse. A live block of a pool (an output a graph keeps there) is allocated memory, on the
    line of the tag or allocation that holds it, so a ledger counts it there and not here too."""
    import torch

    from torch_budget import diagnostics

    if installed:
        # Mapped bytes only: a released pool holds none (its blocks are still counted allocated).
        return sum(max(int(seg["mapped_size"]) - int(seg["allocated_size"]), 0)
                   for seg in diagnostics.segments(device) if tuple(seg["pool"]) != (0, 0))
    total = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device.index) != device.index:
            continue
        pool = seg.get("segment_pool_id")
        if pool is None:
            raise RuntimeError("torch.cuda.memory_snapshot() segments lack 'segment_pool_id' in this torch; "
                               "graph pool bytes cannot be measured on the native allocator")
        if tuple(pool) != (0, 0):
            total += int(seg["total_size"]) - int(seg["allocated_size"])
    return total


def read(device, installed: bool) -> Reading:
    """Synchronises `device`, then reads every figure once."""
    import torch

    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return Reading(allocated=int(torch.cuda.memory_allocated(device)),
                   reserved=int(torch.cuda.memory_reserved(device)),
                   used=int(total - free), pools=graph_pool_bytes(device, installed))


class DeviceWatch:
    """The largest device-wide used bytes seen, with torch's reserved bytes at that moment
    (their difference is memory outside torch). Sampled without synchronising:
    cudaMemGetInfo is a driver query. Other processes on the card count too."""

    def __init__(self, device):
        self._device = device
        self.samples = 0
        self.peak_used = 0
        self.reserved_at_peak = 0

    def sample(self) -> None:
        import torch

        free, total = torch.cuda.mem_get_info(self._device)
        self.samples += 1
        used = int(total - free)
        if used > self.peak_used:
            self.peak_used = used
            self.reserved_at_peak = int(torch.cuda.memory_reserved(self._device))
