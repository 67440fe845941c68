"""What one allocation round trip costs the core, without a GPU: instructions, and the cache lines
it touches when it starts with cold caches (as it does when Python calls it between much other
work). The core of this working tree (or of --source, another checkout) is built over the host
stand-in as a shared library, as its parts are built (-O3, calls inside it bound locally), with a
harness that calls it as the torch bridge does (`Allocator::malloc`, then `free_at`); cachegrind
counts, per round trip:
  warm  the instructions, caches left as they are;
  cold  the first-level lines missed when 128 KiB of data and 40 KiB of code run between round
        trips (the instruction lines stand for code spread over the path, the data lines for
        the state it touches: ledger, pools, blocks).
The simulated caches are a server core's, whatever machine runs the tool (CACHES): cachegrind
otherwise takes the host's, and where its first-level instruction cache holds 64 KiB, the 40 KiB
of code between round trips evicts nothing and every round trip reads 0 instruction lines.
Needs g++ and valgrind; the CUDA headers only (the stand-in replaces the driver).

    python tools/probe_footprint.py [--sizes 4096,67108864] [--source DIR] [--iterations 20000]
"""
import argparse
import concurrent.futures
import glob
import os
import runpy
import shutil
import subprocess
import sys
import sysconfig
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "core/allocator.h"
#include "core/block_cache.h"
extern "C" int tb_host_use(int, int64_t, int, int, int64_t);
extern "C" int tb_configure(int64_t, double, int, int, int64_t);
// About 40 KiB of code (five-byte no-ops): run between round trips, it evicts the core's code.
__attribute__((noinline)) void evict_code() { asm volatile(".rept 8192\n .byte 0x0f,0x1f,0x44,0x00,0x00\n .endr"); }
int main(int argc, char** argv) {
  const size_t size = strtoull(argv[1], nullptr, 0);
  const long n = atol(argv[2]);
  const bool cold = atoi(argv[3]) != 0;
  if (tb_host_use(1, int64_t(80) << 30, 1, 1, 0) != 0 || tb_configure(-1, -1.0, 0, 1, 0) != 0) return 2;
  std::vector<char> data(128 << 10);
  tb::Allocator& a = tb::Allocator::get();
  CUstream stream = reinterpret_cast<CUstream>(0x1000);
  for (int i = 0; i < 1000; ++i) a.free_at(0, a.malloc(size, 0, stream)->ptr);  // the cache grows first
  for (long i = 0; i < n; ++i) {
    tb::Block* b = a.malloc(size, 0, stream);
    if (b == nullptr) return 3;
    a.free_at(0, b->ptr);
    if (cold) {
      for (size_t j = 0; j < data.size(); j += 64) data[j]++;
      evict_code();
    }
  }
  return 0;
}
"""

FLAGS = ["-std=c++17", "-O3", "-fPIC", "-fno-semantic-interposition", "-Wno-unused-function"]
# First level: 32 KiB of instructions (8-way) and 48 KiB of data (12-way), 64-byte lines, as on the
# GPU machines' server cores; a last level of 32 MiB, which the evictors never fill.
CACHES = ["--I1=32768,8,64", "--D1=49152,12,64", "--LL=33554432,16,64"]
SKIPPED = ("main", "evict_code", "_dl", "dl-")  # the harness and the loader, not the core


def cuda_includes():
    """The CUDA header directories, found as setup.py finds them for the build (CUDA_HOME, else the
    CUDA wheels of this environment, else a system toolkit)."""
    # setup.py run under another name than __main__: its functions, without running setup()
    setup = runpy.run_path(os.path.join(REPO, "setup.py"), run_name="tb_setup")
    dirs = setup["cuda_include_dirs"](os.environ.get("CUDA_HOME"), sysconfig.get_paths()["purelib"])
    if not dirs:
        raise SystemExit("probe_footprint: no CUDA headers (cuda.h): set CUDA_HOME")
    return dirs


def build(source, folder):
    """The core of `source` as folder/libcore.so and the harness as folder/roundtrip."""
    inc = ["-I" + os.path.join(source, "csrc")] + ["-I" + d for d in cuda_includes()]
    units = sorted(glob.glob(os.path.join(source, "csrc", "core", "*.cpp")))
    units += [os.path.join(source, "csrc", "tb_capi.cpp"), os.path.join(source, "csrc", "testing", "host_driver.cpp")]

    def compile_one(unit):
        obj = os.path.join(folder, os.path.basename(unit) + ".o")
        r = subprocess.run(["g++", *FLAGS, *inc, "-c", unit, "-o", obj], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"probe_footprint: {unit} did not compile:\n{r.stderr[-2000:]}")
        return obj

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        objs = list(pool.map(compile_one, units))
    lib = os.path.join(folder, "libcore.so")
    subprocess.run(["g++", "-shared", "-Wl,-Bsymbolic", "-o", lib, *objs, "-ldl", "-lpthread"], check=True)
    harness = os.path.join(folder, "roundtrip.cpp")
    with open(harness, "w") as f:
        f.write(HARNESS)
    exe = os.path.join(folder, "roundtrip")
    subprocess.run(["g++", *FLAGS[:2], *inc, harness, "-L" + folder, "-lcore", "-Wl,-rpath," + folder, "-o", exe],
                   check=True)
    return exe


def totals(path):
    """Events of a cachegrind output file summed over every function but the harness's and the
    loader's: {event: count}."""
    events, sums, fn = None, {}, None
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("fn="):
                fn = line[3:].strip()
            elif events and fn and line[:1].isdigit():
                if any(s in fn for s in SKIPPED):
                    continue
                for name, value in zip(events, line.split()[1:]):
                    sums[name] = sums.get(name, 0) + int(value)
    if events is None:
        raise ValueError(f"{path}: not a cachegrind output file")
    return {name: sums.get(name, 0) for name in events}


