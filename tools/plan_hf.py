"""The planner on Hugging Face transformers models, held against the device (needs a CUDA GPU and
transformers; the weights are random, built from each model's config: nothing is downloaded).

For each model shape (default: three of torch_budget.planner.hf.MODELS, Llama and Qwen, GQA,
contexts of 8 to 32 K tokens):

  1. a fresh process installs torch_budget, loads the model, profiles its worst step (a prefill
     of `batch` prompts and one decode step on a StaticCache of `batch` x `max_len`) and plans;
  2. another fresh process loads the model again, enforces the plan (Plan.apply: one budget per
     tag, inside the device budget), allocates the StaticCache the plan holds and serves the worst
     case through the scheduler, sampling the device; then asks for one sequence more of KV than
     the plan holds, which must be an out-of-memory error naming tag 'kv', and serves the worst
     case again on the planned cache: the other tags keep serving.

The last lines are a table: per model, the predicted peak against the peak measured in the
serving process, and what the push past the KV line gave. The prediction is the plan's: torch's
allocated bytes are its weights and activations lines and the cache allocated from its KV line;
the device-wide used bytes add its allocator cache (torch reserved minus torch peak when
profiled) and non-torch lines.

    python tools/plan_hf.py [--models llama-3.2-1b,qwen3-4b,llama-3.1-8b] [--out DIR] [--fraction 0.9]

Each process prints its plan or its measured ledger (with each tag's budget, use and headroom);
DIR (default: a fresh temporary folder) keeps the plans and results as JSON.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_MODELS = "llama-3.2-1b,qwen3-4b,llama-3.1-8b"
CHILD_TIMEOUT_S = 900


def _device():
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("tools/plan_hf.py needs a CUDA device: torch.cuda.is_available() is False")
    return torch.device("cuda", 0)


def plan_child(name: str, out: str, fraction: float) -> None:
    import torch_budget
    from torch_budget.planner import hf_plan

    torch_budget.install()  # before anything touches CUDA
    device = _device()
    loaded = hf_plan.load(name, device=device)
    plan, cache_bytes = hf_plan.plan_loaded(loaded, device=device, fraction=fraction)
    print(plan.to_text())
    with open(os.path.join(out, f"{name}.plan.json"), "w") as f:
        f.write(plan.to_json())
    with open(os.path.join(out, f"{name}.facts.json"), "w") as f:
        json.dump({"weights": loaded.weights, "cache_bytes": cache_bytes}, f)


def serve_child(name: str, out: str) -> None:
    import torch

    import torch_budget
    from torch_budget import planner, report
    from torch_budget.planner import Plan, hf_plan
    from torch_budget.units import format_bytes

    torch_budget.install()
    device = _device()
    with open(os.path.join(out, f"{name}.plan.json")) as f:
        plan = Plan.from_json(f.read())
    with open(os.path.join(out, f"{name}.facts.json")) as f:
        facts = json.load(f)
    loaded = hf_plan.load(name, device=device)
    if loaded.weights != facts["weights"]:
        raise SystemExit(f"{name}: the weights took {loaded.weights} bytes here and {facts['weights']} when planned")
    applied = plan.apply(device)
    print("enforced: " + ", ".join(f"{tag} {format_bytes(n)}" for tag, n in applied.budgets.items()))
    rows = hf_plan.rows_within(plan, loaded, facts["cache_bytes"])
    if rows < 1:
        raise SystemExit(f"{name}: the plan's KV line ({format_bytes(plan.kv_bytes)}) holds no sequence of "
                         f"{loaded.spec.max_len} tokens on this card")

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    watch = report.DeviceWatch(device)
    watch.sample()
    cache, kv_bytes = hf_plan.cache_for(loaded, rows, device=device)
    t0 = time.perf_counter()
    served = hf_plan.serve(loaded, cache, rows, device=device, watch=watch)
    seconds = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    watch.sample()
    measured_allocated = int(torch.cuda.max_memory_allocated(device))
    predicted_allocated, predicted_device = hf_plan.predicted_peaks(plan, kv_bytes)
    print(f"served {rows} x {loaded.spec.max_len} tokens ({served['generated']} generated, {served['decode_steps']} "
          f"decode steps) in {seconds:.1f} s")

    stats = torch_budget.stats(device)
    tags = stats["by_tag"]
    held = {"weights": tags["weights"]["allocated"], "kv_pool": tags["kv"]["allocated"],
            "activations": tags["activations"]["peak_allocated"]}
    # At the device-wide peak: what lives outside torch, and what torch reserved beyond its lines.
    lines = report.measured_ledger(stats["total"], **held,
                                   non_torch=max(watch.peak_used - watch.reserved_at_peak, 0),
                                   allocator_cache=max(watch.reserved_at_peak - sum(held.values()), 0),
                                   source="measured: torch_budget ledger (activations: peak)")
    budgets = report.tag_budgets(tags, planner.apply.bounds(plan.lines))
    print(report.format_table(lines, stats["total"], f"measured while serving {name} at its planned worst case",
                              budgets))

    # One sequence more than the plan holds: the KV tag must refuse it, naming itself.
    refused = ""
    try:
        hf_plan.cache_for(loaded, 1, device=device)
    except torch.cuda.OutOfMemoryError as e:
        refused = str(e)
    gc.collect()  # what the refused cache took before the refusal goes back with it
    if not refused:
        raise SystemExit(f"{name}: a sequence past the KV line was not refused")
    print(f"one sequence past the KV line: {refused.splitlines()[0][:300]}")
    kv_after = torch_budget.stats(device)["by_tag"]["kv"]["allocated"]
    again = hf_plan.serve(loaded, cache, rows, device=device)
    print(f"then served the worst case again on the planned cache: {again['generated']} tokens")
    with open(os.path.join(out, f"{name}.serve.json"), "w") as f:
        json.dump({"rows": rows, "max_len": loaded.spec.max_len, "predicted_allocated": predicted_allocated,
                   "measured_allocated": measured_allocated, "predicted_device": predicted_device,
                   "measured_device": watch.peak_used, "samples": watch.samples,
                   "refused_names_kv": "tag 'kv'" in refused, "kv_back_to_planned": kv_after == kv_bytes,
                   "served_again": again["generated"]}, f)


def run_child(args: list, what: str) -> bool:
    print(f"\n===== {what}", flush=True)
    try:
        proc = subprocess.run([sys.executable, "-X", "faulthandler", os.path.abspath(__file__), *args],
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"{what}: timed out after {CHILD_TIMEOUT_S} s")
        return False
    if proc.returncode != 0:
        print(f"{what}: failed (rc={proc.returncode})")
    return proc.returncode == 0


def table(names: list, out: str) -> list:
    """Prints the table; returns each model's serve result (None where there is none)."""
    from torch_budget.units import format_bytes

    results = []

    print("\n" + "=" * 20 + " predicted peak against the peak measured in a fresh serving process")
    header = (f"{'model':<14} {'rows x max_len':>15} {'torch: predicted':>17} {'measured':>10} {'ratio':>6} "
              f"{'device: predicted':>18} {'measured':>10} {'ratio':>6}  past the KV line")
    print(header)
    print("-" * len(header))
    for name in names:
        path = os.path.join(out, f"{name}.serve.json")
        if not os.path.exists(path):
            print(f"{name:<14} (no result: see the process's output above)")
            results.append(None)
            continue
        with open(path) as f:
            r = json.load(f)
        results.append(r)
        push = ("OOM naming tag 'kv'" if r["refused_names_kv"] else "OOM NOT naming 'kv'") + (
            ", others kept serving" if r["served_again"] and r["kv_back_to_planned"] else ", serving did NOT go on")
        print(f"{name:<14} {str(r['rows']) + ' x ' + str(r['max_len']):>15} "
              f"{format_bytes(r['predicted_allocated']):>17} {format_bytes(r['measured_allocated']):>10} "
              f"{r['measured_allocated'] / r['predicted_allocated']:>6.3f} "
              f"{format_bytes(r['predicted_device']):>18} {format_bytes(r['measured_device']):>10} "
              f"{r['measured_device'] / r['predicted_device']:>6.3f}  {push}")
    return results


