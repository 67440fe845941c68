"""The budget planner: cut one card into budgets that do not overlap.

A budget error found at start-up is an OOM mid-forward later, so the planner measures what one
forward really holds (`profile`), sets aside what will appear beside or after it, and gives the
KV cache - the only part that grows - what is left (`plan`). Every number it produces is a line
of the ledger with the reason it has that size.

- costs.py: what a KV cache, a per-token workspace and a reserve cost;
- measure.py: what one profiling forward held (`Profile`, `profile()`, `profile_step()` driving
  the resource managers' dummy requests);
- steps.py: the seven steps of `plan` (see Note [Planner steps] there) and the `Plan`;
- apply.py: the plan enforced as per-tag budgets (`Plan.apply()`, Note [Plan as budgets]);
- ledger.py: the ledger lines a plan is made of, and their text table;
- shape.py: a model described by its shape, for planning without a device;
- hf.py, hf_plan.py: Hugging Face transformers decoders (Llama, Qwen) with random weights, their
  StaticCache as a resource manager, profiled, planned and served at their worst case
  (transformers is imported only when used; tools/plan_hf.py runs them on a device).
"""

from torch_budget.planner.costs import CacheCost, Reserve, WorkspaceReserve, attended_token_cap, workspace_reserve
from torch_budget.planner.ledger import CATEGORIES, LedgerLine, TagBudget, format_budgets, format_table
from torch_budget.planner.measure import Profile, profile, profile_step
from torch_budget.planner.shape import (ModelShape, described_profile, estimate_activation_bytes, kv_cache_cost,
                                        parameter_count, weight_bytes)
from torch_budget.planner.steps import Plan, PlanStep, plan
from torch_budget.planner.apply import TAGS, AppliedBudgets

# The card planned for when there is no device to measure and none was named: an assumption,
# printed as one wherever it is used.
ASSUMED_CARD = "NVIDIA H200"
ASSUMED_CARD_GIB = 139.8  # nominally 141 GB; the usable figure is itself assumed

__all__ = [
    "CacheCost",
    "WorkspaceReserve",
    "workspace_reserve",
    "attended_token_cap",
    "Reserve",
    "Profile",
    "profile",
    "profile_step",
    "PlanStep",
    "Plan",
    "plan",
    "TAGS",
    "AppliedBudgets",
    "CATEGORIES",
    "LedgerLine",
    "format_table",
    "TagBudget",
    "format_budgets",
    "ModelShape",
    "parameter_count",
    "weight_bytes",
    "kv_cache_cost",
    "estimate_activation_bytes",
    "described_profile",
]
