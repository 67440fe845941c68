"""Where a `torch.empty + del` round trip spends its time, natively and under install(): the
configurations run at once, each in its own process, all pinned to the same core, timing
batches of round trips in CPU time (so the time the other process holds the core is not
counted, and a slow spell of the core falls on both); the median batch is reported, with the
same loop on torch's `meta` device (no memory at all), and under `floor`: a subclass of torch's
CUDAPluggableAllocator that overrides allocate() and raw_deleter() as torch_budget's bridge does
and hands out addresses from one cudaMalloc with no bookkeeping at all (a bump pointer, frees
ignored), built here with torch's extension builder: the least any allocator behind torch's
interface can cost, so (tb - floor) / (native - floor) is what each allocator's own work costs.
Each process then times the same round trip without Python, in a C++ loop over torch's current
allocator (`allocate` and the DataPtr's deleter: the allocator behind torch's interface, no tensor),
and the torch_budget process a C loop over the core's C ABI (`tb_malloc` / `tb_free`: the core
alone, on the real driver); together they split a round trip into torch's own part, the bridge's
and the core's.
With --perf DIR and `perf` on the machine, each configuration is then profiled alone and the
time by library and by symbol written to DIR/<config>.txt.

    python tools/probe_roundtrip.py [--sizes 4096,1048576,67108864] [--perf DIR]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_budget.replay.configs import CLEAN_ENVIRONMENT  # noqa: E402

CONFIGS = ("native", "tb-vmm")
FLOOR_ARENA = 256 << 20  # the bump pointer wraps within it: each tensor dies before the next

FLOOR_SOURCE = r"""
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/types.h>
#include <time.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace {
char* base = nullptr;
size_t capacity = 0, offset = 0;
void ignore(void*) {}

class Floor final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  Floor()
      : CUDAPluggableAllocator([](size_t, int, cudaStream_t) -> void* { return nullptr; },
                               [](void*, size_t, int, cudaStream_t) {}) {}
  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    (void)c10::cuda::getCurrentCUDAStream(device);  // what every allocator asks for
    size = (size + 511) & ~size_t{511};
    if (offset + size > capacity) offset = 0;
    void* p = base + offset;
    offset += size;
    return {p, p, &ignore, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &ignore; }
};

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// The median over `batches` of the time per call of `round_trip`, in microseconds (thread CPU time).
template <typename Fn>
double median_us(long long batch, int batches, Fn round_trip) {
  for (long long i = 0; i < batch; ++i) round_trip();  // grown outside the timed batches
  std::vector<double> times;
  for (int b = 0; b < batches; ++b) {
    const double t0 = thread_seconds();
    for (long long i = 0; i < batch; ++i) round_trip();
    times.push_back((thread_seconds() - t0) / static_cast<double>(batch) * 1e6);
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}
}  // namespace

// torch's current CUDA allocator, from C++: allocate, then the DataPtr's deleter.
extern "C" double probe_allocator_roundtrip(long long size, long long batch, int batches) {
  c10::Allocator* a = c10::cuda::CUDACachingAllocator::get();
  return median_us(batch, batches, [&] { c10::DataPtr p = a->allocate(static_cast<size_t>(size)); });
}

// The core's C ABI in the library at `path` (torch_budget's, loaded already) on `device` and `stream`:
// -1 if the library is not loaded or has no such symbols.
extern "C" double probe_core_roundtrip(const char* path, long long size, long long batch, int batches, int device,
                                       cudaStream_t stream) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return -1;
  using Malloc = void* (*)(ssize_t, int, cudaStream_t);
  using Free = void (*)(void*, ssize_t, int, cudaStream_t);
  auto m = reinterpret_cast<Malloc>(dlsym(lib, "tb_malloc"));
  auto f = reinterpret_cast<Free>(dlsym(lib, "tb_free"));
  if (m == nullptr || f == nullptr) return -1;
  const auto n = static_cast<ssize_t>(size);
  return median_us(batch, batches, [&] { f(m(n, device, stream), n, device, stream); });
}

