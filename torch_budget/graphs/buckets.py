"""Which sizes are captured: the bucket rule, and padding a step up to a bucket."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._validate import is_int, non_negative_int, positive_int
from ..errors import InvalidArgumentError

# Note [Buckets are part of the budget]
# A captured graph has fixed shapes, so every step is padded up to a captured size; the
# padding is forced, not an optimization. The set of sizes is a trade: denser buckets waste
# less compute on padding but mean more graphs, longer start-up and more resident memory
# (static buffers are sized by the largest bucket; each graph keeps its exec and pool
# blocks). So the set is computed by a rule with explicit stages, and the stages that cut it
# down (divisibility, memory, count) are knobs of the budget:
#   candidates -> filter (divisible_by, memory_limit, max_count) -> resolve (sort, dedup).
# The user's max is always a candidate, but a filter may drop it; then steps above the
# largest surviving bucket run eagerly, and static buffers stay at that smaller size.


@dataclass(frozen=True)
class BucketRule:
    """The rule that turns a max batch / max token count into the captured sizes.

    Candidates are `small` (those <= max_size), then multiples of `step` below
    `coarse_from`, then multiples of `coarse_step` from `coarse_from`, then `max_size`.
    Filters then drop sizes not divisible by `divisible_by` (e.g. the tensor-parallel
    size when tokens are split across ranks), sizes whose `cost(size)` exceeds
    `memory_limit` bytes, and thin the set to `max_count` sizes (keeping the smallest and
    the largest, spread evenly in between). See Note [Buckets are part of the budget].
    """

    max_size: int
    small: tuple = (1, 2, 4)
    step: int = 8
    coarse_from: int = 256
    coarse_step: int = 16
    divisible_by: int = 1
    max_count: int | None = None
    memory_limit: int | None = None

    def __post_init__(self) -> None:
        # Checked and stored as plain ints (numpy or 0-dim tensor integers would otherwise
        # end up among the buckets).
        for field in ("max_size", "step", "coarse_from", "coarse_step", "divisible_by"):
            object.__setattr__(self, field, positive_int(getattr(self, field), f"BucketRule.{field}"))
        small = tuple(positive_int(size, f"BucketRule.small entry {size!r}") for size in self.small)
        object.__setattr__(self, "small", small)
        if self.max_count is not None:
            object.__setattr__(self, "max_count", positive_int(self.max_count, "BucketRule.max_count"))
        if self.memory_limit is not None:
            limit = non_negative_int(self.memory_limit, "BucketRule.memory_limit (bytes)")
            object.__setattr__(self, "memory_limit", limit)

    def candidates(self) -> list[int]:
        """Every size the rule would capture before any filter."""
        top = self.max_size
        sizes = [s for s in self.small if s <= top]
        sizes += range(self.step, min(self.coarse_from, top + 1), self.step)
        if self.coarse_from <= top:
            sizes += range(self.coarse_from, top + 1, self.coarse_step)
        sizes.append(top)
        return sizes

    def filter(self, sizes: Sequence[int], cost: Callable[[int], int] | None = None) -> list[int]:
        """Drop the sizes the budget cannot afford; `cost(size)` is bytes for `memory_limit`."""
        kept = sorted({s for s in sizes if s % self.divisible_by == 0})
        if self.memory_limit is not None:
            if cost is None:
                raise InvalidArgumentError(
                    f"BucketRule.memory_limit={self.memory_limit} needs a cost function "
                    "(bytes per bucket) to compare against"
                )
            kept = [s for s in kept if cost(s) <= self.memory_limit]
        if self.max_count is not None and len(kept) > self.max_count:
            last = len(kept) - 1
            if self.max_count == 1:
                kept = [kept[last]]
            else:
                picks = {round(i * last / (self.max_count - 1)) for i in range(self.max_count)}
                kept = [kept[i] for i in sorted(picks)]
        return kept

    def resolve(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """Sorted, deduplicated sizes; an empty set is an error, not a silent eager fallback."""
        resolved = tuple(sorted(set(sizes)))
        if not resolved:
            raise InvalidArgumentError(f"{self!r} leaves no bucket to capture; relax divisible_by, memory_limit or max_count")
        return resolved

    def buckets(self, cost: Callable[[int], int] | None = None) -> tuple[int, ...]:
        """candidates -> filter -> resolve."""
        return self.resolve(self.filter(self.candidates(), cost))


def resolve_buckets(spec: BucketRule | int | Sequence[int],
                    cost: Callable[[int], int] | None = None) -> tuple[int, ...]:
    """Buckets from a rule, from a max size (default rule) or from an explicit list."""
    if isinstance(spec, BucketRule):
        return spec.buckets(cost)
    if is_int(spec):
        return BucketRule(spec).buckets(cost)
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
        raise TypeError(f"buckets must be a BucketRule, a max size or a list of sizes, got {spec!r}")
    sizes = [positive_int(size, f"bucket {size!r}") for size in spec]
    if not sizes:
        raise InvalidArgumentError("buckets must not be empty")
    return tuple(sorted(set(sizes)))


def pad_to_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket >= n, or None when n is above the largest (run that step eagerly).

    `buckets` must be sorted ascending.
    """
    n = positive_int(n, "row count n")
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None
