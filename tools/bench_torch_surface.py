"""torch's own tools under install(), against torch's native allocator in the same run.

Each configuration runs in its own process (install() must come first); the two
allocators alternate, ROUNDS times (the order flipping each round), and medians are reported;
every process stays on the CPU cores of the GPU's NUMA node and its timed loops on one core,
the same in every process:
  - torch.compile(mode="reduce-overhead") step time, µs, on an MLP (one graph replayed)
    and on a model whose forward branches on the batch size, stepped through three
    batch sizes in turn (the graph tree switches paths, restoring pool checkpoints);
  - torch.empty + del round trip with memory history recording on
    (torch.cuda.memory._record_memory_history, stacks of every allocation), µs.
Goals: each installed figure at most 1.0x native.
The last line is `RESULT bench_torch ...` for the GPU suite's table.
"""
import json
import os
import statistics
import subprocess
import sys

from _bench import cuda_torch  # tools/ is the script's own folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = int(os.environ.get("BENCH_TORCH_ROUNDS", "5"))

CHILD = r"""
import json, os, sys, time
from _bench import pin_near_gpu, pin_to_one_core
cpus = pin_near_gpu()  # before torch: its memory is first touched beside the GPU
import torch
if sys.argv[1] == "tb":
    import torch_budget
    torch_budget.install()

SEGMENTS = 5  # each figure is the fastest of these timed loops: the process's own cost

def timed(fn, steps):
    # Pinned while timed only: compile workers forked meanwhile would inherit one core.
    allowed = os.sched_getaffinity(0)
    pin_to_one_core()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        fn(i)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    os.sched_setaffinity(0, allowed)
    return elapsed / steps * 1e6

out = {"cpus": len(cpus)}
torch.manual_seed(0)
mlp = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.GELU())]).cuda()
x = torch.randn(32, 1024, device="cuda")
with torch.no_grad():
    f = torch.compile(mlp, mode="reduce-overhead")
    for _ in range(5):
        f(x)
    out["mlp_us"] = min(timed(lambda i: f(x), 300) for _ in range(SEGMENTS))

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
    g = torch.compile(model, mode="reduce-overhead")
    for _ in range(6):
        for t in xs:
            g(t)
    out["tree_us"] = min(timed(lambda i: g(xs[i % 3]), 300) for _ in range(SEGMENTS))

torch.cuda.memory._record_memory_history(max_entries=100000)
def roundtrip(i):
    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    del t
timed(roundtrip, 1000)
out["history_us"] = min(timed(roundtrip, 20000) for _ in range(SEGMENTS))
torch.cuda.memory._record_memory_history(enabled=None)
print("JSON", json.dumps(out))
"""


def run(config):
    path = [ROOT, os.path.join(ROOT, "tools"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run([sys.executable, "-c", CHILD, config], capture_output=True, text=True, env=env,
                          timeout=900)
    line = [l for l in proc.stdout.splitlines() if l.startswith("JSON ")]
    if proc.returncode != 0 or not line:
        sys.exit(f"{config} failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[0][5:])


def main():
    if cuda_torch("bench_torch", "torch's tools on a GPU") is None:
        return
    results = {"native": [], "tb": []}
    for r in range(ROUNDS):  # the order flips every round, so neither always runs first
        for config in (("native", "tb") if r % 2 == 0 else ("tb", "native")):
            results[config].append(run(config))
    keys = ("mlp_us", "tree_us", "history_us")
    med = {c: {k: statistics.median(r[k] for r in results[c]) for k in keys} for c in results}
    print(f"{'µs':<28}{'native':>10}{'torch_budget':>14}{'ratio':>8}")
    names = {"mlp_us": "reduce-overhead, MLP step", "tree_us": "reduce-overhead, 3-path tree",
             "history_us": "alloc+free, history on"}
    ratios = {}
    for k in keys:
        ratios[k] = med["tb"][k] / med["native"][k]
        print(f"{names[k]:<28}{med['native'][k]:>10.1f}{med['tb'][k]:>14.1f}{ratios[k]:>8.2f}")
    paired = {k: statistics.median(t[k] / n[k] for t, n in zip(results["tb"], results["native"])) for k in keys}
    print(f"median of the {ROUNDS} per-round ratios: " + ", ".join(f"{names[k]} {paired[k]:.2f}" for k in keys))
    print(f"cores beside the GPU: {results['native'][0]['cpus']}")
    print("per round:", json.dumps(results))
    goals = "met" if all(r <= 1.0 for r in ratios.values()) else "missed"
    print("RESULT bench_torch " + " ".join(
        f"{k[:-3]}_x_native={ratios[k]:.2f}" for k in keys) + " " + " ".join(
        f"{k}={med['tb'][k]:.1f}/{med['native'][k]:.1f}" for k in keys) + f" goals={goals}")


if __name__ == "__main__":
    main()
