"""Ledgers from elsewhere than a plan: one built from numbers read off a running process
(`measured_ledger`, see measure.py), and one read back from JSON (`load_ledger`).

The ledger lines themselves, and their text table, are the planner's (planner/ledger.py): a
plan is made of them, and a measured ledger renders the same way, so the two can be compared
side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch_budget._validate import INT64_MAX, read_json_file
from torch_budget.planner.ledger import CATEGORIES, LedgerLine, TagBudget


def measured_ledger(
    total: int,
    *,
    weights: int,
    kv_pool: int = 0,
    activations: int = 0,
    eager_workspace: int = 0,
    graph_workspace: int = 0,
    graph_pools: int = 0,
    non_torch: int = 0,
    allocator_cache: int = 0,
    reserves: int = 0,
    source: str = "measured",
    states: dict | None = None,
) -> list[LedgerLine]:
    """A ledger from numbers read off a running process; headroom is whatever the card has left.
    `states` maps a category to the state of its memory (a released tag, see LedgerLine): its
    line is kept even when nothing of it is resident. Other lines of 0 bytes are left out."""
    if total <= 0:
        raise ValueError(f"total card bytes must be positive, got {total}")
    given = {
        "weights": weights,
        "kv_pool": kv_pool,
        "activations": activations,
        "eager_workspace": eager_workspace,
        "graph_workspace": graph_workspace,
        "graph_pools": graph_pools,
        "non_torch": non_torch,
        "allocator_cache": allocator_cache,
        "reserve": reserves,
    }
    states = states or {}
    lines = [LedgerLine(CATEGORIES[c], c, int(b), source, states.get(c, ""))
             for c, b in given.items() if b or states.get(c)]
    left = total - sum(line.bytes for line in lines)
    lines.append(LedgerLine("headroom", "headroom", left, "card bytes not on any other line"))
    return lines


def ledger_json(title: str | None, total: int, lines: list[LedgerLine], budgets: list[TagBudget] = ()) -> str:
    """A ledger as JSON that `load_report` (and `torch-budget report`) reads back."""
    data = {"title": title, "total": total, "lines": [line.to_dict() for line in lines]}
    if budgets:
        data["budgets"] = [b.to_dict() for b in budgets]
    return json.dumps(data, indent=2)


def load_ledger(path) -> tuple[str | None, int, list[LedgerLine]]:
    """Read a plan (`Plan.to_json`) or a bare ledger (`{"total": ..., "lines": [...]}`) from JSON.
    Both carry `total` and `lines`, so one reader serves both."""
    title, total, lines, _ = load_report(path)
    return title, total, lines


def load_report(path) -> tuple[str | None, int, list[LedgerLine], list[TagBudget]]:
    """`load_ledger`, and the tag budgets a measured ledger may carry (`budgets`, see
    `ledger_json`; none for a plan)."""
    path = Path(path)
    data = read_json_file(path, "ledger file")
    if not isinstance(data, dict) or "total" not in data or "lines" not in data:
        raise ValueError(f"ledger file {str(path)!r} must be a JSON object with 'total' and 'lines'")
    total = data["total"]
    if isinstance(total, bool) or not isinstance(total, int):
        raise ValueError(f"ledger file {str(path)!r}: 'total' must be the card's bytes, an integer, got {total!r}")
    if total <= 0 or total > INT64_MAX:
        raise ValueError(f"ledger file {str(path)!r}: 'total' ({total}) must be more than 0 and less than 2**63")
    if not isinstance(data["lines"], list):
        raise ValueError(f"ledger file {str(path)!r}: 'lines' must be a list of ledger lines")
    try:
        lines = [LedgerLine.from_dict(d) for d in data["lines"]]
    except ValueError as e:
        raise ValueError(f"ledger file {str(path)!r}: {e}") from None
    # A ledger explains every byte of the card (headroom takes the remainder, negative when over-committed).
    if not lines:
        raise ValueError(f"ledger file {str(path)!r}: 'lines' is empty: a ledger has a line for every part of the card")
    summed = sum(line.bytes for line in lines)
    if summed != total:
        raise ValueError(f"ledger file {str(path)!r}: its lines add up to {summed} bytes, not the card's 'total' of "
                         f"{total} ({summed - total:+d} bytes): a ledger's lines, headroom included, add up to the card")
    budgets = data.get("budgets") or []
    if not isinstance(budgets, list):
        raise ValueError(f"ledger file {str(path)!r}: 'budgets' must be a list of tag budgets")
    title = data.get("title")
    if title is not None and not isinstance(title, str):
        raise ValueError(f"ledger file {str(path)!r}: 'title' must be a string, got {title!r}")
    try:
        return title, total, lines, [TagBudget.from_dict(d) for d in budgets]
    except ValueError as e:
        raise ValueError(f"ledger file {str(path)!r}: {e}") from None
