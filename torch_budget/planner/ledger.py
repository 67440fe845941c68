"""The ledger of one card: its lines and their text table.

A ledger is a list of `LedgerLine`s whose bytes add up to the card: weights, KV pool,
activations, eager and graph workspaces, graph pools, memory outside torch, the allocator's
cache (what torch reserved beyond what it allocated), reserves, and the headroom that is
left. `plan()` produces one; `torch_budget.report` builds one from numbers read off a running
process, reads one from JSON and draws one. Both render the same way, so a plan
and a measurement can be compared side by side.

A line whose memory is released (a tag put to sleep, torch_budget.sleep) carries a `state`
such as "released 1.20 GiB, backup pinned"; its bytes are what is still resident, the only
bytes that count toward the card.

Beside the lines, a ledger may carry the tags that have budgets of their own (`TagBudget`,
Note [Tag budgets] in the core; `Plan.apply()` sets them): each tag's budget, what is
allocated under it and its headroom. A tag's budget may bound several lines (the graphs tag
holds the graph pools and the static buffers), so budgets are a table of their own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch_budget._validate import INT64_MAX, is_int
from torch_budget.units import format_bytes

# Ledger categories and their display labels, in the order they are stacked on the bar: what is
# resident first, what is left last.
CATEGORIES = {
    "weights": "weights",
    "kv_pool": "KV pool",
    "activations": "activations",
    "eager_workspace": "eager workspace",
    "graph_workspace": "graph workspace",
    "graph_pools": "graph pools",
    "non_torch": "non-torch",
    "allocator_cache": "allocator cache",
    "reserve": "reserves",
    "headroom": "headroom",
}


@dataclass(frozen=True)
class LedgerLine:
    """One line of the ledger. `bytes` may be negative only for headroom, meaning the other
    lines over-commit the card by that much. `state` is empty for resident memory, else what is
    not resident (released bytes and their backup); `bytes` then counts only what is."""

    name: str
    category: str
    bytes: int
    reason: str
    state: str = ""

    def __post_init__(self):
        if not is_int(self.bytes):
            raise TypeError(f"ledger line {self.name!r} has bytes {self.bytes!r}; bytes are a whole number (int)")
        object.__setattr__(self, "bytes", self.bytes.__index__())  # a numpy integer becomes an int
        if self.category not in CATEGORIES:
            raise ValueError(f"ledger category {self.category!r} is not one of {list(CATEGORIES)}")
        if self.bytes < 0 and self.category != "headroom":
            raise ValueError(f"ledger line {self.name!r} has negative bytes ({self.bytes}); only headroom may")
        if abs(self.bytes) > INT64_MAX:
            raise ValueError(f"ledger line {self.name!r} has {self.bytes} bytes; a line holds less than 2**63")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LedgerLine":
        if not isinstance(d, dict):
            raise ValueError(f"a ledger line must be an object with name, category and bytes, got {d!r}")
        try:
            nbytes = d["bytes"]
            if isinstance(nbytes, bool) or not isinstance(nbytes, int):
                raise ValueError(f"ledger line {d!r}: 'bytes' must be an integer")
            return cls(name=str(d["name"]), category=str(d["category"]), bytes=nbytes,
                       reason=str(d.get("reason", "")), state=str(d.get("state") or ""))
        except KeyError as e:
            raise ValueError(f"ledger line {d!r} lacks the key {e.args[0]!r}") from None


@dataclass(frozen=True)
class TagBudget:
    """A tag's own budget and what it holds: `used` bytes allocated under it now, `peak` the
    most allocated under it since the peaks were last reset (None when not known). `category`
    is the ledger category of the memory it bounds (its colour in the picture); `lines` names
    the ledger lines it bounds."""

    tag: str
    budget: int
    used: int
    peak: int | None = None
    category: str = "reserve"
    lines: str = ""

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"tag {self.tag!r}: ledger category {self.category!r} is not one of {list(CATEGORIES)}")
        for name in ("budget", "used", "peak"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"tag {self.tag!r} has negative {name} ({value})")
            if value is not None and value > INT64_MAX:
                raise ValueError(f"tag {self.tag!r}: {name} {value} is past 2**63 bytes")

    @property
    def headroom(self) -> int:
        """What may still be allocated under the tag: budget - used."""
        return self.budget - self.used

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TagBudget":
        if not isinstance(d, dict):
            raise ValueError(f"a tag budget must be an object with tag, budget and used, got {d!r}")
        missing = [key for key in ("tag", "budget", "used") if key not in d]
        if missing:
            raise ValueError(f"tag budget {d!r} lacks the key {missing[0]!r}")
        counts = {name: d[name] for name in ("budget", "used")}
        if d.get("peak") is not None:
            counts["peak"] = d["peak"]
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"tag budget {d!r}: {name!r} must be a number of bytes, an integer, got {value!r}")
        return cls(tag=str(d["tag"]), category=str(d.get("category") or "reserve"), lines=str(d.get("lines") or ""),
                   **counts)


def _aligned(header: tuple, rows: list, right: set) -> list[str]:
    """Rows as text, each column as wide as its widest cell (right-aligned for the columns in
    `right`); the last column is left as it is."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    out = []
    for r in [header, *rows]:
        cells = [f"{c:>{w}}" if i in right else f"{c:<{w}}" for i, (c, w) in enumerate(zip(r[:-1], widths))]
        out.append("  ".join([*cells, r[-1]]).rstrip())
    return out


