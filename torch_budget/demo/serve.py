"""The nine steps of the demo's serving run: weights, workspace, profile, graph probe, plan,
KV pool, capture, serve, and the plan held against the measurement; with --sleep a tenth, one
sleep/wake cycle of the served model (sleep_wake.py)."""

from __future__ import annotations

import gc
import time

from torch_budget.demo.settings import (BLOCK_SIZE, FRACTION, MODEL, TAG_ACTIVATIONS, TAG_GRAPHS, TAG_KV, TAG_WEIGHTS,
                                        DemoError, Settings)
from torch_budget.demo.ledger import measured_lines, write_picture
from torch_budget.demo.requests import make_requests, run_requests
from torch_budget.demo.sleep_wake import sleep_wake
from torch_budget.units import format_bytes as _fmt


def decode_runner(manager, name, model, cache, buckets):
    """A graph runner whose one captured piece is a greedy decode step over cache rows 0..bucket-1.

    Token ids and positions are host inputs: their copy to the device is captured in the graph,
    so a step is one memcpy into pinned shadows plus one replay. Padded rows feed token 0 at
    position 0 into rows whose block table points at the null block.
    """
    import torch

    from torch_budget.graphs import StaticInput
    from torch_budget.demo.model import decode

    def decode_step(buffers):
        return {"next": decode(model, buffers["ids"], buffers["pos"], cache).argmax(dim=-1)}

    return manager.runner(name, decode_step, buckets=list(buckets),
                          inputs=[StaticInput("ids", torch.int64), StaticInput("pos", torch.int64)])



def enforce(plan, device, installed: bool):
    """Plan.apply() on the device (its AppliedBudgets), or None on torch's native allocator,
    which has no tag budgets; a plan that does not fit is a DemoError."""
    from torch_budget.errors import PlanDoesNotFitError

    if not installed:
        print("  not enforced: torch's native allocator has no per-tag budgets (run without --native)")
        return None
    try:
        applied = plan.apply(device)
    except PlanDoesNotFitError as e:
        raise DemoError(str(e)) from None
    print("  enforced (Plan.apply): " + ", ".join(f"{tag} {_fmt(n)}" for tag, n in applied.budgets.items())
          + "; an allocation past its line is an out-of-memory error naming its tag")
    return applied


def held(budgets) -> str:
    """One line: whether every budgeted tag's peak stayed within its budget (the core refuses an
    allocation past it, so a tag at its budget is one that was refused or filled it exactly)."""
    tight = min(budgets, key=lambda b: b.budget - (b.peak if b.peak is not None else b.used))
    worst = tight.peak if tight.peak is not None else tight.used
    return (f"the plan held: {len(budgets)} tags served inside their budgets; the tightest, {tight.tag!r}, peaked at "
            f"{_fmt(worst)} of {_fmt(tight.budget)}")


def _print_step(i: int, total: int, text: str) -> None:
    print(f"\n[{i}/{total}] {text}")


