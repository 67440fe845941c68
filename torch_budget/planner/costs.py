"""What the things on a card cost: a KV cache per token (`CacheCost`), a workspace that grows
with attended tokens (`workspace_reserve`), and bytes set aside for what profiling did not hold
(`Reserve`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from torch_budget._validate import integer, non_negative_int, number
from torch_budget.planner.ledger import CATEGORIES


# The allocator's unit: every block, so every tag's charge, is a whole number of these bytes.
ALLOCATION_UNIT = 512


@dataclass(frozen=True)
class CacheCost:
    """What a KV cache costs: `bytes = slope * tokens + intercept`.

    slope: bytes per cached token (all layers, K and V). intercept: per-request state that does
    not grow with length (e.g. recurrent state). tensors: how many tensors the cache is allocated
    as (1: one pool; 2 per layer: K and V apart): the allocator charges each in whole units of
    ALLOCATION_UNIT bytes, so a budget must hold that rounding too (charged_for_tokens). The
    remaining fields are per-request policy of one cache; they are meaningless for a sum of caches
    and are dropped by `+`.
    """

    slope: int
    intercept: int = 0
    tensors: int = 1
    one_size: bool = True  # the tensors are all of one size (False for a sum of caches)
    max_tokens_per_request: int | None = None  # policy: longest sequence one request may hold
    policy: str | None = None  # policy: name of the cache's admission/eviction policy

    def __post_init__(self):
        for name in ("slope", "intercept"):
            value = number(getattr(self, name), f"CacheCost.{name}")
            if not math.isfinite(value):  # the plan's byte counts would be NaN or infinite
                raise ValueError(f"CacheCost.{name} must be a finite number of bytes, got {value}")
        if self.intercept < 0:
            raise ValueError(f"CacheCost.intercept must be >= 0, got {self.intercept}")
        integer(self.tensors, "CacheCost.tensors", minimum=1)
        if not isinstance(self.one_size, bool):
            raise TypeError(f"CacheCost.one_size must be True or False, got {self.one_size!r}")

    def bytes_for_tokens(self, tokens: int) -> int:
        """Whole bytes, rounded up: a fractional slope (an average over layers) never under-counts."""
        non_negative_int(tokens, "tokens")
        return math.ceil(self.slope * tokens + self.intercept)

    def charged_for_tokens(self, tokens: int) -> int:
        """What the allocator charges a tag for the cache of `tokens` tokens, at most: each of its
        `tensors` rounded up to whole ALLOCATION_UNITs (a tag budget of bytes_for_tokens() alone
        refuses the last tensor whenever the cost is not a multiple of the unit)."""
        unit, n, total = ALLOCATION_UNIT, self.tensors, self.bytes_for_tokens(tokens)
        if self.one_size:  # n tensors of total / n bytes (rounded up: never under-counts) each
            return n * ((-(-total // n) + unit - 1) // unit * unit)
        return (total + n * (unit - 1)) // unit * unit  # each may be rounded up by unit - 1 bytes

    def tokens_for_budget(self, budget_bytes: int) -> int:
        """Largest token count whose cost fits `budget_bytes`: max((b - intercept) // slope, 0); 0
        when the cache does not grow with tokens (slope <= 0 would otherwise divide by zero or go
        negative). A tag budget holds fewer: tokens_for_tag_budget."""
        if self.slope <= 0:
            return 0
        return max(int((budget_bytes - self.intercept) // self.slope), 0)

    def tokens_for_tag_budget(self, budget_bytes: int) -> int:
        """Largest token count whose cache, as the allocator charges it (charged_for_tokens), fits a
        tag budget of `budget_bytes`; 0 as tokens_for_budget."""
        hi = self.tokens_for_budget(budget_bytes)  # the cost alone fits
        if hi == 0 or self.charged_for_tokens(hi) <= budget_bytes:
            return hi
        lo = max(int((budget_bytes - self.intercept - self.tensors * ALLOCATION_UNIT) // self.slope), 0)
        # lo's cache fits (its cost leaves room for every tensor's rounding) or lo is 0; hi's does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.charged_for_tokens(mid) <= budget_bytes else (lo, mid)
        return lo

    def __add__(self, other: "CacheCost") -> "CacheCost":
        # Two caches side by side (e.g. attention KV + recurrent state): costs add, policies don't.
        if not isinstance(other, CacheCost):
            return NotImplemented
        return CacheCost(slope=self.slope + other.slope, intercept=self.intercept + other.intercept,
                         tensors=self.tensors + other.tensors, one_size=False)

    def shard(self, ways: int) -> "CacheCost":
        """Per-rank cost when tensor or context parallelism splits every token's KV `ways` ways.

        Only the slope changes (rounded up, so a rank never under-counts); `dataclasses.replace`
        keeps every other field, including ones added later.
        """
        integer(ways, "ways", minimum=1)
        slope = -(-self.slope // ways) if isinstance(self.slope, int) else math.ceil(self.slope / ways)
        return dataclasses.replace(self, slope=slope)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CacheCost":
        return cls(**d)


@dataclass(frozen=True)
class WorkspaceReserve:
    bytes: int  # set aside from the KV budget for the per-token workspace
    tokens: int  # admission cap: attended tokens per step; requests above it are deferred


def attended_token_cap(max_batch: int, max_num_tokens: int, max_seq_len: int, user_cap: int | None = None) -> int:
    """The attended-token cap L of the per-token workspace.

    Default: every sequence of the largest batch attends a full context,
    `min(max_batch, max_num_tokens) * max_seq_len`. A user cap is floored at `max_seq_len`
    (one full-length request must always be admissible) and capped at that default (a larger
    cap could never be reached, it would only take memory from the KV cache).
    """
    for name, value in (("max_batch", max_batch), ("max_num_tokens", max_num_tokens), ("max_seq_len", max_seq_len)):
        integer(value, name, minimum=1)
    default = min(max_batch, max_num_tokens) * max_seq_len
    if user_cap is None:
        return default
    integer(user_cap, "user_cap")
    return min(max(user_cap, max_seq_len), default)


def workspace_reserve(kv_bytes_per_token, workspace_bytes_per_token, budget_bytes, token_cap) -> WorkspaceReserve:
    """Split a budget between the KV cache and a workspace that grows with attended tokens.

    With k = KV bytes/token, w = workspace bytes/attended token, B = budget, L = cap:
    `reserve = min(w*L, B*w/(k+w))` - the workspace never needs more than its cap, and beyond
    that the split keeps workspace and KV in proportion so that every cached token can also be
    attended - rounded down to whole tokens: admission cap = `reserve / w` tokens. Any non-positive input means there is no
    such workspace (or nothing to split): no reserve.
    """
    k, w, b, cap = kv_bytes_per_token, workspace_bytes_per_token, budget_bytes, token_cap
    if k <= 0 or w <= 0 or b <= 0 or cap <= 0:
        return WorkspaceReserve(0, 0)
    tokens = int(min(w * cap, (b * w) // (k + w)) // w)
    return WorkspaceReserve(tokens * w, tokens)  # whole tokens only: a part of one admits nothing


@dataclass(frozen=True)
class Reserve:
    """Bytes set aside for something the profiling forward did not hold, with the reason.

    `category` is its ledger category (e.g. "graph_pools" for graphs captured after the KV pool).
    """

    name: str
    bytes: int
    reason: str
    category: str = "reserve"

    def __post_init__(self):
        # stored as an int: a numpy integer is one too, and the ledger line made of it takes ints
        object.__setattr__(self, "bytes", non_negative_int(self.bytes, f"Reserve({self.name!r}).bytes"))
        # The plan's own lines, the profile's allocator cache among them, are not reservable.
        if self.category not in CATEGORIES or self.category in ("headroom", "kv_pool", "weights", "allocator_cache"):
            raise ValueError(f"Reserve({self.name!r}) category {self.category!r} is not a reservable ledger category")

    @classmethod
    def increment(cls, name: str, profiled_bytes: int, needed_bytes: int, reason: str, category: str = "reserve") -> "Reserve":
        """Reserve only what a configuration adds over what profiling already held, e.g. a
        first-request-only table that profiling allocated at a smaller size."""
        non_negative_int(profiled_bytes, "profiled_bytes")
        non_negative_int(needed_bytes, "needed_bytes")
        return cls(name, max(needed_bytes - profiled_bytes, 0), reason, category)