def counted(exe, size, iterations, cold, folder):
    data = os.path.join(folder, f"cg.{size}.{iterations}.{cold}")
    r = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=yes", *CACHES, f"--cachegrind-out-file={data}",
                        exe, str(size), str(iterations), str(cold)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"probe_footprint: the round trip of {size} bytes failed ({r.returncode}):\n"
                         f"{r.stderr[-2000:]}")
    return totals(data)


def measure(exe, size, iterations, folder):
    """(warm instructions, cold instruction lines missed, cold data lines missed) per round trip:
    a run of `iterations` round trips less a run of none (start-up and the cache's growth)."""
    per = {}
    for cold in (0, 1):
        full, none = (counted(exe, size, n, cold, folder) for n in (iterations, 0))
        per[cold] = {k: (full[k] - none[k]) / iterations for k in full}
    return per[0]["Ir"], per[1]["I1mr"], per[1]["D1mr"] + per[1]["D1mw"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,67108864")
    ap.add_argument("--source", default=REPO, help="the checkout whose core is measured")
    ap.add_argument("--iterations", type=int, default=20000)
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    for tool in ("g++", "valgrind"):
        if shutil.which(tool) is None:
            raise SystemExit(f"probe_footprint: needs {tool}")
    folder = tempfile.mkdtemp(prefix="tb_footprint_")
    try:
        exe = build(os.path.abspath(a.source), folder)
        print(f"{'size':>10} {'warm: instructions':>19} {'cold: instruction lines':>24} {'cold: data lines':>17}")
        result = []
        for size in sizes:
            ins, ilines, dlines = measure(exe, size, a.iterations, folder)
            print(f"{size:>10} {ins:19.0f} {ilines:24.1f} {dlines:17.1f}")
            result.append(f"{size}B:ins={ins:.0f},ilines={ilines:.1f},dlines={dlines:.1f}")
        print("RESULT probe_footprint " + " ".join(result))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
