"""CUDA-graph benchmark: what a captured host-to-device copy buys, and what a shared pool saves.

A decode-like step (embedding, a few layers of small matmuls and elementwise ops) runs three ways:
  eager        copy host inputs to the device, then launch every kernel;
  graph+copy   torch.cuda.graph replay, with the host-to-device copies launched eagerly before it;
  manager      GraphPoolManager.step: a CPU memcpy into the next pinned shadow slot, then one
               replay whose graph contains the copies. --slots sets the shadow slots (how far
               the host may stage ahead); --outputs in_pool (default) keeps the step's output
               where the graph writes it, in a pool the runner owns, --outputs copy copies it
               into a static buffer inside the graph (the runner default).
For each: µs per step (CUDA events, median after warm-up, loop running freely), µs per step in a
decode loop that synchronises every step (wall clock, median), and launches per step (kernel,
memcpy and graph launches counted with torch.profiler).

Then the memory of N bucket graphs: captured into one shared pool vs into N separate pools vs the
largest bucket alone (memory_reserved deltas after capture). Sharing works when the ratio
shared / largest stays near 1 (goal <= 1.1).

    python tools/bench_graphs.py [--batches 1,8,32,64] [--layers 4] [--hidden 512] [--slots 2]
                                 [--outputs in_pool|copy] [--install]

--install runs the same in a subprocess under torch_budget.install(). The last line is
`RESULT bench_graphs key=value ...`; µs figures there are means over the batches of the
per-batch medians, launches are at the largest batch; slots= and outputs= say how the
manager's runner was configured.
"""

import argparse
import gc
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20
DTYPE = torch.float16


class DecodeStep:
    """Embedding, then per layer an RMS norm and a gated-free MLP with a residual: ~10 kernels a layer."""

    def __init__(self, layers, hidden, vocab, device):
        gen = torch.Generator().manual_seed(0)
        self.embed = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(device, DTYPE)
        self.layers = [
            ((torch.randn(hidden, 4 * hidden, generator=gen) / hidden ** 0.5).to(device, DTYPE),
             (torch.randn(4 * hidden, hidden, generator=gen) / (4 * hidden) ** 0.5).to(device, DTYPE))
            for _ in range(layers)
        ]

    @staticmethod
    def _rms_norm(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def __call__(self, tokens, positions):
        h = F.embedding(tokens, self.embed) * torch.cos(positions.unsqueeze(-1).to(DTYPE) * 1e-3)
        for w_up, w_down in self.layers:
            h = h + F.silu(self._rms_norm(h) @ w_up) @ w_down
        return self._rms_norm(h)


def step_inputs():
    from torch_budget.graphs import StaticInput

    return [StaticInput("tokens", torch.int64, ()), StaticInput("positions", torch.int64, ())]


def host_batches(batch, vocab, count, pinned):
    gen = torch.Generator().manual_seed(batch)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch,), generator=gen)
        positions = torch.randint(0, 4096, (batch,), generator=gen)
        out.append((tokens.pin_memory(), positions.pin_memory()) if pinned else (tokens, positions))
    return out


# -- timing and launch counts -----------------------------------------------------------

def time_free_running(fn, iters, warmup):
    """Median µs between CUDA events around each step, the host issuing steps back to back."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def time_synced(fn, iters, warmup):
    """Median wall µs of one step followed by a synchronize, as in a decode loop reading tokens back."""
    for i in range(warmup):
        fn(i)
        torch.cuda.synchronize()
    samples = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


_LAUNCH = re.compile(r"^cu(da)?(LaunchKernel\w*|LaunchCooperativeKernel\w*|GraphLaunch\w*|Memcpy\w*Async\w*|Memset\w*Async\w*)$")


def count_launches(fn, steps=10):
    """Kernel, memcpy/memset and graph launches per step, from the runtime/driver calls the profiler saw."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            fn(i)
        torch.cuda.synchronize()
    counts = Counter()
    for event in prof.events():
        match = _LAUNCH.match(event.name)
        if match:
            kind = match.group(2)
            counts["graph" if kind.startswith("Graph") else "copy" if kind.startswith("Mem") else "kernel"] += 1
    if not counts:
        # Every variant launches something, so an empty count means the profiler saw no runtime calls.
        raise RuntimeError("the profiler recorded no CUDA runtime launch calls")
    return {kind: counts[kind] / steps for kind in ("kernel", "copy", "graph")}


