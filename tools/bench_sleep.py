"""Sleep/wake benchmark: releasing tagged weights and restoring them, against plain copies.

Everything runs in this one process under torch_budget.install() (it must be the first CUDA
thing), so every figure comes from the same run. The weights are --gib GiB of uint8 tensors
of 2 MiB to 256 MiB under tag "weights", with random contents. Each repeat measures, in an
order that rotates between repeats:
  - torch_budget, no backup: release and restore, ms per GiB;
  - torch_budget, pinned backup (the host pool is reserved beforehand, so nothing is pinned
    at release time): release (device -> host) and restore (host -> device), GB/s each
    (goal >= 50 GB/s and >= 0.9x the pinned copy baseline);
  - the pinned copy baseline: one device tensor of the same total copied into one pinned
    host tensor and back with copy_, GB/s each way;
  - the engines' way, on tensors of the same sizes under tag "engines": per tensor, pin a
    fresh host buffer, copy synchronously, drop the device tensor (then empty_cache); to
    restore, per tensor, allocate and copy back synchronously. torch's pinned host cache is
    emptied before each repeat, so every repeat pins afresh, as a first sleep does.
GB/s counts the tensors' bytes (1 GB = 1e9 bytes) for every configuration. Contents are
checked after every restore: a checksum of every tensor and three sampled slices each.
The table shows medians over --repeat repeats; the last line is `RESULT bench_sleep ...`.
"""
import argparse
import os
import random
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench import cuda_torch  # noqa: E402  (tools/ is the script's own folder)

MiB, GiB, GB = 1 << 20, 1 << 30, 1e9
MIN_SIZE, MAX_SIZE = 2 * MiB, 256 * MiB
GOAL_GBPS = 50.0
BASELINE_SHARE = 0.9  # goal: at least this share of the plain pinned copy, each way
SAMPLE = 64 * 1024  # bytes per sampled slice
CHECKSUM_SLICE = 32 * MiB


def tensor_sizes(total, seed=0):
    """Sizes (4 KiB multiples, log-uniform between MIN_SIZE and MAX_SIZE) summing to `total`."""
    rng = random.Random(seed)
    sizes, left = [], total
    while left > 0:
        size = int(2 ** rng.uniform(21, 28)) // 4096 * 4096
        size = max(MIN_SIZE, min(size, MAX_SIZE, left))
        if left - size < MIN_SIZE:
            size = left  # no tail below the smallest size (may then exceed MAX_SIZE by < 2 MiB)
        sizes.append(size)
        left -= size
    return sizes


class ContentsChanged(Exception):
    """A restore did not bring back the bytes that were released."""


class Weights:
    """Tensors of `sizes` bytes under `tag`, with reproducible random contents and their checks."""

    def __init__(self, torch, torch_budget, sizes, tag, seed):
        self.torch, self.tag, self.seed, self.sizes = torch, tag, seed, sizes
        with torch_budget.region(tag):
            self.tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        self.refill()
        self.sums, self.samples = self.checks()

    def refill(self):
        torch = self.torch
        for i, t in enumerate(self.tensors):
            t.random_(generator=torch.Generator(device="cuda").manual_seed(self.seed + i))
        torch.cuda.synchronize()

    def checks(self):
        torch = self.torch
        sums = torch.stack([checksum(torch, t) for t in self.tensors]).cpu()
        samples = []
        for t in self.tensors:
            mid = t.numel() // 2
            samples.append(torch.cat([t[:SAMPLE], t[mid:mid + SAMPLE], t[-SAMPLE:]]).cpu())
        return sums, samples

    def verify(self, what):
        sums, samples = self.checks()
        bad = [i for i in range(len(self.tensors))
               if int(sums[i]) != int(self.sums[i]) or not self.torch.equal(samples[i], self.samples[i])]
        if bad:
            raise ContentsChanged(f"{what}: tensors {bad[:8]} (of {len(self.tensors)}) changed across the round trip")


def checksum(torch, t):
    """Sum of the int32 words of `t`, in slices: a reduction to another dtype first copies its
    input into that dtype, so one call over a 256 MiB tensor would take 512 MiB more."""
    words = t.view(torch.int32)
    step = CHECKSUM_SLICE // 4
    return torch.stack([words[i:i + step].sum(dtype=torch.int64) for i in range(0, words.numel(), step)]).sum()


