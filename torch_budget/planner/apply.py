"""A plan enforced: its ledger lines as per-tag budgets (`Plan.apply()`, `Plan.tag_budgets()`).

Note [Plan as budgets]
Each component's memory is allocated under one tag (the weights under "weights", the KV pool
under "kv", ...), and a tag may have a budget of its own inside the device's (Note [Tag
budgets] in the core). So a plan is enforced by giving each tag the bytes of its ledger lines:
an allocation past its line is then an out-of-memory error naming the tag, while the other
tags keep serving. Lines outside torch's allocator (non-torch), the allocator's cache (torch's
memory, but no tag allocates it) and reserves of no component have no tag to hold them; the
headroom is the margin no tag may take, which is why the budgets add up to less than the card.
A line of 0 bytes (no KV cache left, a reserve of nothing) is a budget of 0: nothing may be
allocated under its tag. Before anything is set, the budgets must fit in the device's: its own
budget when one is set, else the card less what the plan puts outside torch. Budgets go through
the public set_budget, so the same budget layer checks them as any other.
install(budgets=plan.budget_settings()) sets the same budgets before any device exists, so
nothing checks that they fit it: Plan.apply() after install() does.
A tag's budget also bounds the tags of its family, "<tag>+<suffix>" (Note [Tag families] in the core):
the adapters keep a stack tag's memory under one tag per backup mode ("kv_cache", "kv_cache+cpu"), so
tags={"kv_pool": "kv_cache"} bounds all of them (the TensorRT-LLM adapter's PLAN_TAGS). A budget of
its own on "kv_cache+cpu" beside one on "kv_cache" adds nothing to what the budgets add up to.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from torch_budget.eager_workspace import WORKSPACE_TAG
from torch_budget.errors import InvalidArgumentError, PlanDoesNotFitError, StateError
from torch_budget.planner.ledger import CATEGORIES, LedgerLine
from torch_budget.units import format_bytes

# Ledger category -> the tag its memory is allocated under (the demo's and the adapters' names).
TAGS = {
    "weights": "weights",
    "kv_pool": "kv",
    "activations": "activations",
    "eager_workspace": WORKSPACE_TAG,
    "graph_workspace": "graphs",
    "graph_pools": "graphs",
}
# The categories no tag holds: memory outside torch, the allocator's cache, reserves of no
# component, the margin.
UNBUDGETED = ("non_torch", "allocator_cache", "reserve", "headroom")


def tag_budgets(lines: list[LedgerLine], tags: dict[str, str] | None = None) -> dict[str, int]:
    """{tag: bytes} of a plan's lines: each tag gets the sum of its categories' lines (`tags`
    maps a category to its tag, TAGS by default). A tag whose lines add up to 0 gets a budget of
    0: the plan gives it nothing, so nothing may be allocated under it (a tag the plan has no
    line for gets no budget)."""
    tags = TAGS if tags is None else _checked_tags(tags)
    unknown = sorted(set(tags) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"tags name ledger categories {unknown} that are not among {list(CATEGORIES)}")
    out: dict[str, int] = {}
    for line in lines:
        tag = tags.get(line.category)
        if tag is not None:
            out[tag] = out.get(tag, 0) + line.bytes
    return out


def _checked_tags(tags) -> dict[str, str | None]:
    """`tags` as given to tag_budgets(): a dict of ledger category -> tag (a str, or None for no tag)."""
    if not isinstance(tags, dict):
        raise TypeError(f"tags maps ledger categories to tags, as a dict (like planner.TAGS), got "
                        f"{type(tags).__name__} ({tags!r})")
    for category, tag in tags.items():
        if not isinstance(category, str) or not (tag is None or isinstance(tag, str)):
            raise TypeError(f"tags maps a ledger category (str) to a tag (str, or None for none), got "
                            f"{category!r}: {tag!r}")
    return tags


def bounds(lines: list[LedgerLine], tags: dict[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """{tag: (category of its largest line, names of its lines)}: what each budget bounds, for
    the ledger's budget table (report.tag_budgets)."""
    tags = TAGS if tags is None else tags
    by_tag: dict[str, list[LedgerLine]] = {}
    for line in lines:
        if tags.get(line.category) is not None:
            by_tag.setdefault(tags[line.category], []).append(line)
    return {tag: (max(group, key=lambda l: l.bytes).category, ", ".join(l.name for l in group))
            for tag, group in by_tag.items()}


def as_setting(n):
    """Bytes as install() and set_budget read them whatever their size, the parser's own
    ("bytes", n) (a bare number under 1 MiB is refused there, as a likely slip for a
    fraction); None stays None."""
    return None if n is None else ("bytes", int(n))


# Note [Plans in force on a device]
# The plans applied on a device form a stack, the last applied in force. apply() over an earlier plan
# puts the tags the earlier plan set and this one does not back to their budgets from before the
# earlier plan, so only the new plan's budgets bound the device; its `previous` keeps the budgets in
# force just before it (the earlier plan's), so its undo() brings the earlier plan back, as nested
# `with plan.apply():` blocks expect. Undoing a plan below the top changes no budget now: the plan
# just above it takes over its `previous` for the tags it had set, so that undoing that one later
# returns to the state from before both. The fit check counts every budget that will be in force,
# the tags the plan does not name included. _lock makes apply() and undo() one step each for other
# threads.
_lock = threading.RLock()
_in_force: dict[int, list["AppliedBudgets"]] = {}


