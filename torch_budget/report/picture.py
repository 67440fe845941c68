"""The ledger as a picture: one horizontal stacked bar of the card, with a legend.

matplotlib is an optional dependency (`pip install torch_budget[plot]`); without it,
write_png raises ImportError saying how to get it.
"""

from __future__ import annotations

from pathlib import Path

from torch_budget.planner.ledger import LedgerLine, TagBudget
from torch_budget.units import GiB, format_bytes

# One colour per ledger category (planner/ledger.py), from a colour-blind-safe palette.
COLOURS = {
    "weights": "#0072B2",
    "kv_pool": "#009E73",
    "activations": "#D55E00",
    "eager_workspace": "#E69F00",
    "graph_workspace": "#CC79A7",
    "graph_pools": "#882255",
    "non_torch": "#56B4E9",
    "allocator_cache": "#332288",
    "reserve": "#999933",
    "headroom": "#DDDDDD",
}


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing the ledger needs matplotlib: pip install 'torch_budget[plot]' "
                          "(or pip install matplotlib)") from None
    return matplotlib


def _shades(lines: list[LedgerLine]) -> list:
    # Lines of one category share a hue; later ones are lighter so neighbours stay distinguishable.
    from matplotlib.colors import to_rgb

    seen: dict[str, int] = {}
    colours = []
    for line in lines:
        i = seen.get(line.category, 0)
        seen[line.category] = i + 1
        base = to_rgb(COLOURS[line.category])
        mix = min(0.2 * i, 0.6)
        colours.append(tuple(c + (1.0 - c) * mix for c in base))
    return colours


def _budget_bars(ax, budgets: list[TagBudget]) -> None:
    """One bar per tag with a budget, each as a share of its own budget (tags differ by orders of
    magnitude): what is allocated under it filled, its headroom hatched, its peak a black tick;
    the figures beside the bar."""
    from matplotlib.colors import to_rgb

    for i, b in enumerate(budgets):
        y = len(budgets) - 1 - i
        used = 100.0 * b.used / b.budget if b.budget else 0.0
        ax.barh(y, 100.0, height=0.6, color="white", edgecolor="#444444", linewidth=1.0)
        ax.barh(y, used, height=0.6, color=to_rgb(COLOURS[b.category]), edgecolor="none")
        ax.barh(y, max(100.0 - used, 0.0), left=used, height=0.6, color="none", edgecolor="#999999", hatch="//",
                linewidth=0)
        if b.peak is not None and b.budget:
            ax.plot([100.0 * b.peak / b.budget] * 2, [y - 0.36, y + 0.36], color="black", linewidth=1.5)
        peak = "" if b.peak is None else f", peak {format_bytes(b.peak)}"
        ax.text(102.0, y, f"{format_bytes(b.used)} of {format_bytes(b.budget)}, headroom {format_bytes(b.headroom)}"
                f"{peak}", va="center", fontsize=9)
    ax.set_yticks(range(len(budgets)), [b.tag for b in reversed(budgets)])
    ax.set_xlim(0, 160.0)  # room for the figures on the right
    ax.set_xticks([0, 25, 50, 75, 100])
    ax.set_ylim(-0.6, len(budgets) - 0.4)
    ax.set_xlabel("% of the tag's budget")
    ax.set_title("tag budgets: in use (filled), headroom (hatched), peak (tick)", fontsize=11)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def write_png(lines: list[LedgerLine], total: int, path, title: str | None = None,
              budgets: list[TagBudget] = ()) -> Path:
    """Draw the card as one horizontal stacked bar (GiB axis) with a legend below that names each
    line with its size and share (and its state when it is released: the bar holds only
    resident bytes); with `budgets`, a panel below with each tag's budget, use, headroom and
    peak. Renders through the Agg canvas directly, without pyplot, so it works without a
    display and leaves the caller's matplotlib backend alone."""
    if total <= 0:
        raise ValueError(f"total card bytes must be positive, got {total}")
    _matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import Patch

    path = Path(path)
    colours = _shades(lines)
    over = sum(line.bytes for line in lines if line.bytes > 0) > total
    ncol = min(3, max(len(lines), 1))
    budgets = list(budgets)
    # The legend sits below the bar; bbox_inches="tight" grows the canvas to fit it. The budget
    # panel goes below the legend: its rows (about 0.22 in each) decide the gap.
    bar_in = 2.0
    legend_in = 0.2 + 0.22 * -(-len(lines) // ncol)
    panel_in = 0.6 + 0.4 * len(budgets) if budgets else 0.0
    height = bar_in + (legend_in + panel_in if budgets else 0.0)
    fig = Figure(figsize=(12, height), dpi=120)
    FigureCanvasAgg(fig)
    if budgets:
        ax = fig.add_axes((0.08, 1 - 1.4 / height, 0.9, 0.9 / height))
        _budget_bars(fig.add_axes((0.08, 0.6 / height, 0.9, (panel_in - 0.9) / height)), budgets)
    else:
        ax = fig.add_subplot()
    left = 0.0
    handles = []
    for line, colour in zip(lines, colours):
        share = 100.0 * line.bytes / total
        state = f", {line.state}" if line.state else ""
        handles.append(Patch(facecolor=colour, edgecolor="#444444",
                             label=f"{line.name}: {format_bytes(line.bytes)} ({share:.1f}%){state}"))
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
    fig.savefig(path, format="png", bbox_inches="tight", pad_inches=0.2)
    return path
