"""Allocator benchmark: torch's native allocator and torch_budget side by side.

Each configuration runs in its own process (install() must be the first CUDA thing)
and reports:
  - torch.empty + del round trip, µs (median of 5 batches of 20000), at 4 KiB, 1 MiB, 64 MiB,
    with the process pinned to one CPU core (every configuration on the same core) and,
    for native and the default route, also unpinned;
  - a random-size churn trace (live set up to 48 tensors, lognormal sizes up to
    512 MiB): peak reserved bytes over peak live bytes, and the same from the
    device's own used memory (mem_get_info) over peak live bytes.
The last line is `RESULT bench_alloc ...` for the GPU suite's table.
"""
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench import cuda_torch, pin_to_one_core  # noqa: E402  (tools/ is the script's own folder)

ROUNDS = int(os.environ.get("BENCH_ALLOC_ROUNDS", "3"))
SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20}
CONFIGS = [
    ("native", {}, None),
    ("native-expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None),
    ("native-cudaMallocAsync", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, None),
    ("tb-vmm (default)", {}, "vmm"),
    ("tb-pool", {}, "pool"),
    ("tb-sync", {}, "sync"),
]


def churn_trace(seed=0, steps=4000, max_live=48):
    """(op, index, size) steps: the live set swings between a few and max_live tensors."""
    rng = random.Random(seed)
    ops, live, next_id = [], [], 0
    for step in range(steps):
        target = 4 + (max_live - 4) * (0.5 + 0.5 * math.sin(step / 150.0))
        if live and (len(live) > target or rng.random() < 0.3):
            ops.append(("free", live.pop(rng.randrange(len(live))), 0))
        else:
            size = int(min(max(rng.lognormvariate(math.log(16 << 20), 1.6), 4096), 512 << 20))
            ops.append(("alloc", next_id, size))
            live.append(next_id)
            next_id += 1
    return ops


def child(route, pinned, churn):
    if pinned:
        pin_to_one_core()
    import torch

    if route:
        import torch_budget

        torch_budget.install(route=route)
    torch.zeros(1, device="cuda")
    out = {}
    for name, n in SIZES.items():
        for _ in range(200):
            del_me = torch.empty(n, dtype=torch.uint8, device="cuda")
            del del_me
        batches = []
        iters = 20000
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters):
                x = torch.empty(n, dtype=torch.uint8, device="cuda")
                del x
            batches.append((time.perf_counter() - t0) / iters * 1e6)
        out[name] = statistics.median(batches)
    if not churn:
        print("CHILD " + json.dumps(out))
        return

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free0, _ = torch.cuda.mem_get_info()
    base_reserved = torch.cuda.memory_reserved()
    live, live_bytes, peak_live, min_free = {}, 0, 0, free0
    for i, (op, idx, size) in enumerate(churn_trace()):
        if op == "alloc":
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            t[:1].fill_(1)  # touch it, as real work would
            live[idx] = t
            live_bytes += size
            peak_live = max(peak_live, live_bytes)
        else:
            live_bytes -= live.pop(idx).numel()
        if i % 8 == 0:
            min_free = min(min_free, torch.cuda.mem_get_info()[0])
    peak_reserved = torch.cuda.max_memory_reserved() - base_reserved
    out["churn_reserved_ratio"] = peak_reserved / peak_live
    out["churn_device_ratio"] = (free0 - min_free) / peak_live
    out["peak_live_gib"] = peak_live / 2**30
    print("CHILD " + json.dumps(out))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2] if sys.argv[2] != "none" else None, sys.argv[3] == "pinned", sys.argv[4] == "churn")
        return 0
    if cuda_torch("bench_alloc", "GPU allocation", result_line=False) is None:
        return 0
    # Configurations run interleaved, ROUNDS times each; the table takes each one's
    # median, so a slow moment of the machine does not land on one configuration only.
    runs = {}
    plan = [(name, env, route, "pinned", "churn") for name, env, route in CONFIGS]
    plan += [(name + " unpinned", env, route, "unpinned", "no-churn") for name, env, route in CONFIGS
             if name in ("native", "tb-vmm (default)")]
    for _ in range(ROUNDS):
        for name, env, route, pin, churn in plan:
            proc = subprocess.run([sys.executable, __file__, "--child", route or "none", pin, churn],
                                  capture_output=True, text=True, env={**os.environ, **env}, timeout=600)
            line = [l for l in proc.stdout.splitlines() if l.startswith("CHILD ")]
            if proc.returncode != 0 or not line:
                print(f"{name}: FAILED\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
                continue
            runs.setdefault(name, []).append(json.loads(line[0][6:]))
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    if "native" not in results:
        print("RESULT bench_alloc failed=native")
        return 1
    nat = results["native"]
    unpinned = {name: results.pop(name) for name in list(results) if name.endswith(" unpinned")}
    print(f"\n{'config':24} {'4KiB us':>8} {'1MiB us':>8} {'64MiB us':>9}   {'x native (4K/1M/64M)':>22}"
          f" {'churn rsv/live':>14} {'churn dev/live':>14}")
    for name, r in results.items():
        ratios = "/".join(f"{r[k] / nat[k]:.2f}" for k in SIZES)
        print(f"{name:24} {r['4KiB']:8.2f} {r['1MiB']:8.2f} {r['64MiB']:9.2f}   {ratios:>22}"
              f" {r['churn_reserved_ratio']:14.3f} {r['churn_device_ratio']:14.3f}")
    print(f"(peak live bytes of the churn trace: {nat['peak_live_gib']:.2f} GiB; medians of {ROUNDS} interleaved runs;"
          " every configuration pinned to the same CPU core)")
    nat_u = unpinned.get("native unpinned")
    for name, r in unpinned.items():
        ratios = "/".join(f"{r[k] / nat_u[k]:.2f}" for k in SIZES) if nat_u else "-"
        print(f"{name:24} {r['4KiB']:8.2f} {r['1MiB']:8.2f} {r['64MiB']:9.2f}   {ratios:>22}")
    tb = results.get("tb-vmm (default)")
    tb_u = unpinned.get("tb-vmm (default) unpinned")
    if tb:
        worst = max(tb[k] / nat[k] for k in SIZES)
        worst_u = max(tb_u[k] / nat_u[k] for k in SIZES) if tb_u and nat_u else float("nan")
        print(f"RESULT bench_alloc worst_x_native={worst:.2f} worst_x_native_unpinned={worst_u:.2f} "
              f"churn_ratio={tb['churn_reserved_ratio']:.3f} "
              f"churn_device_ratio={tb['churn_device_ratio']:.3f} native_churn={nat['churn_reserved_ratio']:.3f}")
    else:
        print("RESULT bench_alloc failed=tb-vmm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
