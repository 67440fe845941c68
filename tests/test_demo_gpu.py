"""The demo on a CUDA device, in a fresh process: it enforces its own plan (Plan.apply) and the
ledger after serving shows each tag's budget, use and headroom."""
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.exclusive]

TAGS = {"weights", "kv", "activations", "workspace", "graphs"}


def budget_rows(out: str) -> dict:
    """The demo's budget table, by tag: the cells of each row."""
    lines = out.split("tag budgets:", 1)[1].splitlines()[3:]
    rows = {}
    for line in lines:
        cells = line.split()
        if not cells or cells[0] not in TAGS:
            break
        rows[cells[0]] = cells
    return rows


def test_the_demo_applies_its_plan_and_the_ledger_shows_every_tag_holding(fresh, tmp_path):
    out = fresh(serve_quick_demo, str(tmp_path / "ledger.png"), timeout=600)
    assert out.value == 0, out
    assert "enforced (Plan.apply): weights" in out, out
    rows = budget_rows(out)
    assert set(rows) == TAGS, out
    for tag, cells in rows.items():
        # budget, in use, headroom, peak: value and unit each; the core refuses past the budget
        headroom_unit = cells[6]
        assert headroom_unit in ("MiB", "GiB") and not cells[5].startswith("-"), (tag, cells)
    assert "the plan held:" in out, out
    assert (tmp_path / "ledger.png").stat().st_size > 0


def serve_quick_demo(out):
    from torch_budget import demo

    return demo.run(demo.make_settings(quick=True, out=Path(out)))


def test_the_demo_on_the_native_allocator_says_the_plan_is_not_enforced(fresh, tmp_path):
    out = fresh(serve_quick_native_demo, str(tmp_path / "ledger.png"), timeout=600)
    assert out.value == 0, out
    assert "not enforced: torch's native allocator has no per-tag budgets" in out and "tag budgets:" not in out, out


def serve_quick_native_demo(out):
    from torch_budget import demo

    return demo.run(demo.make_settings(quick=True, out=Path(out), native=True, requests=4))
