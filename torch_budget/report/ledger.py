"""The ledger of one card: where every byte goes, as a text table and as a picture.

A ledger is a list of `LedgerLine`s whose bytes add up to the card: weights, KV pool,
activations, eager and graph workspaces, graph pools, memory outside torch, reserves, and the
headroom that is left. `budget.plan()` produces one; `measured_ledger()` builds one from numbers
read off a running process. Both render the same way, so a plan and a measurement can be
compared side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30

# Ledger categories in the order they are stacked on the bar: what is resident first, what is
# left last. Each has a display label and a colour (colour-blind-safe palette).
CATEGORIES = {
    "weights": ("weights", "#0072B2"),
    "kv_pool": ("KV pool", "#009E73"),
    "activations": ("activations", "#D55E00"),
    "eager_workspace": ("eager workspace", "#E69F00"),
    "graph_workspace": ("graph workspace", "#CC79A7"),
    "graph_pools": ("graph pools", "#882255"),
    "non_torch": ("non-torch", "#56B4E9"),
    "reserve": ("reserves", "#999933"),
    "headroom": ("headroom", "#DDDDDD"),
}


@dataclass(frozen=True)
class LedgerLine:
    """One line of the ledger. `bytes` may be negative only for headroom, meaning the other
    lines over-commit the card by that much."""

    name: str
    category: str
    bytes: int
    reason: str

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"ledger category {self.category!r} is not one of {list(CATEGORIES)}")
        if self.bytes < 0 and self.category != "headroom":
            raise ValueError(f"ledger line {self.name!r} has negative bytes ({self.bytes}); only headroom may")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LedgerLine":
        try:
            return cls(name=str(d["name"]), category=str(d["category"]), bytes=int(d["bytes"]), reason=str(d.get("reason", "")))
        except KeyError as e:
            raise ValueError(f"ledger line {d!r} lacks the key {e.args[0]!r}") from None


def format_bytes(n: int) -> str:
    """GiB from 1 GiB up, MiB below; signed so an over-commitment reads as such."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


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
    reserves: int = 0,
    source: str = "measured",
) -> list[LedgerLine]:
    """A ledger from numbers read off a running process; headroom is whatever the card has left."""
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
        "reserve": reserves,
    }
    lines = [LedgerLine(CATEGORIES[c][0], c, int(b), source) for c, b in given.items() if b]
    left = total - sum(line.bytes for line in lines)
    lines.append(LedgerLine("headroom", "headroom", left, "card bytes not on any other line"))
    return lines


def format_table(lines: list[LedgerLine], total: int, title: str | None = None) -> str:
    """Aligned text table: line, category, size, share of the card, and why."""
    if total <= 0:
        raise ValueError(f"total card bytes must be positive, got {total}")
    rows = [
        (line.name, CATEGORIES[line.category][0], format_bytes(line.bytes), f"{100.0 * line.bytes / total:.1f}%", line.reason)
        for line in lines
    ]
    accounted = sum(line.bytes for line in lines)
    footer = [("sum of lines", "", format_bytes(accounted), f"{100.0 * accounted / total:.1f}%", ""),
              ("card", "", format_bytes(total), "100.0%", f"{total} bytes")]
    header = ("line", "category", "size", "% card", "why")
    widths = [max(len(r[i]) for r in [header, *rows, *footer]) for i in range(4)]

    def fmt(r):
        return (f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}").rstrip()

    body = [fmt(r) for r in rows]
    rule = "-" * max(len(r) for r in [fmt(header), *body])
    out = [title] if title else []
    out += [fmt(header), rule, *body, rule, *map(fmt, footer)]
    return "\n".join(out)


def _shades(lines: list[LedgerLine]) -> list:
    # Lines of one category share a hue; later ones are lighter so neighbours stay distinguishable.
    from matplotlib.colors import to_rgb

    seen: dict[str, int] = {}
    colours = []
    for line in lines:
        i = seen.get(line.category, 0)
        seen[line.category] = i + 1
        base = to_rgb(CATEGORIES[line.category][1])
        mix = min(0.2 * i, 0.6)
        colours.append(tuple(c + (1.0 - c) * mix for c in base))
    return colours


