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
    assert out.value == 0, out.both()
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
    assert out.value == 0, out.both()
    assert "not enforced: torch's native allocator has no per-tag budgets" in out and "tag budgets:" not in out, out


def serve_quick_native_demo(out):
    from torch_budget import demo

    return demo.run(demo.make_settings(quick=True, out=Path(out), native=True, requests=4))


def test_profile_step_measures_the_managers_worst_step_and_hands_everything_back(fresh):
    out = fresh(profile_the_kv_and_workspace_step)
    peak, model_bytes, cache_bytes, floor, free_after, capacity = out.value
    assert peak >= model_bytes + cache_bytes + floor, out.value
    assert free_after == capacity, "the dummy request's blocks came back"


def profile_the_kv_and_workspace_step():
    import torch

    from torch_budget.demo.kv_resource import PagedKVResource
    from torch_budget.demo.model import DemoModel, PagedKVCache, prefill, prefill_workspace_bytes
    from torch_budget.eager_workspace import WorkspaceMetadata, workspace
    from torch_budget.planner import profile_step
    from torch_budget.planner.shape import ModelShape, weight_bytes
    from torch_budget.workspace_resource import WorkspaceResource

    cfg = ModelShape(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=1000, max_seq_len=512,
                     dtype="float16")
    model = DemoModel(cfg, device="cuda")
    cache = PagedKVCache(cfg, num_blocks=33, max_batch=1, block_size=16, device="cuda")
    kv = PagedKVResource(cache, longest_prompt=512)
    meta = WorkspaceMetadata("cuda", reclaimable=True)
    meta.warm_up(prefill_workspace_bytes(cfg, 1, 16))
    ws = WorkspaceResource(meta, prefill_workspace_bytes(cfg, 1, 1), 512)

    def forward(step):
        for req in step.context:
            ids = torch.randint(0, cfg.vocab, (1, req.prompt_len), device="cuda")
            with workspace(meta):
                out = prefill(model, ids, cache, [kv.row_of(req)], scratch=meta, last_only=True)
        return out

    prof = profile_step([kv, ws], forward, model_bytes=weight_bytes(cfg))
    return (prof.torch_peak, weight_bytes(cfg), cache.nbytes, prefill_workspace_bytes(cfg, 1, 512), kv.free_tokens(),
            kv.capacity_tokens())
