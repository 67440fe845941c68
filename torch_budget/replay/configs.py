"""The allocator configurations a trace is replayed under: torch's own allocator in its three
forms and torch_budget on each route. Each runs in a process of its own, since the allocator is
chosen before CUDA starts: `env` is set when that process is started, `install` (when not None)
is passed to torch_budget.install() before the first allocation."""

from __future__ import annotations

CONFIGS = {
    "native": ({}, None),
    "expandable": ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None),
    "cudaMallocAsync": ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, None),
    "tb-vmm": ({}, {"route": "vmm"}),
    "tb-vmm-noreuse": ({}, {"route": "vmm", "reuse_before_grow": False}),
    # Packing bounded to 10 % of the time, the default before 3 % (Note [Packing time]): on an H200
    # lognormal churn then moved in every pass, 1.48x native for 1.166 peak reserved / live against
    # 1.03x for 1.174; the serving-like mix, small-only churn and decode_graphs did not change.
    "tb-vmm-pack10%": ({}, {"route": "vmm", "packing_time": 0.1}),
    # No packing moves at all (growth only, reclaims under budget refusal): what moving buys.
    "tb-vmm-nomove": ({}, {"route": "vmm", "packing_time": 0.0}),
    "tb-pool": ({}, {"route": "pool"}),
    "tb-sync": ({}, {"route": "sync"}),
}
DEFAULT = ("native", "expandable", "cudaMallocAsync", "tb-vmm", "tb-pool", "tb-sync")
# What every benchmark process starts with before its configuration's own variables: no allocator
# settings of the caller's (torch reads PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF first in newer
# versions; an empty value is no setting).
CLEAN_ENVIRONMENT = {"TORCH_BUDGET_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": ""}
BASELINE = "native"


def environment(name: str) -> dict:
    """The environment variables that process is started with."""
    env, _ = CONFIGS[name]
    # torch_budget's own settings come from install(), torch's from the configuration: either left
    # in the caller's environment (expandable_segments:True set in a shell, say) would make every
    # configuration, the native baseline included, something else than its name says.
    return {**CLEAN_ENVIRONMENT, **env}


def apply_config(name: str) -> None:
    """In the replaying process, before CUDA starts."""
    _, install = CONFIGS[name]
    if install is not None:
        import torch_budget

        torch_budget.install(**install)
