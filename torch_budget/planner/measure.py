"""What one profiling forward held: `Profile`, `profile()` that measures it on a device, and
`profile_step()` that measures the step the resource managers name as their worst case."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable

from torch_budget._validate import non_negative_int


@dataclass(frozen=True)
class Profile:
    """What one profiling forward held. The first five fields are what was measured (or given);
    activation_bytes, extra_cost and peak are derived from them, as is `allocator_cache` (see
    `from_measurements`)."""

    torch_peak: int  # allocated_bytes.all.peak over the forward, weights included
    torch_used: int  # bytes torch's allocator holds from the device (reserved) after the forward
    total_used: int  # device-wide bytes in use: total - free
    total: int  # card bytes
    model_bytes: int
    activation_bytes: int
    extra_cost: int  # memory outside torch: context, NCCL, other libraries
    peak: int  # device-wide bytes at the peak: torch peak + allocator cache + extra_cost
    source: str = "measured"

    @property
    def allocator_cache(self) -> int:
        """Bytes torch's allocator held beyond its allocated peak: reserved minus the torch peak,
        never negative. Memory the device really holds at the peak (cached blocks, rounding), so
        it is part of `peak`; 0 when the allocator held nothing it had not handed out."""
        return max(self.torch_used - self.torch_peak, 0)

    @classmethod
    def from_measurements(cls, *, torch_peak: int, torch_used: int, total_used: int, total: int,
                          model_bytes: int, source: str = "given") -> "Profile":
        """Derive the profile from the four readings (also how tests and planners without a
        device inject numbers). A torch peak below the weights means the weights were not
        resident when profiling ran, which would hide their bytes: an error, not a clamp.

        The peak is what the device held: the torch peak, what torch's allocator cached beyond
        it (`allocator_cache`) and what lives outside torch (`extra_cost`); with reserved bytes
        at least the torch peak and device used at least reserved, that is `total_used`."""
        for name, value in (("torch_peak", torch_peak), ("torch_used", torch_used), ("total_used", total_used),
                            ("total", total), ("model_bytes", model_bytes)):
            non_negative_int(value, name)
        if total <= 0:
            raise ValueError(f"total card bytes must be positive, got {total}")
        if torch_peak < model_bytes:
            raise ValueError(
                f"torch peak ({torch_peak} bytes) is below model_bytes ({model_bytes}): load the weights "
                "before profiling, or pass the bytes the weights really occupy"
            )
        extra = max(total_used - torch_used, 0)
        cache = max(torch_used - torch_peak, 0)
        return cls(torch_peak=torch_peak, torch_used=torch_used, total_used=total_used, total=total,
                   model_bytes=model_bytes, activation_bytes=torch_peak - model_bytes, extra_cost=extra,
                   peak=torch_peak + cache + extra, source=source)


def profile(fn: Callable, *args, model_bytes: int, device=None, **kwargs) -> Profile:
    """Run one profiling forward `fn(*args, **kwargs)` and measure what it held.

    Cached memory is released and peaks reset first, so the peak is this forward's and not an
    earlier one's. Only public torch.cuda calls are used, so this works with torch's native
    allocator and with any pluggable allocator that answers `memory_stats()` with native key
    names (as torch_budget's does after `install()`).

    torch_used is the allocator's *reserved* bytes, not its allocated bytes: blocks it caches
    after the forward are torch's, and counting them as non-torch would charge the activations
    twice. What it reserved beyond the torch peak is the allocator's cache
    (`Profile.allocator_cache`), memory the device holds at the peak: the profile's peak counts it.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "profile() measures a CUDA device and none is available; without one, build "
            "Profile.from_measurements(...) from known figures (or use `torch-budget plan`)"
        )
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"profile() needs a CUDA device, got {dev}")
    with torch.cuda.device(dev):
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        free, total = torch.cuda.mem_get_info()
    del result
    missing = [k for k in ("allocated_bytes.all.peak", "reserved_bytes.all.current") if k not in stats]
    if missing:
        raise RuntimeError(
            f"torch.cuda.memory_stats() lacks {missing}; the active allocator "
            f"({torch.cuda.get_allocator_backend()}) does not report native statistics"
        )
    return Profile.from_measurements(
        torch_peak=int(stats["allocated_bytes.all.peak"]),
        torch_used=int(stats["reserved_bytes.all.current"]),
        total_used=int(total - free),
        total=int(total),
        model_bytes=model_bytes,
        source=f"measured on {dev}",
    )



def profile_step(managers, forward: Callable, *, model_bytes: int, device=None) -> Profile:
    """Profile the step the resource managers' dummy requests make (torch_budget.resources,
    Note [Resource managers]): each manager prepares it (a KV cache reserves the dummy requests'
    blocks, a workspace grows), `forward(step)` runs it under `profile`, and every manager
    updates and frees the dummies afterwards, also when the forward raises."""
    from torch_budget.resources import dummy_step

    with dummy_step(managers) as step:
        return profile(forward, step, model_bytes=model_bytes, device=device)
