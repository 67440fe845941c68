"""What the benchmarks in tools/ share: the torch / CUDA check every one makes first, and where
the measuring process runs (the CPU cores beside the GPU, and one of them while timed)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


# Where a measuring process runs: shared with `torch-budget replay`.
from torch_budget.replay.machine import gpu_local_cpus, pin_near_gpu, pin_to_one_core  # noqa: E402,F401
