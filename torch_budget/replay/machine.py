"""Where a measuring process runs: the CPU cores beside the GPU, and one of them while timed.
Read from the driver's and the kernel's files, without starting CUDA."""

from __future__ import annotations

import os


def _cpulist(text: str) -> set:
    cpus = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus() -> set:
    """The allowed CPU cores on the NUMA node of the first visible GPU; all allowed cores where
    those files do not say (no NUMA node, a container without them). GPUs are taken in PCI
    order, CUDA's order for identical cards."""
    allowed = set(os.sched_getaffinity(0))
    try:
        gpus = sorted(os.listdir("/proc/driver/nvidia/gpus"))
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        bus = gpus[int(first) if first.isdigit() else 0].lower()
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            node = int(f.read())
        with open(f"/sys/devices/system/node/node{node}/cpulist") as f:
            local = allowed & _cpulist(f.read())
    except (OSError, ValueError, IndexError):
        return allowed
    return local or allowed


def pin_near_gpu() -> None:
    """Keeps this process (and what it forks) on the GPU's NUMA node, so the memory it touches
    first lands there; call before importing torch."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, gpu_local_cpus())


def pin_to_one_core() -> None:
    """Pins the calling thread to one CPU core, the same one in every process of a run (the middle
    one beside the GPU): which core and NUMA node a process lands on otherwise moves the figures
    more than allocators differ."""
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(gpu_local_cpus())
        os.sched_setaffinity(0, {cpus[len(cpus) // 2]})
