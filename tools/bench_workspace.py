"""Eager workspace benchmark: memory held over a trace of long and short forwards, memory
returned by a shrink, and the per-forward cost of `with workspace(meta):`.

Runs natively (torch's caching allocator) in this process and under torch_budget.install()
in a subprocess of itself (install() must be the first CUDA thing in a process). Each
forward is a few layers asking the shared workspace for their scratch: long forwards need
up to 512 MiB, short ones up to 16 MiB. Reports:
  - bytes held after every forward of the trace (workspace capacity, torch's allocated and
    reserved bytes, device memory used since the start);
  - bytes returned by the shrink after the third short forward that follows a long one, as
    a share of the excess over the new target: to the device (mem_get_info) at once (goal
    >= 95 % under install(); torch's allocator keeps it cached) and after empty_cache, and
    to torch's cache (memory_allocated);
  - the context manager's cost per forward, µs, median of many batches (goal <= 2 µs), at the
    floor and above it (where each forward also zeroes the logical size).
The last line is `RESULT bench_workspace key=value ...` for the GPU suite's table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench import cuda_torch  # noqa: E402  (tools/ is the script's own folder)

MiB = 1 << 20
FLOOR = 8 * MiB
LONG = [64 * MiB, 128 * MiB, 512 * MiB, 256 * MiB, 384 * MiB, 32 * MiB]  # per-layer needs
SHORT = [4 * MiB, 8 * MiB, 16 * MiB, 12 * MiB, 16 * MiB, 2 * MiB]
TRACE = "SSLSSSSLLSSSLSSSSS"
RETURN_GOAL_PCT = 95.0
OVERHEAD_GOAL_US = 2.0


def forward(meta, demands):
    from torch_budget.eager_workspace import workspace

    with workspace(meta):
        for nbytes in demands:
            meta.get(nbytes).zero_()  # touch the scratch, as a kernel would


def held_over_trace(torch, WorkspaceMetadata):
    """Bytes held after each forward of TRACE, in MiB."""
    meta = WorkspaceMetadata("cuda", reclaimable=True)
    meta.warm_up(FLOOR)
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    rows = {"workspace": [], "allocated": [], "reserved": [], "device": []}
    for kind in TRACE:
        forward(meta, LONG if kind == "L" else SHORT)
        torch.cuda.synchronize()
        rows["workspace"].append(meta.capacity / MiB)
        rows["allocated"].append(torch.cuda.memory_allocated() / MiB)
        rows["reserved"].append(torch.cuda.memory_reserved() / MiB)
        rows["device"].append((free0 - torch.cuda.mem_get_info()[0]) / MiB)
    return rows


def returned_by_shrink(torch, WorkspaceMetadata):
    """A long forward, then three short ones: what the shrink after the third gives back."""
    meta = WorkspaceMetadata("cuda", reclaimable=True)
    meta.warm_up(FLOOR)
    forward(meta, LONG)
    forward(meta, SHORT)
    forward(meta, SHORT)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    capacity = meta.capacity
    free0 = torch.cuda.mem_get_info()[0]
    allocated0 = torch.cuda.memory_allocated()
    forward(meta, SHORT)
    torch.cuda.synchronize()
    target = meta.capacity
    excess = capacity - target
    now = torch.cuda.mem_get_info()[0] - free0
    to_cache = allocated0 - torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    after_empty = torch.cuda.mem_get_info()[0] - free0

    def pct(n):
        return round(100.0 * n / excess, 1) if excess > 0 else 0.0

    return {
        "capacity_mib": capacity / MiB,
        "target_mib": target / MiB,
        "returned_pct": pct(after_empty),
        "returned_now_pct": pct(now),
        "to_cache_pct": pct(to_cache),
    }


def context_overhead_us(meta, iterations=2000, batches=301):
    """Median over batches of the mean cost of one empty `with workspace(meta):`."""
    from torch_budget.eager_workspace import workspace

    for _ in range(iterations):
        with workspace(meta):
            pass
    clock = time.perf_counter_ns
    samples = []
    for _ in range(batches):
        start = clock()
        for _ in range(iterations):
            with workspace(meta):
                pass
        samples.append((clock() - start) / iterations / 1000.0)
    return round(statistics.median(samples), 3)


def get_overhead_us(meta, iterations=2000, batches=101):
    """Median cost of one `meta.get(n)` that needs no growth (a layer asking for its scratch)."""
    n = SHORT[0]
    clock = time.perf_counter_ns
    samples = []
    for _ in range(batches):
        start = clock()
        for _ in range(iterations):
            meta.get(n)
        samples.append((clock() - start) / iterations / 1000.0)
    return round(statistics.median(samples), 3)


def measure(mode):
    import torch

    if mode == "install":
        import torch_budget

        torch_budget.install()  # before the first CUDA allocation of this process
    from torch_budget.eager_workspace import WorkspaceMetadata

    result = {"mode": mode, "held": held_over_trace(torch, WorkspaceMetadata)}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    result.update(returned_by_shrink(torch, WorkspaceMetadata))

    at_floor = WorkspaceMetadata("cuda", reclaimable=True)
    at_floor.warm_up(FLOOR)
    result["overhead_us"] = context_overhead_us(at_floor)
    above = WorkspaceMetadata("cuda", reclaimable=True)
    above.warm_up(FLOOR)
    forward(above, SHORT)  # 16 MiB > floor; empty forwards need nothing, so it stays there
    result["overhead_above_floor_us"] = context_overhead_us(above)
    if above.capacity <= above.floor:
        raise RuntimeError(f"the above-floor workspace shrank to its floor during timing: {above}")
    result["get_us"] = get_overhead_us(above)
    if mode == "install":
        by_tag = torch_budget.allocator.stats()["by_tag"]
        result["tag_matches"] = by_tag["workspace"]["allocated"] == at_floor.capacity + above.capacity
    return result


def run_installed_child():
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "install"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CHILD ")]
    if proc.returncode != 0 or not lines:
        print(f"under install(): FAILED (rc={proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return None
    return json.loads(lines[-1][len("CHILD "):])


def print_held(result):
    print(f"bytes held after each forward, MiB ({result['mode']}):")
    print(f"  {'forward':10} " + " ".join(f"{k:>5}" for k in TRACE))
    for name, values in result["held"].items():
        print(f"  {name:10} " + " ".join(f"{v:5.0f}" for v in values))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=["native", "install"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("CHILD " + json.dumps(measure(args.child)))
        return 0
    torch = cuda_torch("bench_workspace", "GPU memory")
    if torch is None:
        return 0

    installed = run_installed_child()  # first, while this process holds no device memory
    native = measure("native")
    for result in (native, installed):
        if result is not None:
            print_held(result)

    print(f"\nshrink after the third short forward: {native['capacity_mib']:.0f} -> {native['target_mib']:.0f} MiB; "
          f"goals: returned to the device at once >= {RETURN_GOAL_PCT:.0f} % of the excess, overhead <= "
          f"{OVERHEAD_GOAL_US} us")
    print(f"{'mode':8} {'device %':>9} {'dev now %':>10} {'to cache %':>11} {'cm us':>7} {'cm >floor us':>13} {'get us':>7}")
    for result in (native, installed):
        if result is None:
            print(f"{'install':8} {'failed':>9}")
            continue
        print(f"{result['mode']:8} {result['returned_pct']:9.1f} {result['returned_now_pct']:10.1f} "
              f"{result['to_cache_pct']:11.1f} {result['overhead_us']:7.2f} "
              f"{result['overhead_above_floor_us']:13.2f} {result['get_us']:7.2f}")

    pairs = {}
    if installed is not None:
        pairs.update({
            "returned_pct": installed["returned_pct"],
            "returned_now_pct": installed["returned_now_pct"],
            "overhead_us": installed["overhead_us"],
            "overhead_above_floor_us": installed["overhead_above_floor_us"],
            "tag_ok": int(installed["tag_matches"]),
        })
    else:
        pairs["install"] = "failed"
    pairs.update({
        "native_to_cache_pct": native["to_cache_pct"],
        "native_returned_pct": native["returned_pct"],
        "native_overhead_us": native["overhead_us"],
        "native_overhead_above_floor_us": native["overhead_above_floor_us"],
    })
    main_result = installed or native
    met = (main_result["returned_now_pct"] >= RETURN_GOAL_PCT and main_result["returned_pct"] >= RETURN_GOAL_PCT
           and main_result["overhead_us"] <= OVERHEAD_GOAL_US)
    pairs["goals"] = "met" if met and installed is not None else "missed"
    print("RESULT bench_workspace " + " ".join(f"{k}={v}" for k, v in pairs.items()))
    return 1 if installed is None else 0


if __name__ == "__main__":
    sys.exit(main())