@dataclass(eq=False)
class AppliedBudgets:
    """What `Plan.apply()` set: `budgets` {tag: bytes} on each of `devices`, and `previous`
    {device: {tag: the budget in force before this plan, None for none}} of the devices where it
    is still applied. `undo()` puts the previous ones back; used as a context manager, the block's
    end undoes them, and a second block raises StateError (one entered inside the first, or after
    it or an undo(), would run without the budgets)."""

    budgets: dict[str, int]
    devices: tuple[int, ...]
    previous: dict[int, dict[str, int | None]] = field(default_factory=dict)
    undone: bool = False
    _entered: bool = field(default=False, init=False, repr=False)  # a block is entered once

    def undo(self) -> None:
        """Restore every tag's budget from before the plan (removing those it did not have), where
        this plan is the last applied: the plan it was applied over is in force again; idempotent.
        Where a later plan is applied over it, nothing changes now, and undoing that one returns to
        the budgets from before both (Note [Plans in force on a device]). A budget that cannot go
        back (its tag now holds more than it) does not stop the others: each is tried, the first
        refusal is raised after, naming the tags left on the plan's budget, and a later undo()
        tries those again."""
        with _lock:
            if self.undone:
                return
            from torch_budget import allocator

            first: Exception | None = None
            left: list[str] = []
            for device in self.devices:  # a plan that set no tag there is on the stack too
                tags = self.previous.setdefault(device, {})
                stack = _in_force.get(device, [])
                at = next((i for i, p in enumerate(stack) if p is self), None)
                if at is not None and at + 1 < len(stack):  # a later plan is applied over this one
                    stack[at + 1].previous.setdefault(device, {}).update(tags)
                    tags.clear()
                for tag, budget in list(tags.items()):
                    try:
                        allocator.set_budget(as_setting(budget), device=device, tag=tag)
                    except Exception as e:  # noqa: BLE001 -- raised after the other tags went back
                        first = first or e
                        left.append(f"{tag!r} on device {device}")
                    else:
                        del tags[tag]
                if not tags and at is not None:
                    del stack[at]
            if first is not None:
                first.add_note(f"undo() restored every other budget; {', '.join(left)} stayed on the plan's "
                               "budget: free memory of those tags, then call undo() again")
                raise first
            self.previous.clear()
            self.undone = True

    def __enter__(self) -> "AppliedBudgets":
        # A second block (after the first, or inside it) would run without the budgets once either ended.
        if self._entered or self.undone:
            state = "were undone" if self.undone else "were entered in a block already"
            raise StateError(f"the plan's budgets {state}: a block enters an applied plan once, and its end "
                             "undoes it; apply the plan again for another block")
        self._entered = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.undo()
            return
        # The block's own exception goes on; an undo that fails too is noted on it.
        try:
            self.undo()
        except Exception as e:  # noqa: BLE001 -- the body's exception is the one that matters
            exc.add_note(f"and undoing the plan's budgets failed: {type(e).__name__}: {e}")


def _room(stats: dict, outside_torch: int) -> tuple[int, str]:
    """Bytes the tags' budgets may add up to on a device, and where that figure comes from."""
    if stats["budget"] is not None:
        return stats["budget"], f"its budget of {format_bytes(stats['budget'])}"
    return (stats["total"] - outside_torch,
            f"the card ({format_bytes(stats['total'])}, no budget set) less the plan's "
            f"{format_bytes(outside_torch)} outside torch")


def check_fits(budgets: dict[str, int], stats: dict, *, outside_torch: int, planned_total: int,
               others: dict[str, int] | None = None) -> None:
    """PlanDoesNotFitError unless `budgets`, with `others` {tag: bytes} (the budgets of tags the plan
    does not name that stay in force), fit the device `stats` describes (see the Note)."""
    from torch_budget.allocator import family_allocated, family_head

    device = stats["device"]
    others = {tag: n for tag, n in (others or {}).items() if tag not in budgets}
    # A tag whose family head has a budget in force holds part of what that budget bounds, no more
    # (Note [Tag families]): its own budget adds nothing to the sum.
    inside = {tag: head for tag in (*budgets, *others)
              if (head := family_head(tag)) is not None and (head in budgets or head in others)}
    need = sum(n for tag, n in (*budgets.items(), *others.items()) if tag not in inside)
    room, where = _room(stats, outside_torch)
    if need > room:
        def part(tag: str, n: int) -> str:
            return f"{tag} {format_bytes(n)}" + (f" (inside {inside[tag]}'s)" if tag in inside else "")

        parts = ", ".join(part(tag, n) for tag, n in budgets.items())
        if others:
            parts += "; and of tags the plan does not name, " + ", ".join(part(tag, n) for tag, n in others.items())
        card = ("" if planned_total == stats["total"] else
                f" The plan was made for a card of {format_bytes(planned_total)}; this one has "
                f"{format_bytes(stats['total'])}.")
        raise PlanDoesNotFitError(
            f"the plan does not fit device {device}: the tag budgets in force would add up to {format_bytes(need)} "
            f"({parts}), {format_bytes(need - room)} more than {where}.{card} Plan on this device's own profile, "
            "lower the plan's fraction, remove other tags' budgets, or raise the device budget "
            "(torch_budget.set_budget(...), install(budget=...))")
    held = {name: entry["allocated"] for name, entry in stats["by_tag"].items()}
    over = {tag: family_allocated(held, tag) for tag, n in budgets.items() if family_allocated(held, tag) > n}
    if over:
        said = ", ".join(f"{tag!r} has {format_bytes(used)} allocated, the plan gives it {format_bytes(budgets[tag])}"
                         for tag, used in over.items())
        raise PlanDoesNotFitError(
            f"the plan does not fit what device {device} holds already: {said}. Plan from a profile taken with "
            "these allocations in place, or free them before apply()")


