"""Allocator benchmark: torch's native allocator (plain, expandable segments, cudaMallocAsync)
and torch_budget's routes side by side, on what users run:

  - mixes (torch_budget.replay.mixes): serving-like churn of mixed sizes with 120-600 live
    tensors, small-only churn, a lognormal churn of large tensors;
  - recorded traces of real workloads (tools/traces/, made by tools/record_traces.sh with
    torch's own memory history): HF Llama generate, ResNet-50 AMP training, a
    reduce-overhead decode;
  - single-size torch.empty + del round trips (4 KiB, 1 MiB, 64 MiB).

Each configuration runs in its own processes, pinned to one core beside the GPU and unpinned
(native, expandable and torch_budget's default route). In each round the processes of a pinning
run at once and take turns, a slice of 2,048 operations each (replay.lockstep), so the machine's
slow spells fall on all of them alike (BENCH_ALLOC_SEQUENTIAL=1: one after the other instead, with
each process's speed calibrated). Time per operation is a paired median ratio against native over
every pass once the cache has grown (the passes after the first), and apart from it for the first
pass, which grows the cache from empty; memory is peak reserved over the trace's peak live bytes. The last line is `RESULT bench_alloc ...` for the GPU suite.

Environment: BENCH_ALLOC_ROUNDS (3), BENCH_ALLOC_PASSES (timed passes per child, 3: the first
and at least one more; a short trace runs more, until those after the first time 0.25 s, with Python's
garbage collector off while timing), BENCH_ALLOC_CONFIGS (comma-separated), BENCH_ALLOC_TRACES;
with OUT set (the GPU suite sets it), the rows and every round's results are also written to
$OUT/bench_alloc.json, so a console that keeps only its last lines loses nothing.
"""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench import cuda_torch  # noqa: E402  (tools/ is the script's own folder)

HERE = os.path.dirname(os.path.abspath(__file__))
MIXES = ["mix:serving", "mix:small", "mix:lognormal"]
SINGLE = ["mix:4KiB", "mix:1MiB", "mix:64MiB"]
CONFIGS = "native,expandable,cudaMallocAsync,tb-vmm,tb-vmm-noreuse,tb-vmm-pack10%,tb-pool,tb-sync"
DEFAULT = "tb-vmm"


def main():
    if cuda_torch("bench_alloc", "GPU allocation") is None:
        return 0
    from torch_budget.replay import compare

    rounds = int(os.environ.get("BENCH_ALLOC_ROUNDS", "3"))
    passes = int(os.environ.get("BENCH_ALLOC_PASSES", "3"))
    if rounds < 1 or passes < 2:
        raise SystemExit(f"bench_alloc: BENCH_ALLOC_ROUNDS ({rounds}) must be >= 1 and BENCH_ALLOC_PASSES ({passes}) "
                         ">= 2 (the first pass grows the cache; the others time it grown)")
    configs = os.environ.get("BENCH_ALLOC_CONFIGS", CONFIGS).split(",")
    recorded = sorted(glob.glob(os.path.join(HERE, "traces", "*.tbtrace.gz")))
    traces = os.environ.get("BENCH_ALLOC_TRACES", ",".join(MIXES + recorded + SINGLE)).split(",")
    runs = compare.compare(traces, configs, rounds, (True, False), passes=passes,
                           unpinned_configs={"native", "expandable", DEFAULT},
                           in_lockstep=os.environ.get("BENCH_ALLOC_SEQUENTIAL", "0") != "1",
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    rows = compare.summarise(runs)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_alloc.json"), "w") as f:
            json.dump({"rows": rows, "runs": [r.__dict__ for r in runs]}, f, indent=1)
    print(compare.table(rows))
    print(f"(medians over {rounds} rounds of {passes} or more passes; 'x native' is the median over rounds of each round's "
          "paired median ratio of the time per operation once the cache has grown (the passes after the first; in "
          "lockstep, pass by pass), '<=1 in' the rounds at or under native, 'x cal' (sequential rounds only) the same ratio with each process's time divided by its own speed first (a CPU "
          "allocation loop timed before each pass), '1st pass' the paired median ratio of the first pass, which "
          "grows the cache from empty; rsv/live is peak reserved over the trace's peak live bytes, over "
          "every pass (rsv 1st: the first pass's peak alone), floor the least any allocator reaches (peak live rounded up to 2 MiB granules); drv/kop is driver memory taken or "
          "given back per thousand operations in the last pass; map % the share of the grown passes' time "
          "torch_budget's allocation path spent backing allocations (driver calls, packing moves included))")
    mine = [r for r in rows if r["config"] == DEFAULT and "x_native" in r]
    single = [r for r in mine if r["trace"] in SINGLE]
    mixed = [r for r in mine if r["trace"] not in SINGLE]
    failed = [r for r in rows if r["errors"]]
    if not mine:
        print("RESULT bench_alloc failed=" + DEFAULT)
        return 1
    worst = max(mixed, key=lambda r: r["x_native"]) if mixed else None
    packing = max((r for r in mixed if r["pinned"]), key=lambda r: r["reserved_over_live"], default=None)
    parts = []
    if worst:
        parts.append(f"worst_mix_x_native={worst['x_native']:.2f}({os.path.basename(worst['trace'])},"
                     f"{'pinned' if worst['pinned'] else 'unpinned'})")
    cals = [r for r in mixed if "x_native_calibrated" in r]
    if cals:
        cal = max(cals, key=lambda r: r["x_native_calibrated"])
        parts.append(f"worst_mix_x_native_calibrated={cal['x_native_calibrated']:.2f}({os.path.basename(cal['trace'])},"
                     f"{'pinned' if cal['pinned'] else 'unpinned'})")
    firsts = [r for r in mixed if "x_native_first" in r]
    if firsts:
        first = max(firsts, key=lambda r: r["x_native_first"])
        parts.append(f"worst_mix_first_pass_x_native={first['x_native_first']:.2f}({os.path.basename(first['trace'])},"
                     f"{'pinned' if first['pinned'] else 'unpinned'})")
    if single:
        parts.append(f"worst_single_x_native={max(r['x_native'] for r in single):.2f}")
    if packing:
        parts.append(f"worst_rsv_over_live={packing['reserved_over_live']:.3f}({os.path.basename(packing['trace'])})")
    if failed:
        parts.append(f"failed={len(failed)}")
    print("RESULT bench_alloc " + " ".join(parts))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