extern "C" int probe_install_floor(long long bytes) {
  if (cudaMalloc(reinterpret_cast<void**>(&base), static_cast<size_t>(bytes)) != cudaSuccess) return 1;
  capacity = static_cast<size_t>(bytes);
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(std::make_shared<Floor>());
  return 0;
}
"""


def build_floor():
    """FLOOR_SOURCE as a library (its path), by torch's extension builder: the parent builds it once
    before any process is timed and gives the children its path."""
    import tempfile

    from torch.utils.cpp_extension import load

    folder = os.path.join(tempfile.gettempdir(), "tb_probe_floor")
    os.makedirs(folder, exist_ok=True)
    source = os.path.join(folder, "floor.cpp")
    if not os.path.exists(source) or open(source).read() != FLOOR_SOURCE:
        with open(source, "w") as f:
            f.write(FLOOR_SOURCE)
    return load("tb_probe_floor", sources=[source], with_cuda=True, is_python_module=False, extra_cflags=["-O2"],
                build_directory=folder)


def probe_library(path):
    """The probe's library at `path` (built by the parent), its functions declared."""
    import ctypes

    lib = ctypes.CDLL(path)
    ll = ctypes.c_longlong
    lib.probe_install_floor.argtypes = [ll]
    lib.probe_allocator_roundtrip.argtypes = [ll, ll, ctypes.c_int]
    lib.probe_allocator_roundtrip.restype = ctypes.c_double
    lib.probe_core_roundtrip.argtypes = [ctypes.c_char_p, ll, ll, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.probe_core_roundtrip.restype = ctypes.c_double
    return lib


def install_floor(lib):
    """Makes the floor allocator torch's, before CUDA's first allocation."""
    if lib.probe_install_floor(FLOOR_ARENA) != 0:
        raise SystemExit("probe_roundtrip: the floor allocator's cudaMalloc failed")


BATCH = 4000
BATCHES = 60
# What a child prints, one line per kind and size: the round trip from Python (torch.empty + del),
# from C++ over torch's allocator interface, and over the core's C ABI (torch_budget only).
KINDS = ("ROUNDTRIP", "ALLOCATOR", "CORE", "TAKEBACK")


def take_backs():
    """torch_budget's count of freed blocks taken back as they were (Note [The parked block]): a
    round trip that took another path shows as a share below 1."""
    import torch_budget

    return torch_budget.stats()["raw"]["num_take_backs"]


def child(config, sizes, batches, meta, library):
    from torch_budget.replay.configs import apply_config
    from torch_budget.replay.machine import pin_to_one_core

    pin_to_one_core()
    import torch

    lib = probe_library(library)
    if config == "floor":
        install_floor(lib)
    else:
        apply_config(config)
    dev = torch.device("meta") if meta else torch.device("cuda", 0)
    empty, uint8 = torch.empty, torch.uint8
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    for size in sizes:
        for _ in range(BATCH):  # the cache grows outside the timed batches
            t = empty(size, dtype=uint8, device=dev)
            del t
        times = []
        taken = take_backs() if config.startswith("tb") else 0
        for _ in range(batches):
            t0 = time.thread_time()
            for _ in range(BATCH):
                t = empty(size, dtype=uint8, device=dev)
                del t
            times.append((time.thread_time() - t0) / BATCH * 1e6)
        print(f"ROUNDTRIP {size} {statistics.median(times):.4f}", flush=True)
        if config.startswith("tb"):
            print(f"TAKEBACK {size} {(take_backs() - taken) / (batches * BATCH):.4f}", flush=True)
    if meta:
        return
    # Without Python: torch's allocator interface from C++, then (torch_budget) the core's C ABI.
    for size in sizes:
        print(f"ALLOCATOR {size} {lib.probe_allocator_roundtrip(size, BATCH, batches):.4f}", flush=True)
    if config.startswith("tb"):
        from torch_budget import _native

        path = _native.library_path("_C").encode()
        stream = torch.cuda.current_stream()
        for size in sizes:
            us = lib.probe_core_roundtrip(path, size, BATCH, batches, stream.device.index, stream.cuda_stream)
            if us < 0:
                raise SystemExit("probe_roundtrip: torch_budget's library has no tb_malloc / tb_free")
            print(f"CORE {size} {us:.4f}", flush=True)


def child_command(config, sizes, batches, library, meta=False):
    """This script as a child timing `config`, and its environment (no torch_budget settings
    inherited: install() is given the configuration's own)."""
    cmd = [sys.executable, __file__, "--child", config, "--sizes", ",".join(map(str, sizes)), "--batches", str(batches),
           "--library", library]
    return cmd + ["--meta"] * meta, {**os.environ, **CLEAN_ENVIRONMENT}


def run_together(sizes, batches, library):
    cmds = {c: child_command(c, sizes, batches, library) for c in CONFIGS + ("floor",)}
    cmds["meta"] = child_command("native", sizes, batches, library, meta=True)
    procs = {c: subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for c, (cmd, env) in cmds.items()}
    out = {}
    for c, p in procs.items():
        text, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"probe_roundtrip: {c} failed ({p.returncode})")
        rows = [f for f in (ln.split() for ln in text.splitlines()) if len(f) == 3 and f[0] in KINDS]
        out[c] = {(f[0], int(f[1])): float(f[2]) for f in rows}
    return out


