"""What one demo run serves, and the names its steps share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch_budget.planner import ASSUMED_CARD, ASSUMED_CARD_GIB  # noqa: F401  (the no-GPU path's card)
from torch_budget.planner import TAGS
from torch_budget.planner.shape import ModelShape
from torch_budget.units import GiB

# The planner's tags (Note [Plan as budgets]), so that Plan.apply() bounds what the demo allocates.
TAG_WEIGHTS, TAG_KV, TAG_GRAPHS, TAG_ACTIVATIONS = (TAGS[c] for c in ("weights", "kv_pool", "graph_pools",
                                                                      "activations"))
FRACTION = 0.9  # the planner's default share of what the peak leaves free
BLOCK_SIZE = 16

# The built-in model the demo serves (demo/model.py): about 63 M parameters, big enough that
# weights, KV and activations are all visible on a ledger, small enough to start in seconds.
MODEL = ModelShape(layers=8, hidden=512, heads=8, kv_heads=2, intermediate=2048, vocab=32000, head_dim=64,
                   max_seq_len=2048, dtype="bfloat16")


@dataclass(frozen=True)
class Settings:
    """What one demo run serves. `--quick` shrinks every dimension so a run takes seconds."""

    requests: int
    seed: int
    out: Path
    native: bool
    min_prompt: int
    max_prompt: int
    min_new: int
    max_new: int
    buckets: tuple
    kv_cap_bytes: int  # cap on the KV pool: the demo needs a few GiB, not the whole card
    sleep: bool = False  # a last step: release and restore the served model's memory (sleep_wake.py)

    @property
    def max_batch(self) -> int:
        # Every decode step replays a graph: concurrency is capped at the largest bucket.
        return self.buckets[-1]


def make_settings(*, quick: bool = False, requests: int | None = None, seed: int = 0,
                  out: Path = Path("torch_budget_ledger.png"), native: bool = False, sleep: bool = False) -> Settings:
    """The run `torch-budget demo` makes; `quick` shrinks every dimension so it takes seconds."""
    if quick:
        shape = dict(min_prompt=16, max_prompt=256, min_new=8, max_new=32, buckets=(1, 2, 4, 8), kv_cap_bytes=1 * GiB)
        default_requests = 16
    else:
        shape = dict(min_prompt=16, max_prompt=1024, min_new=16, max_new=64, buckets=(1, 2, 4, 8, 16, 32),
                     kv_cap_bytes=4 * GiB)
        default_requests = 48
    return Settings(requests=requests or default_requests, seed=seed, out=Path(out), native=native, sleep=sleep,
                    **shape)


class DemoError(Exception):
    """The serving run was set up in a way that cannot work; the message says how to fix it."""