def _staying(stats: dict, earlier: dict[str, int | None]) -> dict[str, int]:
    """{tag: bytes} of the budgets that stay in force beside a new plan on a device: those set now,
    the tags an earlier plan set back at their budgets from before it (`earlier`)."""
    out = {tag: entry["budget"] for tag, entry in stats["by_tag"].items() if entry["budget"] is not None}
    for tag, before in earlier.items():
        if before is None:
            out.pop(tag, None)
        else:
            out[tag] = before
    return out


def apply(budgets: dict[str, int], *, outside_torch: int, planned_total: int, device=None) -> AppliedBudgets:
    """Set `budgets` {tag: bytes} on `device` (None: the current device; "all": every device
    torch_budget serves now, at least one) after checking that they fit every one (check_fits),
    over a plan applied there before (Note [Plans in force on a device]); a failure part
    way restores what was set and raises, the AppliedBudgets as the error's `applied` where even
    that failed. Needs torch_budget.install() (NotInstalledError)."""
    from torch_budget import _runtime, allocator

    lib = _runtime.require_installed("Plan.apply()")
    devices = tuple(_runtime.device_indices(lib, device))
    if not devices:
        # A plan is checked against each device it is set on, so it is never set ahead of one.
        raise InvalidArgumentError("Plan.apply(device='all'): no device serves allocations yet, so 'all' names "
                                   "none; apply the plan to a device by index (it is checked against that "
                                   "device), or after the first allocation")
    with _lock:
        seen, earlier = {}, {}
        for dev in devices:
            seen[dev] = allocator.stats(dev)
            # the plan in force: the tags it set go back to what they were before it, unless this one sets them
            stack = _in_force.get(dev)
            top = stack[-1] if stack else None  # what it set; the tags it reset are at their old values already
            earlier[dev] = {t: b for t, b in top.previous.get(dev, {}).items() if t in top.budgets} if top else {}
            check_fits(budgets, seen[dev], outside_torch=outside_torch, planned_total=planned_total,
                       others=_staying(seen[dev], earlier[dev]))
        applied = AppliedBudgets(dict(budgets), devices)
        done: list[tuple[int, str, int | None]] = []  # (device, tag, budget before this call): for a rollback
        try:
            for dev in devices:
                by_tag = seen[dev]["by_tag"]
                # The earlier plan's tags that this one does not set go back first (they free room),
                # then this plan's; each one's budget before is what undo() and a rollback put back.
                wanted = {t: b for t, b in earlier[dev].items() if t not in budgets} | budgets
                for tag, n in wanted.items():
                    before = by_tag[tag]["budget"] if tag in by_tag else None
                    allocator.set_budget(as_setting(n), device=dev, tag=tag)
                    done.append((dev, tag, before))
                    applied.previous.setdefault(dev, {})[tag] = before
        except BaseException as failure:
            _roll_back(done, failure, applied)
            raise
        for dev in devices:
            _in_force.setdefault(dev, []).append(applied)
        return applied


def _roll_back(done: list, failure: BaseException, applied: AppliedBudgets) -> None:
    """Puts back the budgets apply() set before `failure`, latest first; where one cannot go back,
    notes it on `failure` with undo()'s own advice, and hands the caller `applied` to undo later."""
    from torch_budget import allocator

    stuck = []
    applied.previous.clear()  # what stays to undo is only what could not go back
    for dev, tag, before in reversed(done):
        try:
            allocator.set_budget(as_setting(before), device=dev, tag=tag)
        except Exception as e:  # noqa: BLE001 -- the failure that stopped apply() is the one raised
            stuck.append(f"{tag!r} on device {dev} ({type(e).__name__}: {e})")
            applied.previous.setdefault(dev, {})[tag] = before
    if stuck:
        failure.add_note("and putting back the budgets set before it failed too: " + "; ".join(stuck) +
                         ". Those stay on the budget apply() gave them: free memory of those tags, then call "
                         "undo() on this error's `applied`")
        failure.applied = applied
