"""What the benchmarks in tools/ share: the torch / CUDA check every one makes first, and pinning
the measuring thread to one CPU core."""
import os


def cuda_torch(name: str, measures: str, result_line: bool = True):
    """torch when a CUDA device is visible; otherwise prints why `name` measures nothing (and,
    with `result_line`, a `RESULT <name> skipped=no_cuda` line for the GPU suite) and returns None."""
    try:
        import torch
    except ImportError:
        print(f"{name}: torch is not installed; nothing to measure")
        return None
    if not torch.cuda.is_available():
        print(f"{name}: no CUDA device visible; this benchmark measures {measures} and needs one")
        if result_line:
            print(f"RESULT {name} skipped=no_cuda")
        return None
    return torch


def pin_to_one_core():
    """Pins the calling thread to one CPU core, the same one in every process of a run: which core
    (and NUMA node) a process lands on otherwise moves the figures more than allocators differ."""
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {allowed[len(allowed) // 2]})
