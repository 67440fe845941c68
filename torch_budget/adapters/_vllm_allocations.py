"""vLLM's records of the sleep-mode allocator's memory, read from torch_budget's ledger:
CuMemAllocator.pointer_to_data ({address: AllocationData}) and the pools of
CuMemAllocator.allocator_and_pools, which vLLM's tests, TRL and vLLM's own
discardable_allocations read.

vLLM records one cuMem allocation per segment its pools map; torch_budget has no such
allocation, so each live block of a tag is one record: handle (device, bytes charged,
address, 0: no driver handle of its own), its tag, is_asleep while the tag is released on
that device, and cpu_backup_tensor, a CPU copy of the block's backup read when asked
(vLLM's is the backup itself, kept past the wake; here writes to it do not reach the
restore, and after a wake there is none).
"""
from __future__ import annotations

import ctypes
from collections.abc import Collection
from typing import Any, Optional

import torch_budget
from torch_budget import _native, _runtime, diagnostics, sleep

_ALLOCATED = 1  # a segment block's state (csrc/core/segment_views.h): 0 free, 1 allocated, 2 waiting on streams


class AllocationData:
    """vllm.device_allocator.AllocationData of one live block of a tag (read-only)."""

    __slots__ = ("handle", "tag", "is_asleep", "_discarded")

    def __init__(self, handle: tuple[int, int, int, int], tag: str, is_asleep: bool, discarded: bool):
        self.handle, self.tag, self.is_asleep, self._discarded = handle, tag, is_asleep, discarded

    @property
    def cpu_backup_tensor(self):
        """A CPU uint8 copy of the block's backup while its tag sleeps with one; None otherwise
        (a tag released without a copy, an allocation the sleep discarded)."""
        if not self.is_asleep or self._discarded:
            return None
        lib = _runtime.library()
        _, size, address, _ = self.handle
        found = ctypes.c_int(0)
        _native.check(lib, lib.tb_backup_read(ctypes.c_void_p(address), 0, 0, None, ctypes.byref(found)))
        if not found.value:
            return None
        import torch

        out = torch.empty(size, dtype=torch.uint8)
        _native.check(lib, lib.tb_backup_read(ctypes.c_void_p(address), 0, size, ctypes.c_void_p(out.data_ptr()),
                                              ctypes.byref(found)))
        return out if found.value else None

    def __repr__(self) -> str:
        return f"AllocationData(handle={self.handle}, tag={self.tag!r}, is_asleep={self.is_asleep})"


def allocations(tags: Collection[str], discarded: Collection[int] = ()) -> dict[int, AllocationData]:
    """{address: AllocationData} of every live block under `tags`, on every device; `discarded`:
    addresses the last sleep released without a copy."""
    if not tags or not torch_budget.installed():
        return {}
    lib = _runtime.library()
    ids = {lib.tb_tag_find(t.encode()): t for t in tags}
    ids.pop(-1, None)  # a tag the core never saw has no memory
    out: dict[int, AllocationData] = {}
    for dev in _runtime.served_devices(lib):
        states = sleep.tag_states(dev)
        for segment in diagnostics.segments(dev):
            address = segment["address"]
            for size, _, state in segment["blocks"]:
                tag = ids.get(lib.tb_ptr_tag(ctypes.c_void_p(address))) if state == _ALLOCATED else None
                if tag is not None:
                    asleep = states.get(tag, {}).get("state", "live") != "live"
                    out[address] = AllocationData((dev, size, address, 0), tag, asleep, address in discarded)
                address += size
    return out


class TagPool:
    """What an entry of allocator_and_pools holds in the place of vLLM's MemPool: snapshot(), in
    the shape of MemPool.snapshot() (each allocation of the tag one segment of one active block),
    as vLLM's discardable_allocations reads it. torch_budget keeps no pool per use of a tag: every
    entry of a tag sees all of the tag's allocations."""

    __slots__ = ("tag",)

    def __init__(self, tag: str):
        self.tag = tag

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"device": d.handle[0], "address": ptr, "total_size": d.handle[1], "allocated_size": d.handle[1],
                 "blocks": [{"address": ptr, "size": d.handle[1], "state": "active_allocated"}]}
                for ptr, d in allocations((self.tag,)).items()]

    def __repr__(self) -> str:
        return f"TagPool({self.tag!r})"


def pool_entry(tag: str) -> tuple[TagPool, Optional[Any]]:
    """An entry of allocator_and_pools[tag]: vLLM's (MemPool, CUDAPluggableAllocator); no allocator here."""
    return (TagPool(tag), None)
