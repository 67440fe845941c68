"""What every benchmark in tools/ checks first: torch installed, a CUDA device visible."""


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