def result_line(results: list) -> str:
    """`RESULT plan_hf ...` for the GPU suite: the worst predicted-to-measured miss and how many
    models held their plan (an OOM naming 'kv' past its line, the others serving on)."""
    done = [r for r in results if r is not None]
    if not done:
        return f"RESULT plan_hf failed={len(results)}"
    miss = max(abs(r["measured_device"] / r["predicted_device"] - 1) for r in done)
    miss_torch = max(abs(r["measured_allocated"] / r["predicted_allocated"] - 1) for r in done)
    held = sum(1 for r in done if r["refused_names_kv"] and r["served_again"] and r["kv_back_to_planned"])
    return (f"RESULT plan_hf models={len(done)}/{len(results)} worst_miss_device={miss:.3%} "
            f"worst_miss_torch={miss_torch:.3%} plan_held={held}/{len(results)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated MODELS names (default {DEFAULT_MODELS})")
    p.add_argument("--out", help="folder for the plans and results (default: a fresh temporary folder)")
    p.add_argument("--fraction", type=float, default=0.9, help="the planner's fraction (default 0.9)")
    p.add_argument("--child", nargs=2, metavar=("PART", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        part, name = args.child
        if part == "plan":
            plan_child(name, args.out, args.fraction)
        else:
            serve_child(name, args.out)
        return 0
    from torch_budget.planner.hf import MODELS, require_transformers

    try:
        require_transformers()
    except ImportError as e:
        print(f"tools/plan_hf.py: {e}", file=sys.stderr)
        return 2
    _device()  # a driver query: CUDA is not initialised here, each child installs torch_budget first
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    out = args.out or tempfile.mkdtemp(prefix="plan_hf.")
    os.makedirs(out, exist_ok=True)
    print(f"results in {out}")
    for name in names:
        common = ["--out", out, "--fraction", str(args.fraction)]
        if run_child(["--child", "plan", name, *common], f"{name}: profile and plan (fresh process)"):
            run_child(["--child", "serve", name, *common], f"{name}: serve the planned worst case under Plan.apply() "
                                                            "(fresh process)")
    results = table(names, out)
    print(result_line(results))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
