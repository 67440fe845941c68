"""torch's own tools under install(), against torch's native allocator in the same run.

Each configuration runs in its own process (install() must come first); the two allocators
alternate (the order flipping each round) and medians are reported. Every process stays on
the CPU cores of the GPU's NUMA node and times its loops on one core, the same in every
process; each figure is the fastest of five timed loops in its process.
  - torch.compile(mode="reduce-overhead") step time, µs, on an MLP (one graph replayed)
    and on a model whose forward branches on the batch size, stepped through three
    batch sizes in turn (the graph tree switches paths): STEP_ROUNDS processes each
    (BENCH_TORCH_ROUNDS, default 7; each compiles). Each process also counts the
    allocations a step makes (memory_stats' allocation.all.allocated over the timed loops).
  - torch.empty + del round trip with memory history recording on
    (torch.cuda.memory._record_memory_history, stacks of every allocation), µs:
    HISTORY_ROUNDS light processes each (BENCH_TORCH_HISTORY_ROUNDS, default 15).
Per figure: the medians, their ratio, the median of the per-round ratios (each round's two
processes ran back to back) and in how many rounds torch_budget was not slower. Each process
also times a loop of plain Python on its timing core: the same figures over that reference
tell a slow machine moment from a slow allocator (printed, not the goal).
Goals: each installed median at most 1.0x native.
The last line is `RESULT bench_torch ...` for the GPU suite's table.
"""
import json
import os
import statistics
import subprocess
import sys

from _bench import cuda_torch  # tools/ is the script's own folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_ROUNDS = int(os.environ.get("BENCH_TORCH_ROUNDS", "7"))
HISTORY_ROUNDS = int(os.environ.get("BENCH_TORCH_HISTORY_ROUNDS", "15"))

CHILD = r"""
import json, os, sys, time
from _bench import pin_near_gpu, pin_to_one_core
pin_near_gpu()  # before torch: its memory is first touched beside the GPU
import torch
if sys.argv[1] == "tb":
    import torch_budget
    torch_budget.install()
torch.zeros(1, device="cuda")

def timed(fn, steps, loops=5):
    # Pinned while timed only: compile workers forked meanwhile would inherit one core.
    allowed = os.sched_getaffinity(0)
    pin_to_one_core()
    best = float("inf")
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            fn(i)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
    os.sched_setaffinity(0, allowed)
    return best

def allocations():
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)

# The machine's own speed in this process: a loop of plain Python on the timing core, no torch.
out = {"ref_us": timed(lambda i: sum(range(2000)), 500)}
if sys.argv[2] == "step":
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.GELU())]).cuda()
    x = torch.randn(32, 1024, device="cuda")

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)
        def forward(self, x):
            h = self.a(x).relu()
            return self.b(h) + h if x.shape[0] > 8 else h * torch.sigmoid(self.b(h))

    model = Branchy().cuda()
    xs = [torch.randn(n, 512, device="cuda") for n in (4, 16, 32)]
    with torch.no_grad():
        f = torch.compile(mlp, mode="reduce-overhead")
        for _ in range(5):
            f(x)
        before = allocations()
        out["mlp_us"] = timed(lambda i: f(x), 300)
        out["mlp_allocs_per_step"] = (allocations() - before) / 1500
        g = torch.compile(model, mode="reduce-overhead")
        for _ in range(6):
            for t in xs:
                g(t)
        before = allocations()
        out["tree_us"] = timed(lambda i: g(xs[i % 3]), 300)
        out["tree_allocs_per_step"] = (allocations() - before) / 1500
else:
    torch.cuda.memory._record_memory_history(max_entries=100000)
    def roundtrip(i):
        t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        del t
    timed(roundtrip, 1000, loops=1)
    out["history_us"] = timed(roundtrip, 20000)
    torch.cuda.memory._record_memory_history(enabled=None)
print("JSON", json.dumps(out))
"""

NAMES = {"mlp_us": "reduce-overhead, MLP step", "tree_us": "reduce-overhead, 3-path tree",
         "history_us": "alloc+free, history on"}


def run(config, kind):
    path = [ROOT, os.path.join(ROOT, "tools"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run([sys.executable, "-c", CHILD, config, kind], capture_output=True, text=True, env=env,
                          timeout=900)
    line = [l for l in proc.stdout.splitlines() if l.startswith("JSON ")]
    if proc.returncode != 0 or not line:
        sys.exit(f"{config} {kind} failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[0][5:])


def rounds(kind, count):
    """{"native": [...], "tb": [...]}, one entry per process; the order flips every round."""
    results = {"native": [], "tb": []}
    for r in range(count):
        for config in (("native", "tb") if r % 2 == 0 else ("tb", "native")):
            results[config].append(run(config, kind))
    return results


def main():
    if cuda_torch("bench_torch", "torch's tools on a GPU") is None:
        return
    history = rounds("history", HISTORY_ROUNDS)  # first: light, and gives an early figure
    step = rounds("step", STEP_ROUNDS)
    per_key = {k: step for k in ("mlp_us", "tree_us")} | {"history_us": history}
    print(f"{'µs':<30}{'native':>9}{'torch_budget':>14}{'ratio':>7}{'paired':>8}{'tb not slower':>15}")
    ratios = {}
    for k, res in per_key.items():
        nat, tb = [r[k] for r in res["native"]], [r[k] for r in res["tb"]]
        ratios[k] = statistics.median(tb) / statistics.median(nat)
        paired = statistics.median(t / n for t, n in zip(tb, nat))
        wins = sum(t <= n for t, n in zip(tb, nat))
        print(f"{NAMES[k]:<30}{statistics.median(nat):>9.1f}{statistics.median(tb):>14.1f}{ratios[k]:>7.2f}"
              f"{paired:>8.2f}{f'{wins}/{len(nat)}':>15}")
    # Rounds where the plain-Python reference ran slow show the machine, not the allocator.
    print("each figure over its process's plain-Python reference, paired median: " + ", ".join(
        f"{NAMES[k]} {statistics.median((t[k] / t['ref_us']) / (n[k] / n['ref_us']) for t, n in zip(res['tb'], res['native'])):.2f}"
        for k, res in per_key.items()))
    for k in ("mlp_allocs_per_step", "tree_allocs_per_step"):
        print(f"{k}: native {statistics.median(r[k] for r in step['native']):.2f}, "
              f"torch_budget {statistics.median(r[k] for r in step['tb']):.2f}")
    print(f"({STEP_ROUNDS} step rounds, {HISTORY_ROUNDS} history rounds; ratio = of the medians, "
          "paired = median of the per-round ratios)")
    print("per round:", json.dumps({"step": step, "history": history}))
    goals = "met" if all(r <= 1.0 for r in ratios.values()) else "missed"
    print("RESULT bench_torch " + " ".join(f"{k[:-3]}_x_native={ratios[k]:.2f}" for k in NAMES) + " " + " ".join(
        f"{k}={statistics.median(r[k] for r in per_key[k]['tb']):.1f}/"
        f"{statistics.median(r[k] for r in per_key[k]['native']):.1f}" for k in NAMES) + f" goals={goals}")


if __name__ == "__main__":
    main()