def profile(sizes, folder, library):
    if shutil.which("perf") is None:
        print("probe_roundtrip: no perf on this machine: no profiles")
        return
    os.makedirs(folder, exist_ok=True)
    for c in CONFIGS + ("floor",):
        data = os.path.join(folder, f"{c}.data")
        cmd, env = child_command(c, sizes, 100, library)
        r = subprocess.run(["perf", "record", "-F", "4000", "-o", data, "--"] + cmd, capture_output=True, text=True,
                           env=env)
        if r.returncode:
            print(f"probe_roundtrip: perf record {c} failed: {r.stderr[-400:]}")
            continue
        with open(os.path.join(folder, f"{c}.txt"), "w") as f:
            for sort in ("dso", "dso,symbol"):
                f.flush()
                subprocess.run(["perf", "report", "-i", data, "--stdio", "--percent-limit", "0.2", "--sort", sort],
                               stdout=f, stderr=subprocess.DEVNULL)
        os.remove(data)
        print(f"probe_roundtrip: profile of {c} in {folder}/{c}.txt")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,1048576,67108864")
    ap.add_argument("--batches", type=int, default=BATCHES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--perf")
    ap.add_argument("--child")
    ap.add_argument("--library", help="(children) the probe's library, built by the parent")
    ap.add_argument("--meta", action="store_true")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.child:
        child(a.child, sizes, a.batches, a.meta, a.library)
        return
    library = build_floor()
    rows = {}
    for r in range(a.rounds):
        measured_now = run_together(sizes, a.batches, library)
        for c, measured in measured_now.items():
            for (kind, size), median in measured.items():
                rows.setdefault((kind, size, c), []).append(median)
        # Each round's own ratios as it ends: a run cut short by its time limit still tells them.
        print(f"round {r + 1}/{a.rounds}: tb/native from Python " + " ".join(
            f"{size}B={measured_now['tb-vmm'][('ROUNDTRIP', size)] / measured_now['native'][('ROUNDTRIP', size)]:.3f}"
            for size in sizes), flush=True)

    def med(kind, size, c):
        return statistics.median(rows[(kind, size, c)])

    print("From Python (torch.empty + del), us per round trip:")
    print(f"{'size':>10} {'meta us':>8} {'floor us':>8} {'native us':>9} {'tb us':>7} {'tb/native':>9} "
          f"{'floor/native':>12} {'(tb-meta)/(native-meta)':>24} {'(tb-floor)/(native-floor)':>26}")
    result = []
    for size in sizes:
        m, f, n, t = (med("ROUNDTRIP", size, c) for c in ("meta", "floor", "native", "tb-vmm"))
        print(f"{size:>10} {m:8.3f} {f:8.3f} {n:9.3f} {t:7.3f} {t / n:9.3f} {f / n:12.3f} {(t - m) / (n - m):24.3f} "
              f"{(t - f) / (n - f):26.3f}")
        result.append(f"{size}B:tb={t / n:.3f}x,floor={f / n:.3f}x,taken_back={med('TAKEBACK', size, 'tb-vmm'):.2f}")
    print("Share of torch_budget's round trips from Python that took the freed block back (Note [The parked block]): "
          + ", ".join(f"{size}: {med('TAKEBACK', size, 'tb-vmm'):.3f}" for size in sizes))
    print("Without Python, us per round trip: torch's allocator interface from C++ (allocate and the "
          "deleter) under each allocator, and torch_budget's core through its C ABI:")
    print(f"{'size':>10} {'floor':>8} {'native':>8} {'tb':>8} {'tb core':>8} {'tb/native':>9} "
          f"{'native-floor':>12} {'tb-floor':>9} {'bridge':>7}")
    for i, size in enumerate(sizes):
        f, n, t = (med("ALLOCATOR", size, c) for c in ("floor", "native", "tb-vmm"))
        core = med("CORE", size, "tb-vmm")
        print(f"{size:>10} {f:8.3f} {n:8.3f} {t:8.3f} {core:8.3f} {t / n:9.3f} {n - f:12.3f} {t - f:9.3f} "
              f"{t - f - core:7.3f}")
        result[i] += f",cxx_tb={t / n:.3f}x,core_us={core:.3f},bridge_us={t - f - core:.3f}"
    print("('bridge': what torch_budget's allocator adds over the floor beside its core's C ABI round trip)")
    print("RESULT probe_roundtrip " + " ".join(result))
    if a.perf:
        profile(sizes, a.perf, library)


if __name__ == "__main__":
    main()