def serve(torch, settings: Settings, mode: str) -> None:
    import torch_budget
    from torch_budget import planner, report
    from torch_budget.eager_workspace import WORKSPACE_TAG, WorkspaceMetadata, workspace as workspace_scope
    from torch_budget.graphs import GraphPoolManager, GraphResource
    from torch_budget.demo.kv_resource import PagedKVResource
    from torch_budget.demo.model import DemoModel, PagedKVCache, prefill, prefill_workspace_bytes
    from torch_budget.resources import dummy_step
    from torch_budget.workspace_resource import WorkspaceResource
    from torch_budget.planner.shape import kv_cache_cost, parameter_count
    from torch_budget.report import measure

    region = torch_budget.region
    installed = mode == "torch_budget"
    steps = 10 if settings.sleep else 9

    def _step(i: int, text: str) -> None:
        _print_step(i, steps, text)

    device = torch.device("cuda", torch.cuda.current_device())
    cfg = MODEL
    if settings.max_prompt + settings.max_new > cfg.max_seq_len:
        raise DemoError(f"prompts of up to {settings.max_prompt} tokens plus {settings.max_new} new tokens exceed "
                         f"the model's max_seq_len={cfg.max_seq_len}")
    total = int(torch.cuda.mem_get_info(device)[1])
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}, {_fmt(total)} (measured); model: built-in, {parameter_count(cfg) / 1e6:.1f} M parameters, "
          f"{cfg.layers} layers, {cfg.dtype}, random weights")

    # 1. Weights, charged to their own tag.
    _step(1, "weights")
    before = measure.read(device, installed)
    with region(TAG_WEIGHTS):
        model = DemoModel(cfg, device=device, seed=settings.seed)
    weights = measure.read(device, installed).allocated - before.allocated
    print(f"  {_fmt(weights)} allocated for parameters and buffers")

    # 2. The eager workspace: its warm-up size is the floor it never shrinks below.
    _step(2, "eager workspace")
    meta = WorkspaceMetadata(device, reclaimable=True)  # pure attention scratch: safe to reallocate
    meta.warm_up(prefill_workspace_bytes(cfg, 1, settings.min_prompt))
    print(f"  floor {_fmt(meta.floor)} (one {settings.min_prompt}-token prompt); grows to the largest layer's need")

    # 3. Profile one worst-case prefill. The KV it writes exists only for the estimate and is
    # handed back to the KV budget by the planner (estimation_kv_bytes).
    _step(3, f"profiling a dummy prefill of {settings.max_prompt} tokens")
    # The step is the one the KV cache and the workspace name as their worst case (their dummy
    # requests: one prompt of max_prompt tokens); they prepare it, the forward prefills it.
    # Bytes are allocation deltas: the blocks the budget layer charges, not the tensors' sizes.
    gen = torch.Generator().manual_seed(settings.seed + 1)
    before = measure.read(device, installed)
    with region(TAG_KV):
        est_cache = PagedKVCache(cfg, num_blocks=-(-settings.max_prompt // BLOCK_SIZE) + 1, max_batch=1,
                                 block_size=BLOCK_SIZE, device=device)
    estimation = {"kv": measure.read(device, installed).allocated - before.allocated}
    est_kv = PagedKVResource(est_cache, longest_prompt=settings.max_prompt)
    ws_tokens = WorkspaceResource(meta, prefill_workspace_bytes(cfg, 1, 1), settings.max_prompt)

    def dummy_prefill(step):
        with region(TAG_ACTIVATIONS):
            for req in step.context:
                ids = torch.randint(0, cfg.vocab, (1, req.prompt_len), generator=gen).to(device)
                with workspace_scope(meta):
                    logits = prefill(model, ids, est_cache, [est_kv.row_of(req)], scratch=meta, last_only=True)
            return logits

    prof = planner.profile_step([est_kv, ws_tokens], dummy_prefill, model_bytes=weights, device=device)
    del est_kv, est_cache
    # What the workspace tag is charged (whole blocks) is what its budget must hold.
    ws_in_peak = measure.tag_bytes(torch_budget.stats(device)["by_tag"][WORKSPACE_TAG]) if installed else meta.capacity
    print(f"  torch peak {_fmt(prof.torch_peak)}, activations {_fmt(prof.activation_bytes)} (incl. estimation KV "
          f"{_fmt(estimation['kv'])} and workspace {_fmt(ws_in_peak)}), allocator cache {_fmt(prof.allocator_cache)}, "
          f"outside torch {_fmt(prof.extra_cost)}")

    # 4. What the decode graphs will hold, measured by capturing them once against a 2-block cache:
    # a decode step's shapes depend on the batch and max_seq_len, not on how many blocks the cache has.
    _step(4, f"measuring the decode graphs (buckets {settings.buckets}) with a throw-away cache")
    manager = GraphPoolManager(device)  # one manager, so the real capture reuses the probe's capture stream
    start = measure.read(device, installed)
    with region(TAG_KV):
        probe_cache = PagedKVCache(cfg, num_blocks=2, max_batch=settings.max_batch, block_size=BLOCK_SIZE,
                                   device=device)
    before = measure.read(device, installed)
    torch.cuda.reset_peak_memory_stats(device)
    with region(TAG_GRAPHS):
        probe = decode_runner(manager, "decode-probe", model, probe_cache, settings.buckets)
        t0 = time.perf_counter()
        probe.capture()
        probe_seconds = time.perf_counter() - t0
        # The graph rows' dummy requests fill the largest bucket: one replay of it, which must
        # allocate nothing (a replay reuses the captured addresses).
        with dummy_step([GraphResource(probe)]) as rows:
            zeros = torch.zeros(len(rows.generation), dtype=torch.int64)
            probe.step(len(rows.generation), ids=zeros, pos=zeros)
    after = measure.read(device, installed)
    graph_pools = after.pools - before.pools
    # Static buffers, plus what capture creates once per stream (e.g. cuBLAS's workspace for the
    # capture stream): allocated outside the pool and kept; and any block a graph keeps in its
    # pool, which graph_pools (what the pools hold beyond their live blocks) leaves out.
    graph_static = after.allocated - before.allocated
    # Warm-up runs eagerly before capture: its transient peak may pass what stays (pools and
    # static buffers), and under Plan.apply() the graphs tag must hold that peak too.
    capture_transient = max(int(torch.cuda.max_memory_allocated(device)) - before.allocated - graph_static
                            - graph_pools, 0)
    # Executable graphs live outside torch: device-wide growth that torch did not reserve.
    graph_exec = max((after.used - before.used) - (after.reserved - before.reserved), 0)
    probe.close()
    del probe, probe_cache
    gc.collect()
    torch.cuda.empty_cache()
    # What outlives the probe (per-stream state such as cuBLAS's workspace for the capture stream)
    # is also what the real capture will not allocate again.
    probe_left = max(measure.read(device, installed).allocated - start.allocated, 0)
    print(f"  captured {len(settings.buckets)} graphs in {probe_seconds:.2f} s: pool {_fmt(graph_pools)}, static "
          f"buffers {_fmt(graph_static)}, outside torch {_fmt(graph_exec)}; released again, "
          f"{_fmt(probe_left)} of capture-stream state stays")

    # 5. Plan.
    _step(5, "planning the KV budget")
    from_kv = [r for r in (
        planner.Reserve("decode graph pools", graph_pools,
                       f"measured: capture of {len(settings.buckets)} decode buckets", category="graph_pools"),
        planner.Reserve("decode static buffers", graph_static,
                       "measured: graph inputs/outputs and capture-stream state", category="graph_workspace"),
        planner.Reserve("decode capture warm-up", capture_transient,
                       "measured: transient peak of warm-up and capture beyond pools and static buffers",
                       category="graph_workspace"),
        planner.Reserve("decode graph execs", graph_exec,
                       "measured: device memory the captured graphs hold outside torch", category="non_torch"),
    ) if r.bytes > 0]
    plan = planner.plan(prof, kv_cache_cost(cfg), fraction=FRACTION, estimation_kv_bytes=estimation["kv"],
                       from_kv=from_kv, max_kv_bytes=settings.kv_cap_bytes, eager_workspace_in_peak=ws_in_peak,
                       title=f"plan: built-in model on {name} ({_fmt(total)})")
    print(plan.to_text())
    predicted = sum(line.bytes for line in plan.lines if line.category != "headroom")
    uncapped = next(s.kv_bytes for s in plan.steps if s.step == 5)
    print(f"\nKV pool capped at {_fmt(settings.kv_cap_bytes)} so the demo stays quick; uncapped, the plan would give "
          f"it {_fmt(uncapped)}")
    applied = enforce(plan, device, installed)

    # 6. The KV pool, sized by the plan.
    _step(6, "allocating the KV pool from the plan")
    before = measure.read(device, installed)
    try:
        with region(TAG_KV):
            cache = PagedKVCache.from_budget(cfg, plan.kv_bytes, max_batch=settings.max_batch,
                                             block_size=BLOCK_SIZE, device=device)
    except ValueError as e:
        raise DemoError(f"the plan leaves too little for a KV pool: {e}") from None
    kv_bytes = measure.read(device, installed).allocated - before.allocated
    print(f"  {cache.num_blocks} blocks of {BLOCK_SIZE} tokens ({cache.num_blocks * BLOCK_SIZE} tokens): "
          f"{_fmt(kv_bytes)} allocated, plan {_fmt(plan.kv_bytes)}")

    # 7. The decode graphs, captured for real against the KV pool (under install(), the shim
    # serves capture from its private pools).
    _step(7, "capturing the decode graphs")
    before = measure.read(device, installed)
    with region(TAG_GRAPHS):
        runner = decode_runner(manager, "decode", model, cache, settings.buckets)
        runner.capture()
    after = measure.read(device, installed)
    real_static = after.allocated - before.allocated
    print(f"  pool {_fmt(after.pools - before.pools)} (step 4 measured {_fmt(graph_pools)}), static buffers "
          f"{_fmt(real_static)} (+ {_fmt(probe_left)} capture-stream state kept from step 4)")

    # 8. Serve.
    requests = make_requests(settings, cfg.vocab)
    _step(8, f"serving {len(requests)} requests: prompts {min(r.prompt_len for r in requests)}-"
             f"{max(r.prompt_len for r in requests)} tokens, {settings.min_new}-{settings.max_new} new tokens, "
             f"at most {settings.max_batch} at once")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    watch = measure.DeviceWatch(device)
    watch.sample()
    ws_budget = plan.tag_budgets().get(WORKSPACE_TAG)
    stats = run_requests(torch, settings, model, cache, runner, meta, requests, watch, device, region,
                         workspace_tokens=None if ws_budget is None else ws_budget // prefill_workspace_bytes(cfg, 1, 1))
    torch.cuda.synchronize(device)
    watch.sample()
    peak_allocated = int(torch.cuda.max_memory_allocated(device))
    peak_reserved = int(torch.cuda.max_memory_reserved(device))
    rate = stats["generated"] / stats["seconds"]
    step_ms = 1e3 * stats["step_seconds"] / max(stats["steps"], 1)
    print(f"  {stats['generated']} tokens generated in {stats['seconds']:.2f} s ({rate:.0f} tokens/s); "
          f"{stats['steps']} decode steps, mean {step_ms:.2f} ms, by bucket {dict(sorted(stats['buckets'].items()))}")
    waits = ", ".join(f"{tag} {n}" for tag, n in sorted(stats["waits"].items())) or "none"
    print(f"  {stats['prefill_tokens']} prompt tokens prefilled; {len(stats['deferred'])} request(s) deferred, never "
          f"failed (steps a resource held the queue back: {waits}); workspace {_fmt(meta.floor)}-"
          f"{_fmt(stats['ws_peak'])}, shrank {stats['ws_shrinks']} time(s)")

    # 9. Plan against measurement, then the ledger.
    _step(9, "predicted against measured peak")
    predicted_torch = predicted - plan.bytes_in("non_torch")
    # The graph pools' line is what they hold beyond their live blocks: reserved, not allocated;
    # so is the allocator's cache.
    predicted_allocated = predicted_torch - plan.bytes_in("graph_pools") - plan.bytes_in("allocator_cache")
    rows = [
        ("predicted peak: every plan line but headroom", predicted, None),
        (f"measured device-wide peak used (mem_get_info, {watch.samples} samples)", watch.peak_used, predicted),
        ("predicted torch share (reserved): plan minus non-torch lines", predicted_torch, None),
        ("measured torch peak reserved (max_memory_reserved)", peak_reserved, predicted_torch),
        ("predicted torch allocated: torch share minus graph pools and allocator cache", predicted_allocated, None),
        ("measured torch peak allocated (max_memory_allocated)", peak_allocated, predicted_allocated),
    ]
    width = max(len(r[0]) for r in rows)
    for label, value, against in rows:
        tail = f"  ratio {value / against:.3f}" if against else ""
        print(f"  {label:<{width}}  {_fmt(value):>11}{tail}")
    margin = plan.line("headroom").bytes
    over = watch.peak_used - predicted
    if over > 0:
        print(f"  the measured peak exceeds the prediction by {_fmt(over)}; the plan left {_fmt(margin)} unplanned, "
              f"{'which absorbs it' if over <= margin else 'which does NOT cover it'}")
    else:
        print(f"  the measured peak stayed {_fmt(-over)} below the prediction: no OOM with the KV pool the plan sized")

    lines = measured_lines(torch, device, mode, total=total, weights=weights, kv=kv_bytes,
                            graph_static=probe_left + real_static, pools=measure.graph_pool_bytes(device, installed),
                            ws_peak=stats["ws_peak"], peak_allocated=peak_allocated, watch=watch)
    budgets = [] if applied is None else report.tag_budgets(torch_budget.stats(device)["by_tag"],
                                                             planner.apply.bounds(plan.lines))
    title = f"measured during serving: built-in model on {name}" + (" (native allocator)" if mode == "native" else "")
    print()
    print(report.format_table(lines, total, title, budgets))
    if budgets:
        print(held(budgets))
    write_picture(report, lines, total, settings.out, title, budgets)

    if settings.sleep:
        _step(10, "sleep and wake: release the weights, KV pool and decode graphs, restore them, serve again")
        sleep_wake(torch, settings, mode, model=model, cache=cache, runner=runner, meta=meta, device=device,
                   region=region)
    manager.close()