def launches_text(c):
    if c is None:
        return "n/a"
    total = c["kernel"] + c["copy"] + c["graph"]
    return f"{total:.0f} ({c['kernel']:.0f} kernel, {c['copy']:.0f} copy, {c['graph']:.0f} graph)"


# -- the three variants -----------------------------------------------------------------

def bench_speed(args, device):
    from torch_budget.graphs import GraphPoolManager

    model = DecodeStep(args.layers, args.hidden, args.vocab, device)
    batches = sorted(args.batches)
    top = batches[-1]

    # graph+copy: one plain torch graph per batch, all in one pool, largest first.
    static_tokens = torch.zeros(top, dtype=torch.int64, device=device)
    static_positions = torch.zeros(top, dtype=torch.int64, device=device)
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    plain = {}
    for batch in reversed(batches):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(static_tokens[:batch], static_positions[:batch])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side):
            out = model(static_tokens[:batch], static_positions[:batch])
        plain[batch] = (graph, out)

    manager = GraphPoolManager(device)
    # Outputs kept in the pool need a pool of the runner's own (Note [Outputs kept in the pool]).
    runner = manager.runner("decode", lambda b: {"out": model(b["tokens"], b["positions"])},
                            buckets=batches, inputs=step_inputs(), shadow_slots=args.slots,
                            pool="own" if args.outputs == "in_pool" else "shared", last_outputs=args.outputs)
    runner.capture()

    rows = []
    for batch in batches:
        pinned = host_batches(batch, args.vocab, 8, pinned=True)
        plain_cpu = host_batches(batch, args.vocab, 8, pinned=False)
        graph, graph_out = plain[batch]

        def eager(i, data=pinned):
            tokens, positions = data[i % len(data)]
            return model(tokens.to(device, non_blocking=True), positions.to(device, non_blocking=True))

        def graph_copy(i, data=pinned, graph=graph, graph_out=graph_out, batch=batch):
            tokens, positions = data[i % len(data)]
            static_tokens[:batch].copy_(tokens, non_blocking=True)
            static_positions[:batch].copy_(positions, non_blocking=True)
            graph.replay()
            return graph_out

        def managed(i, data=plain_cpu, batch=batch):
            tokens, positions = data[i % len(data)]
            return runner.step(batch, tokens=tokens, positions=positions)["out"]

        expected = eager(5).clone()
        for name, fn in (("graph+copy", graph_copy), ("manager", managed)):
            got = fn(5)
            if not torch.allclose(got, expected, rtol=2e-2, atol=2e-2):
                raise RuntimeError(f"{name} at batch {batch} differs from eager by "
                                   f"{(got.float() - expected.float()).abs().max().item():.3g}")

        row = {"batch": batch}
        for name, fn in (("eager", eager), ("graph_copy", graph_copy), ("manager", managed)):
            row[f"{name}_us"] = time_free_running(fn, args.iters, args.warmup)
            row[f"{name}_sync_us"] = time_synced(fn, args.iters // 2, args.warmup)
        rows.append(row)

    launches = {}
    last = batches[-1]
    pinned = host_batches(last, args.vocab, 8, pinned=True)
    plain_cpu = host_batches(last, args.vocab, 8, pinned=False)
    graph, graph_out = plain[last]
    variants = {
        "eager": lambda i: model(*(t.to(device, non_blocking=True) for t in pinned[i % 8])),
        "graph_copy": lambda i: (static_tokens[:last].copy_(pinned[i % 8][0], non_blocking=True),
                                 static_positions[:last].copy_(pinned[i % 8][1], non_blocking=True),
                                 graph.replay()),
        "manager": lambda i: runner.step(last, tokens=plain_cpu[i % 8][0], positions=plain_cpu[i % 8][1]),
    }
    for name, fn in variants.items():
        try:
            launches[name] = count_launches(fn)
        except RuntimeError as exc:  # the profiler (CUPTI) may be unavailable on some systems
            print(f"launch count for {name} unavailable: {exc}")
            launches[name] = None

    manager.close()
    for graph, _ in plain.values():
        graph.reset()
    return rows, launches


# -- memory: one shared pool vs separate pools ------------------------------------------

def bench_memory(args, device):
    from torch_budget.graphs import GraphPoolManager

    model = DecodeStep(2, args.mem_hidden, args.vocab, device)
    buckets = sorted(args.mem_buckets)
    manager = GraphPoolManager(device)

    def piece(b):
        return {"out": model(b["tokens"], b["positions"])}

    def captured(name, sizes):
        runner = manager.runner(name, piece, buckets=sizes, inputs=step_inputs(), pool="own",
                                shadow_slots=args.slots)
        runner.capture()
        return runner

    def measure(build):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        runners = build()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved() - base
        for runner in runners:
            runner.close()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return held, torch.cuda.memory_reserved() - base

    # What outlives every runner (cuBLAS workspaces of the capture and default streams)
    # is created before the first measurement.
    captured("prime", [buckets[0]]).close()
    model(torch.zeros(8, dtype=torch.int64, device=device), torch.zeros(8, dtype=torch.int64, device=device))

    largest, leak_largest = measure(lambda: [captured("largest", [buckets[-1]])])
    shared, leak_shared = measure(lambda: [captured("shared", buckets)])
    separate, leak_separate = measure(lambda: [captured(f"bucket{b}", [b]) for b in buckets])
    manager.close()
    return {
        "buckets": buckets,
        "largest_mib": largest / MiB,
        "shared_mib": shared / MiB,
        "separate_mib": separate / MiB,
        "shared_over_largest": shared / largest if largest else float("nan"),
        "separate_over_largest": separate / largest if largest else float("nan"),
        "left_after_close_mib": max(leak_largest, leak_shared, leak_separate) / MiB,
    }


# -- report -----------------------------------------------------------------------------

def report(args, rows, launches, memory, tag=""):
    print()
    print(f"{tag}decode step: {args.layers} layers, hidden {args.hidden}, fp16, {torch.cuda.get_device_name()}, "
          f"allocator {torch.cuda.get_allocator_backend()}; manager: {args.slots} shadow slot(s), "
          f"outputs {args.outputs}")
    print(f"{tag}{'batch':>5} | {'eager':>8} {'graph+copy':>10} {'manager':>8} | "
          f"{'eager':>8} {'graph+copy':>10} {'manager':>8}")
    print(f"{tag}{'':>5} | {'µs/step free-running':^28} | {'µs/step synced loop':^28}")
    for r in rows:
        print(f"{tag}{r['batch']:>5} | {r['eager_us']:>8.1f} {r['graph_copy_us']:>10.1f} {r['manager_us']:>8.1f} | "
              f"{r['eager_sync_us']:>8.1f} {r['graph_copy_sync_us']:>10.1f} {r['manager_sync_us']:>8.1f}")
    print(f"{tag}launches/step at batch {rows[-1]['batch']}: eager {launches_text(launches['eager'])}; "
          f"graph+copy {launches_text(launches['graph_copy'])}; manager {launches_text(launches['manager'])}")
    m = memory
    print(f"{tag}memory, {len(m['buckets'])} buckets {m['buckets']} (hidden {args.mem_hidden}): "
          f"largest alone {m['largest_mib']:.1f} MiB, shared pool {m['shared_mib']:.1f} MiB, "
          f"separate pools {m['separate_mib']:.1f} MiB")
    print(f"{tag}shared/largest {m['shared_over_largest']:.3f} (goal <= 1.1), separate/largest "
          f"{m['separate_over_largest']:.2f}, left after close {m['left_after_close_mib']:.1f} MiB")


def result_pairs(args, rows, launches, memory):
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    total = lambda c: "na" if c is None else f"{c['kernel'] + c['copy'] + c['graph']:.0f}"  # noqa: E731
    return {
        "eager_us": f"{mean('eager_us'):.1f}",
        "graph_copy_us": f"{mean('graph_copy_us'):.1f}",
        "manager_us": f"{mean('manager_us'):.1f}",
        "eager_sync_us": f"{mean('eager_sync_us'):.1f}",
        "graph_copy_sync_us": f"{mean('graph_copy_sync_us'):.1f}",
        "manager_sync_us": f"{mean('manager_sync_us'):.1f}",
        "launches_eager": total(launches["eager"]),
        "launches_graph_copy": total(launches["graph_copy"]),
        "launches_manager": total(launches["manager"]),
        "shared_over_largest": f"{memory['shared_over_largest']:.3f}",
        "separate_over_largest": f"{memory['separate_over_largest']:.2f}",
        "left_after_close_mib": f"{memory['left_after_close_mib']:.1f}",
        "slots": str(args.slots),
        "outputs": args.outputs,
    }


def run_installed(argv):
    """The same benchmark in a fresh process under torch_budget.install(); its RESULT pairs."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--installed-child"] + argv
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    for line in proc.stdout.splitlines():
        print(f"[install] {line}")
    if proc.returncode != 0:
        print(f"[install] failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        return None
    last = proc.stdout.strip().splitlines()[-1]
    if not last.startswith("RESULT bench_graphs "):
        print(f"[install] no RESULT line; last line was {last!r}")
        return None
    return dict(pair.split("=", 1) for pair in last.split()[2:])


def parse_args(argv):
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--mem-hidden", type=int, default=2048)
    p.add_argument("--mem-buckets", type=ints, default=[8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--slots", type=int, default=2, help="the manager runner's pinned shadow slots")
    p.add_argument("--outputs", choices=("in_pool", "copy"), default="in_pool",
                   help="the manager runner's last_outputs: keep in its own pool, or copy to a static buffer")
    p.add_argument("--install", action="store_true", help="also run under torch_budget.install() in a subprocess")
    p.add_argument("--installed-child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_graphs: no CUDA device visible; nothing to measure")
        print(f"RESULT bench_graphs skipped=no_cuda slots={args.slots} outputs={args.outputs}")
        return 0
    if args.installed_child:
        import torch_budget

        torch_budget.install()  # before the first CUDA allocation of this process
    device = torch.device("cuda", torch.cuda.current_device())

    rows, launches = bench_speed(args, device)
    memory = bench_memory(args, device)
    pairs = result_pairs(args, rows, launches, memory)

    installed = None
    if args.install and not args.installed_child:
        forwarded = [a for a in argv if a != "--install"]
        installed = run_installed(forwarded)

    report(args, rows, launches, memory)
    if args.install and not args.installed_child:
        if installed is None:
            pairs["install"] = "failed"
        else:
            print(f"under install(): eager {installed['eager_us']} µs, graph+copy {installed['graph_copy_us']} µs, "
                  f"manager {installed['manager_us']} µs (means over batches); shared/largest "
                  f"{installed['shared_over_largest']}, separate/largest {installed['separate_over_largest']}")
            pairs.update({f"inst_{k}": v for k, v in installed.items()
                          if k in ("eager_us", "graph_copy_us", "manager_us", "shared_over_largest")})
    print("RESULT bench_graphs " + " ".join(f"{k}={v}" for k, v in pairs.items()))
    return 1 if pairs.get("install") == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