def format_budgets(budgets: list[TagBudget]) -> str:
    """The tag budgets as an aligned table: budget, in use, headroom, peak (and its share of
    the budget), and the lines each bounds."""
    def share(b: TagBudget) -> str:
        return "-" if b.peak is None or b.budget <= 0 else f"{100.0 * b.peak / b.budget:.1f}%"

    header = ("tag", "budget", "in use", "headroom", "peak", "peak/budget", "bounds")
    rows = [(b.tag, format_bytes(b.budget), format_bytes(b.used), format_bytes(b.headroom),
             "-" if b.peak is None else format_bytes(b.peak), share(b), b.lines) for b in budgets]
    text = _aligned(header, rows, right={1, 2, 3, 4, 5})
    rule = "-" * max(map(len, text))
    return "\n".join(["tag budgets: what may be allocated under each tag, inside the device budget", text[0], rule,
                      *text[1:]])


def format_table(lines: list[LedgerLine], total: int, title: str | None = None,
                 budgets: list[TagBudget] = ()) -> str:
    """Aligned text table: line, category, size, share of the card, and why; a state column
    (released bytes and backup) when some line is not all resident. Sizes are resident bytes.
    With `budgets`, the tags' own budgets follow (format_budgets)."""
    if total <= 0:
        raise ValueError(f"total card bytes must be positive, got {total}")
    stated = any(line.state for line in lines)
    rows = [
        (line.name, CATEGORIES[line.category], format_bytes(line.bytes), f"{100.0 * line.bytes / total:.1f}%",
         *([line.state] if stated else []), line.reason)
        for line in lines
    ]
    accounted = sum(line.bytes for line in lines)
    blank = [""] if stated else []
    footer = [("sum of lines", "", format_bytes(accounted), f"{100.0 * accounted / total:.1f}%", *blank, ""),
              ("card", "", format_bytes(total), "100.0%", *blank, f"{total} bytes")]
    header = ("line", "category", "size", "% card", *(["state"] if stated else []), "why")
    widths = [max(len(r[i]) for r in [header, *rows, *footer]) for i in range(len(header) - 1)]

    def fmt(r):
        cells = [f"{r[0]:<{widths[0]}}", f"{r[1]:<{widths[1]}}", f"{r[2]:>{widths[2]}}", f"{r[3]:>{widths[3]}}"]
        cells += [f"{c:<{w}}" for c, w in zip(r[4:-1], widths[4:])]
        return "  ".join([*cells, r[-1]]).rstrip()

    body = [fmt(r) for r in rows]
    rule = "-" * max(len(r) for r in [fmt(header), *body])
    out = [title] if title else []
    out += [fmt(header), rule, *body, rule, *map(fmt, footer)]
    if budgets:
        out += ["", format_budgets(list(budgets))]
    return "\n".join(out)