def write_png(lines: list[LedgerLine], total: int, path, title: str | None = None) -> Path:
    """Draw the card as one horizontal stacked bar (GiB axis) with a legend below that names each
    line with its size and share. Renders through the Agg canvas directly, without pyplot, so it
    works without a display and leaves the caller's matplotlib backend alone."""
    if total <= 0:
        raise ValueError(f"total card bytes must be positive, got {total}")
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import Patch

    path = Path(path)
    colours = _shades(lines)
    over = sum(line.bytes for line in lines if line.bytes > 0) > total
    ncol = min(3, max(len(lines), 1))
    # The legend sits below the axes; bbox_inches="tight" grows the canvas to fit it.
    fig = Figure(figsize=(12, 2.0), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    left = 0.0
    handles = []
    for line, colour in zip(lines, colours):
        share = 100.0 * line.bytes / total
        handles.append(Patch(facecolor=colour, edgecolor="#444444",
                             label=f"{line.name}: {format_bytes(line.bytes)} ({share:.1f}%)"))
        if line.bytes <= 0:
            continue
        width = line.bytes / GiB
        ax.barh(0, width, left=left, height=0.8, color=colour, edgecolor="white", linewidth=1.0,
                hatch="//" if line.category == "headroom" else None)
        if share >= 6.0:
            ax.text(left + width / 2, 0, f"{line.name}\n{share:.0f}%", ha="center", va="center", fontsize=9,
                    color="black" if line.category == "headroom" else "white")
        left += width
    ax.axvline(total / GiB, color="black", linewidth=1.5)
    ax.set_xlim(0, max(total / GiB, left))
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ax.set_xlabel("GiB")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    subtitle = f"card {format_bytes(total)}"
    if over:
        subtitle += f" - OVER-COMMITTED by {format_bytes(sum(l.bytes for l in lines if l.bytes > 0) - total)}"
    ax.set_title(title or "device memory ledger", fontsize=13, pad=24)
    ax.text(0.5, 1.03, subtitle, transform=ax.transAxes, ha="center", va="bottom", fontsize=10,
            color="#B00000" if over else "#333333")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=ncol,
              fontsize=9, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight", pad_inches=0.2)
    return path


def load_ledger(path) -> tuple[str | None, int, list[LedgerLine]]:
    """Read a plan (`Plan.to_json`) or a bare ledger (`{"total": ..., "lines": [...]}`) from JSON.
    Both carry `total` and `lines`, so one reader serves both."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"ledger file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"ledger file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or "total" not in data or "lines" not in data:
        raise ValueError(f"ledger file {str(path)!r} must be a JSON object with 'total' and 'lines'")
    total = int(data["total"])
    if total <= 0:
        raise ValueError(f"ledger file {str(path)!r} has a non-positive total ({total})")
    lines = [LedgerLine.from_dict(d) for d in data["lines"]]
    return data.get("title"), total, lines


def cli_report(argv: list[str]) -> int:
    """`torch-budget report LEDGER.json [--out PNG]`: print the table and write the picture."""
    parser = argparse.ArgumentParser(prog="torch-budget report",
                                     description="Render a plan or ledger JSON as a table and a PNG.")
    parser.add_argument("ledger", help="JSON written by `torch-budget plan --json` or Plan.to_json()")
    parser.add_argument("--out", help="PNG path (default: the ledger path with .png)")
    parser.add_argument("--title", help="title for the table and the picture")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        title, total, lines = load_ledger(args.ledger)
        title = args.title or title
        out = Path(args.out) if args.out else Path(args.ledger).with_suffix(".png")
        print(format_table(lines, total, title))
        write_png(lines, total, out, title)
    except (ValueError, OSError) as e:
        print(f"torch-budget report: error: {e}", file=sys.stderr)
        return 2
    print(f"picture written to {out}")
    return 0
