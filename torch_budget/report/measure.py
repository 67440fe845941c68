"""Reading what a device holds, for a measured ledger.

torch's allocated and reserved bytes, the device-wide used bytes (`mem_get_info`, which
counts memory outside torch and other processes too) and the bytes of CUDA-graph
private pools: under torch_budget they come from its ledger; on torch's native
allocator from the pool id torch's snapshot gives each segment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Reading:
    """One look at the device: torch's allocated/reserved bytes, device-wide used, graph pools."""

    allocated: int
    reserved: int
    used: int
    pools: int


def graph_pool_bytes(device, installed: bool) -> int:
    """Bytes held by CUDA-graph private pools on `device`."""
    import torch

    import torch_budget

    if installed:
        return int(torch_budget.stats(device)["graph_pools"])
    total = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device.index) != device.index:
            continue
        pool = seg.get("segment_pool_id")
        if pool is None:
            raise RuntimeError("torch.cuda.memory_snapshot() segments lack 'segment_pool_id' in this torch; "
                               "graph pool bytes cannot be measured on the native allocator")
        if tuple(pool) != (0, 0):
            total += int(seg["total_size"])
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