def timed(torch, fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def tb_none(torch, tb, bench):
    release_s, report = timed(torch, lambda: tb.release("weights", backup="none"))
    restore_s, _ = timed(torch, lambda: tb.restore("weights"))
    bench.weights.refill()  # the contents were undefined after the restore
    return {"release_s": release_s, "restore_s": restore_s, "device_bytes": report["bytes"]}


def tb_pinned(torch, tb, bench):
    release_s, report = timed(torch, lambda: tb.release("weights", backup="pinned"))
    restore_s, _ = timed(torch, lambda: tb.restore("weights"))
    bench.weights.verify("torch_budget pinned backup")
    return {"release_s": release_s, "restore_s": restore_s, "backup_bytes": report["backup_bytes"]}


def pinned_copy(torch, tb, bench):
    release_s, _ = timed(torch, lambda: bench.host.copy_(bench.device, non_blocking=True))
    restore_s, _ = timed(torch, lambda: bench.device.copy_(bench.host, non_blocking=True))
    return {"release_s": release_s, "restore_s": restore_s}


def engines_way(torch, tb, bench):
    tensors = bench.engines.tensors
    backups = []

    def release():
        for i, t in enumerate(tensors):
            host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)  # pinned at release time
            host.copy_(t)
            torch.cuda.synchronize()
            backups.append(host)
            tensors[i] = None  # the device tensor goes
        torch.cuda.empty_cache()

    def restore():
        for i, host in enumerate(backups):
            with tb.region("engines"):
                t = torch.empty(host.numel(), dtype=host.dtype, device="cuda")
            t.copy_(host)
            torch.cuda.synchronize()
            tensors[i] = t
        backups.clear()

    release_s, _ = timed(torch, release)
    restore_s, _ = timed(torch, restore)
    bench.engines.verify("the engines' way")
    return {"release_s": release_s, "restore_s": restore_s}


FIRST = "first pinned cycle (2 MiB maps)"
CONFIGS = [
    ("torch_budget, no backup", tb_none),
    ("torch_budget, pinned backup", tb_pinned),
    ("pinned copy_ (one tensor)", pinned_copy),
    ("engines' way (pin per tensor)", engines_way),
]


def empty_host_cache(torch):
    """Unpins what torch's pinned host cache holds (so the engines' way pins afresh)."""
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()
    return fn is not None


def run(torch, tb, total, repeat):
    bench = types.SimpleNamespace()
    sizes = tensor_sizes(total)
    bench.weights = Weights(torch, tb, sizes, "weights", seed=1)
    bench.engines = Weights(torch, tb, sizes, "engines", seed=1)
    with tb.region("baseline"):
        bench.device = torch.empty(total, dtype=torch.uint8, device="cuda")
    bench.host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    bench.host.fill_(1)
    resident = tb.sleep.tag_states()["weights"]["resident"]
    start = time.perf_counter()
    pool = tb.sleep.reserve_host_pool(resident)
    reserve_s = time.perf_counter() - start
    print(f"{len(sizes)} tensors of {min(sizes) / MiB:.0f} to {max(sizes) / MiB:.0f} MiB, {total / GiB:.2f} GiB "
          f"({resident / GiB:.2f} GiB resident); host pool {pool / GiB:.2f} GiB pinned in {reserve_s:.2f} s")
    # The first cycle starts from the allocator's own mappings (one 2 MiB handle per granule,
    # which the driver unmaps at ~45 us each); a restore maps whole runs, so later cycles
    # (the repeats below) release and restore runs. Shown apart, not in the medians.
    first = tb_pinned(torch, tb, bench)
    bench.first = {"release_s": first["release_s"], "restore_s": first["restore_s"]}
    runs = {name: [] for name, _ in CONFIGS}
    emptied = True
    for r in range(repeat):
        emptied = empty_host_cache(torch) and emptied
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for name, fn in order:
            runs[name].append(fn(torch, tb, bench))
    medians = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    medians[FIRST] = bench.first
    return medians, emptied, retained(torch, tb, bench, repeat)


