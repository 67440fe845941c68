"""The demo's measured ledger: what each line held while serving, and its picture."""

from __future__ import annotations

from pathlib import Path

from torch_budget.demo.settings import TAG_ACTIVATIONS, TAG_GRAPHS, TAG_KV, TAG_WEIGHTS, DemoError


def measured_lines(torch, device, mode, *, total, weights, kv, graph_static, pools, ws_peak, peak_allocated, watch):
    """The ledger of the serving run.

    Resident lines (weights, KV, graph buffers and pools) are what they hold now; eager workspace
    and activations are their peaks during serving; non-torch is device-wide used minus torch's
    reserved bytes at the device-wide peak; what torch reserved beyond all torch lines then is the
    allocator's cache. With torch_budget installed every torch line but the pools' comes from its
    per-tag ledger; on the native allocator they come from allocation deltas and the activations
    are derived. The pools' line (`pools`, measure.graph_pool_bytes) is what graph pools hold
    beyond their live blocks, which are allocated memory and counted on the lines above.
    A released tag's line holds its resident bytes and says what is released.
    """
    import dataclasses

    import torch_budget
    from torch_budget import report

    states = {}
    if mode == "torch_budget":
        s = torch_budget.stats(device)
        tags = s["by_tag"]

        def tag(name, key="allocated"):
            return report.tag_bytes(tags.get(name, {}), key)

        # A released tag (torch_budget.sleep) shows what is released; its line holds what is resident.
        states = {category: report.tag_state(tags.get(name, {})) for category, name in
                  (("weights", TAG_WEIGHTS), ("kv_pool", TAG_KV), ("graph_workspace", TAG_GRAPHS))}

        # A pool's live blocks are the graphs tag's (the pool's tag): `pools` is what the pools
        # hold beyond them (measure.graph_pool_bytes), so no byte is on both lines.
        weights, kv, graph_static = tag(TAG_WEIGHTS), tag(TAG_KV), tag(TAG_GRAPHS)
        from torch_budget.eager_workspace import WORKSPACE_TAG

        ws_peak = tag(WORKSPACE_TAG, "peak_allocated")
        activations = tag(TAG_ACTIVATIONS, "peak_allocated") + tag("untagged", "peak_allocated")
        why = {
            "weights": "torch_budget ledger, tag 'weights'",
            "kv_pool": "torch_budget ledger, tag 'kv'",
            "graph_workspace": "torch_budget ledger, tag 'graphs': static buffers, capture-stream state",
            "graph_pools": "torch_budget segments: graph pool bytes beyond their live blocks",
            "eager_workspace": f"torch_budget ledger, tag '{WORKSPACE_TAG}': peak during serving",
            "activations": "torch_budget ledger, tags 'activations' + 'untagged': peak during serving",
        }
    else:
        activations = max(peak_allocated - weights - kv - graph_static - ws_peak, 0)
        why = {
            "weights": "allocation delta while loading",
            "kv_pool": "allocation delta of the KV pool",
            "graph_workspace": "allocation deltas of both captures: static buffers, capture-stream state",
            "graph_pools": "private-pool segments in torch.cuda.memory_snapshot(), beyond their live blocks",
            "eager_workspace": "largest workspace capacity seen while serving",
            "activations": "derived: max_memory_allocated minus the other torch lines",
        }
    non_torch = max(watch.peak_used - watch.reserved_at_peak, 0)
    torch_lines = weights + kv + graph_static + pools + ws_peak + activations
    cache = max(watch.reserved_at_peak - torch_lines, 0)
    why["non_torch"] = "device-wide used minus torch reserved, at the device-wide peak"
    why["allocator_cache"] = "torch reserved at the device-wide peak beyond every torch line above"
    lines = report.measured_ledger(total, weights=weights, kv_pool=kv, activations=activations,
                                   eager_workspace=ws_peak, graph_workspace=graph_static, graph_pools=pools,
                                   non_torch=non_torch, allocator_cache=cache, source="measured", states=states)
    return [dataclasses.replace(line, reason=why.get(line.category, line.reason)) for line in lines]


def write_picture(report, lines, total, out: Path, title: str, budgets=()) -> None:
    """Draw the ledger (with the tags' budgets, use and headroom); without matplotlib, keep it as
    JSON that `torch-budget report` renders."""
    try:
        path = report.write_png(lines, total, out, title, budgets)
    except OSError as e:
        raise DemoError(f"cannot write the ledger picture to {out}: {e}") from None
    except ImportError as e:
        saved = out.with_suffix(".json")
        try:
            saved.write_text(report.ledger_json(title, total, lines, budgets))
        except OSError as err:
            raise DemoError(f"cannot write the ledger to {saved}: {err}") from None
        print(f"\npicture not drawn ({e}); the ledger is saved as {saved}: render it where matplotlib is "
              f"installed with `torch-budget report {saved}`")
        return
    print(f"\nledger picture written to {path}")
