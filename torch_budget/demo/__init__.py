"""`torch-budget demo`: serve the built-in model inside a planned budget, then hold the plan
against what the card really did.

The demo is the whole story of the package in one run, in the order a serving engine must follow:
install the allocator before anything touches CUDA, load the weights, profile one worst-case
prefill, measure what the decode graphs will hold, plan the KV budget from those measurements and
enforce the plan as per-tag budgets (Plan.apply), allocate the KV pool from the plan, capture the
decode graphs, serve a stream of mixed requests, and finally print the plan's predicted peak next
to the measured one and draw the measured ledger with each tag's budget, use and headroom. With --sleep a last step releases the served model's memory, restores it and checks that
the same prompts get the same tokens (sleep_wake.py). Every figure it prints is measured on the
device or computed from measurements; the one exception, the no-GPU path, plans on an assumed
card and says so.

Prefill puts its attention scratch (the GQA-expanded K and V) in the eager workspace, so
`torch_budget.workspace` manages it. `model.decode` (demo/model.py) runs cache rows 0..B-1 and
`PagedKVCache` cannot move a row's blocks, so the scheduler keeps finished rows as holes (their
tables point at the null block) and a step covers rows up to the highest live one; holes and
bucket padding write only the null block. The command line lives in cli/demo.py.
"""

from __future__ import annotations

import sys

from torch_budget.demo.settings import (ASSUMED_CARD, ASSUMED_CARD_GIB, FRACTION, MODEL, DemoError, Settings,
                                        make_settings)
from torch_budget.units import GiB, format_bytes as _fmt

# The modules of the demo: this one (entry point, the plan-only run), settings.py (what a run
# serves), model.py (the built-in model and its paged KV cache), serve.py (the nine steps of a
# serving run), requests.py (the request stream and the scheduler), ledger.py (the measured
# ledger and its picture), sleep_wake.py (the tenth step with --sleep: release and restore the
# served model's memory).

__all__ = ["DemoError", "Settings", "make_settings", "run"]

# --- entry point ----------------------------------------------------------------------------------


class _CannotServe(Exception):
    """The serving run cannot start here; the message says exactly why."""


def run(settings: Settings) -> int:
    """One demo run. Returns 0 on success (including the plan-only run without a GPU), 1 when
    serving failed (an OOM means the plan was wrong, which the message says)."""
    import torch

    try:
        mode = _start_allocator(torch, settings)
    except _CannotServe as e:
        return _plan_only(settings, str(e))
    except DemoError as e:
        print(f"torch-budget demo: error: {e}", file=sys.stderr)
        return 1
    from torch_budget.demo.serve import serve

    try:
        serve(torch, settings, mode)
    except torch.cuda.OutOfMemoryError as e:
        print(f"\ntorch-budget demo: OUT OF MEMORY while serving inside the plan; the plan under-estimated "
              f"something and the message says what was asked for:\n{e}", file=sys.stderr)
        return 1
    except DemoError as e:
        print(f"torch-budget demo: error: {e}", file=sys.stderr)
        return 1
    return 0


def _start_allocator(torch, settings: Settings) -> str:
    """Install torch_budget's allocator before anything touches CUDA; returns "torch_budget" or
    "native". Raises _CannotServe when there is no device or no usable extension.

    Only calls that do not initialise CUDA run before install(): `is_available` asks the driver
    for a device count, `is_initialized` reads a flag.
    """
    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else " (this torch is a CPU-only build)"
        raise _CannotServe(f"no CUDA device visible: torch.cuda.is_available() is False{build}")
    if settings.native:
        print("allocator: torch's native caching allocator (--native); torch_budget's ledger is not used")
        return "native"
    from torch_budget import _native

    if not _native.is_built("_C"):
        raise _CannotServe(
            "the compiled extension torch_budget._C is not built: run `pip install --no-build-isolation -e .` "
            "in the repository (or rerun with --native to serve on torch's own allocator)")
    import torch_budget

    if torch_budget.installed():
        print("allocator: torch_budget was already installed by this process; the demo uses it as it is")
        return "torch_budget"
    if torch.cuda.is_initialized():
        print("allocator: CUDA was already initialised in this process before the demo started, so "
              "torch_budget.install() can no longer replace torch's allocator; falling back to torch's "
              "native allocator (run `torch-budget demo` in a fresh process to see torch_budget's ledger)")
        return "native"
    try:
        settings_in_force = torch_budget.install()
    except (ImportError, OSError) as e:
        # Typically an extension built against another torch: it exists but cannot be loaded.
        raise _CannotServe(
            f"the compiled extension torch_budget._C cannot be loaded ({e}); rebuild it against this torch "
            "with `pip install --no-build-isolation -e .` (or rerun with --native)") from None
    except (RuntimeError, ValueError) as e:
        # A bad TORCH_BUDGET_CONF (ValueError) or a refusal by the driver or the shim.
        raise DemoError(f"torch_budget.install() failed: {e} (rerun with --native to serve on torch's own "
                        "allocator)") from None
    budget = settings_in_force["budget_bytes"] or settings_in_force["budget_fraction"]
    print(f"allocator: torch_budget installed before the first CUDA tensor; route {settings_in_force['route']}, "
          f"budget {'the whole card' if budget is None else budget}")
    return "torch_budget"


def _plan_only(settings: Settings, reason: str) -> int:
    """Print the plan for the built-in model without serving, then the reason serving stops.

    With a device visible the plan uses the card's real size; otherwise it plans an assumed H200.
    """
    import torch

    from torch_budget import planner
    from torch_budget.planner.shape import described_profile, kv_cache_cost

    if torch.cuda.is_available():
        total = int(torch.cuda.mem_get_info()[1])
        card = f"the visible card ({_fmt(total)}, read from the device)"
        print("Planning the built-in model for the visible card (size read from the device); weights are "
              "computed from the model's shape, activations estimated from shapes, memory outside torch "
              "and CUDA-graph pools not measured.")
    else:
        total = int(ASSUMED_CARD_GIB * GiB)
        card = f"an assumed {ASSUMED_CARD} ({ASSUMED_CARD_GIB:g} GiB)"
        print(f"ASSUMPTION: no device to measure, so this plans the built-in model for an assumed card, "
              f"an {ASSUMED_CARD} taken as {ASSUMED_CARD_GIB:g} GiB usable (nominally 141 GB). Nothing "
              "below is measured: weights are computed from the model's shape, activations estimated from "
              "shapes, memory outside torch taken as 0, CUDA-graph pools left out.")
    print(f"Prefill runs one request at a time, so activations are estimated for one prompt of "
          f"{settings.max_prompt} tokens; the KV pool is capped at {settings.kv_cap_bytes / GiB:g} GiB as the "
          "serving run would cap it.\n")
    cfg = MODEL
    prof, notes = described_profile(cfg, total=total, num_tokens=settings.max_prompt, num_sequences=1)
    result = planner.plan(prof, kv_cache_cost(cfg), fraction=FRACTION, max_kv_bytes=settings.kv_cap_bytes,
                          notes=notes, title=f"plan: built-in model on {card}")
    print(result.to_text())
    print("\nOn a device the demo enforces the plan: Plan.apply() gives each tag its lines, " + ", ".join(
        f"{tag} {_fmt(n)}" for tag, n in result.tag_budgets().items()) + " (here planned, not applied)")
    if settings.sleep:
        print("\n--sleep: the sleep/wake step is skipped, it needs the served model")
    print(f"\ntorch-budget demo stops here: {reason}.")
    return 0