def print_table(medians, total, notes):
    """One row per configuration: release (or backup) and restore, in ms, ms per GiB and GB/s."""
    gib = total / GiB
    print(f"\n{'configuration':32} {'release ms':>11} {'ms/GiB':>8} {'GB/s':>7}   {'restore ms':>11} {'ms/GiB':>8} "
          f"{'GB/s':>7}")
    for name, m in medians.items():
        rel, res = m["release_s"], m["restore_s"]
        print(f"{name:32} {rel * 1e3:11.1f} {rel * 1e3 / gib:8.1f} {total / rel / GB:7.1f}   "
              f"{res * 1e3:11.1f} {res * 1e3 / gib:8.1f} {total / res / GB:7.1f}   {notes.get(name, '')}".rstrip())


RETAIN_SHARE = 32  # the changed run: one granule in this many


def retained(torch, tb, bench, repeat):
    """Retained pinned backups (Note [Retained backups]): after a first cycle that copies
    everything, `repeat` releases of the unchanged weights (nothing to copy: an unmap each), then
    `repeat` releases after one byte changed in every RETAIN_SHARE-th granule of the weights
    (those granules, and only those, to copy). Contents are checked after every restore."""
    weights = bench.weights
    tb.release("weights", backup="pinned", retain=True)
    tb.restore("weights")
    weights.verify("retained backup, first cycle")
    unchanged, changed = [], []
    for _ in range(repeat):
        release_s, rep = timed(torch, lambda: tb.release("weights", backup="pinned", retain=True))
        restore_s, _ = timed(torch, lambda: tb.restore("weights"))
        weights.verify("retained backup, unchanged")
        unchanged.append({"release_s": release_s, "restore_s": restore_s, "copied": rep["backup_bytes"]})
    granules = sorted({(t.data_ptr() + off) // (2 * MiB) for t in weights.tensors
                       for off in range(0, t.numel(), 2 * MiB)} |
                      {(t.data_ptr() + t.numel() - 1) // (2 * MiB) for t in weights.tensors})
    picked = granules[::RETAIN_SHARE]
    for r in range(repeat):
        for g in picked:  # one byte of each picked granule, inside some tensor
            t = next(t for t in weights.tensors if t.data_ptr() < (g + 1) * 2 * MiB and
                     t.data_ptr() + t.numel() > g * 2 * MiB)
            lo = max(g * 2 * MiB - t.data_ptr(), 0)
            hi = min((g + 1) * 2 * MiB - t.data_ptr(), t.numel())
            i = lo + r % (hi - lo)
            t[i:i + 1].add_(1)
        weights.sums, weights.samples = weights.checks()
        release_s, rep = timed(torch, lambda: tb.release("weights", backup="pinned", retain=True))
        restore_s, _ = timed(torch, lambda: tb.restore("weights"))
        weights.verify("retained backup, changed")
        changed.append({"release_s": release_s, "restore_s": restore_s, "copied": rep["backup_bytes"]})
    tb.sleep.drop_backup("weights")
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    return {"unchanged_release_ms": med(unchanged, "release_s") * 1e3,
            "unchanged_copied": int(max(x["copied"] for x in unchanged)),
            "changed_release_ms": med(changed, "release_s") * 1e3,
            "changed_copied": int(med(changed, "copied")), "changed_expected": len(picked) * 2 * MiB,
            "restore_gbps": weights_bytes(weights) / med(unchanged + changed, "restore_s") / GB}


def weights_bytes(weights):
    return sum(t.numel() for t in weights.tensors)


def report_retained(ret, total):
    print(f"\nretained pinned backup, {total / GiB:.2f} GiB: release of the unchanged weights "
          f"{ret['unchanged_release_ms']:.1f} ms (goal <= 10 ms), {ret['unchanged_copied']} bytes copied; with one "
          f"granule in {RETAIN_SHARE} changed {ret['changed_release_ms']:.1f} ms, {ret['changed_copied'] / MiB:.0f} MiB "
          f"copied of {ret['changed_expected'] / MiB:.0f} MiB changed; restore {ret['restore_gbps']:.1f} GB/s "
          "(contents verified after every restore)")


def report(medians, total, pool, emptied, repeat):
    """The table, the goals and the RESULT line."""
    none, pinned = medians["torch_budget, no backup"], medians["torch_budget, pinned backup"]
    copy, engines = medians["pinned copy_ (one tensor)"], medians["engines' way (pin per tensor)"]
    gib = total / GiB
    pairs = {
        "release_ms_per_gib": none["release_s"] * 1e3 / gib,
        "backup_gbps": total / pinned["release_s"] / GB,
        "restore_gbps": total / pinned["restore_s"] / GB,
        "pinned_copy_d2h_gbps": total / copy["release_s"] / GB,
        "pinned_copy_h2d_gbps": total / copy["restore_s"] / GB,
        "engines_backup_gbps": total / engines["release_s"] / GB,
        "engines_restore_gbps": total / engines["restore_s"] / GB,
        "first_backup_gbps": total / medians[FIRST]["release_s"] / GB,
        "first_restore_gbps": total / medians[FIRST]["restore_s"] / GB,
    }
    goal_d2h = max(GOAL_GBPS, BASELINE_SHARE * pairs["pinned_copy_d2h_gbps"])
    goal_h2d = max(GOAL_GBPS, BASELINE_SHARE * pairs["pinned_copy_h2d_gbps"])
    print_table(medians, total, {
        "pinned copy_ (one tensor)": f"goal {BASELINE_SHARE}x: {BASELINE_SHARE * pairs['pinned_copy_d2h_gbps']:.1f}"
                                     f" / {BASELINE_SHARE * pairs['pinned_copy_h2d_gbps']:.1f} GB/s",
        "torch_budget, pinned backup": f"goal: {goal_d2h:.1f} / {goal_h2d:.1f} GB/s",
        FIRST: "once, not a median: the allocator's granule mappings",
    })
    met = pairs["backup_gbps"] >= goal_d2h and pairs["restore_gbps"] >= goal_h2d and pool["pinned_at_release"] == 0
    print(f"\ntorch_budget pinned backup {pairs['backup_gbps']:.1f} GB/s, restore {pairs['restore_gbps']:.1f} GB/s "
          f"(goals: >= {GOAL_GBPS:.0f} GB/s and >= {BASELINE_SHARE}x the pinned copy each way); "
          f"{pinned['backup_bytes'] / GiB:.2f} GiB backed up for {gib:.2f} GiB of tensors")
    print(f"torch_budget without backup: release {pairs['release_ms_per_gib']:.1f} ms/GiB, "
          f"restore {none['restore_s'] * 1e3 / gib:.1f} ms/GiB")
    print(f"engines' way: {engines['release_s']:.2f} s to back up, {engines['restore_s']:.2f} s to restore; "
          f"torch_budget pinned: {pinned['release_s']:.2f} s and {pinned['restore_s']:.2f} s")
    print(f"host pool: {pool['bytes'] / GiB:.2f} GiB pinned; pinned at release: {pool['pinned_at_release']} bytes "
          f"(must be 0){'' if emptied else '; this torch cannot empty its pinned host cache: engines reused buffers'}")
    print(f"(medians of {repeat} interleaved repeats; GB/s counts the tensors' bytes; contents verified after "
          "every restore)")
    pairs["pinned_at_release"] = pool["pinned_at_release"]
    pairs["goals"] = "met" if met else "missed"
    print("RESULT bench_sleep " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in pairs.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="GiB of weights to release and restore (default 8)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats of every configuration; medians are shown")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeat < 1:
        parser.error("--gib must be positive and --repeat at least 1")
    torch = cuda_torch("bench_sleep", "GPU memory")
    if torch is None:
        return 0
    import torch_budget as tb

    tb.install()  # before the first CUDA allocation of this process
    total = max(int(args.gib * GiB) // (2 * MiB) * (2 * MiB), 2 * MiB)
    need = 3 * total + 2 * GiB  # weights, the engines' tensors, the baseline tensor, slack
    free = torch.cuda.mem_get_info()[0]
    if free < need:
        print(f"bench_sleep: {need / GiB:.1f} GiB of free device memory needed, {free / GiB:.1f} GiB free; "
              "lower --gib")
        print("RESULT bench_sleep failed=device_memory")
        return 1
    try:
        medians, emptied, ret = run(torch, tb, total, args.repeat)
    except ContentsChanged as e:
        print(f"bench_sleep: {e}")
        print("RESULT bench_sleep failed=contents")
        return 1
    report_retained(ret, total)
    print("RESULT bench_sleep_retained " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                                    for k, v in ret.items()))
    report(medians, total, tb.sleep.host_pool_stats(), emptied, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
