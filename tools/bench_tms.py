#!/usr/bin/env python3
"""Pause and resume: the real torch_memory_saver against torch_budget's adapter, in one run.

    python tools/bench_tms.py [--gib 8] [--cycles 4] [--rounds 3]
    python tools/bench_tms.py --stage SOURCE      # copy torch_memory_saver's source into .tms_src/
    python tools/bench_tms.py --build-only        # build it there and stop (no GPU needed)

torch_memory_saver is third-party code: its source (setup.py, csrc/, the torch_memory_saver
package) is staged in .tms_src/, which git ignores (SOURCE: a checkout, or a bare git directory
whose HEAD is taken). This tool builds it there, in place (`setup.py build_ext --inplace`, for the
CUDA major of the installed torch, against the CUDA toolkit's headers), when what is there is
missing or was built for another torch, Python or toolkit, and imports it by putting .tms_src/
first on the child's PYTHONPATH. torch_budget's adapter is imported under the same name through
the shim package of tools/tms_examples.py, so both run the same workload code.

Each configuration runs in a fresh process (each replaces how torch allocates):
  - torch_budget: torch_budget.adapters.torch_memory_saver, as `torch_memory_saver`;
  - torch_memory_saver, hook_mode "torch" (torch's pluggable allocator in a MemPool);
  - the same with retain_cpu_backup = True (its host backups are kept across resume and
    reused by the next pause), when the package has that attribute;
  - with --retained, torch_budget with retain_cpu_backup = True (retained backups: a pause
    copies only what changed since the resume, here nothing).
The workload: hook_mode = "torch"; under region(tag="weights", enable_cpu_backup=True), --gib
GiB as about 66 uint8 and bf16 tensors per 8 GiB, 2 MiB to 512 MiB (seeded), filled with seeded
random contents; a checksum of every 2 MiB block of every tensor; then --cycles cycles of
pause("weights") and resume("weights"), each timed between torch.cuda.synchronize() calls, the
checksums compared after every resume. Per process: the first cycle's pause and resume in ms
(backups are allocated there), and the median GB/s (1 GB = 1e9 bytes of tensors) of the later
cycles, each way. --rounds rounds run every configuration once, in an order rotated by one
each round; the table shows medians over rounds and the median of each round's ratio
torch_budget / torch_memory_saver. The last line is `RESULT bench_tms ...`.

Exit status: 0, also when torch_memory_saver cannot be staged, built or imported (the RESULT
line says tms=unavailable and why; torch_budget is measured alone) or fails; 1 when torch_budget's
configuration fails or changes contents. Without a CUDA device it says so and exits 0.
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from tms_examples import write_shim  # noqa: E402  (the shim that names the adapter torch_memory_saver)

MiB, GiB, GB = 1 << 20, 1 << 30, 1e9
MIN_SIZE, MAX_SIZE, ALIGN = 2 * MiB, 512 * MiB, 4096
AVG_SIZE = 8 * GiB // 66
BLOCK, CHUNK = 2 * MiB, 64 * MiB  # checksum granularity; bytes reduced per kernel
TAG = "weights"
SRC = os.path.join(REPO, ".tms_src")
STAGED = ("setup.py", "LICENSE", "MANIFEST.in", "README.md", "csrc", "torch_memory_saver")
REQUIRED = ("setup.py", "csrc/core.cpp", "csrc/entrypoint.cpp", "torch_memory_saver/__init__.py",
            "torch_memory_saver/utils.py")
STEM = "torch_memory_saver_hook_mode_torch"  # the library hook_mode "torch" loads
MARK = "BENCH_TMS_CHILD "  # a child's result line: MARK + JSON
CLEARED_ENV = ("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP", "TMS_INIT_CPU_BACKUP_BACKEND", "TMS_RETAIN_CPU_BACKUP")


@dataclass(frozen=True)
class Config:
    key: str  # prefix of its figures in the RESULT line
    name: str
    real: bool  # the staged torch_memory_saver, not the adapter
    retain: bool = False


CONFIGS = (
    Config("tb", "torch_budget (adapter)", real=False),
    Config("tms", "torch_memory_saver", real=True),
    Config("tms_retain", "torch_memory_saver, retain_cpu_backup", real=True, retain=True),
)
# --retained adds torch_budget's retained backups: a pause of unchanged weights copies nothing
# (Note [Retained backups]).
TB_RETAIN = Config("tb_retain", "torch_budget (adapter), retain_cpu_backup", real=False, retain=True)


# ---------------------------------------------------------------- staging and building

def staged_problem(src: str) -> str | None:
    """Why `src` does not hold torch_memory_saver's source, or None when it does."""
    if not os.path.isdir(src):
        return (f"{src} is missing: stage torch_memory_saver's source there first "
                "(python tools/bench_tms.py --stage CHECKOUT_OR_GIT_DIR)")
    missing = [p for p in REQUIRED if not os.path.isfile(os.path.join(src, p))]
    if missing:
        return f"{src} lacks {', '.join(missing)}: stage torch_memory_saver's source again (--stage)"
    return None


def stage(source: str, src: str) -> str:
    """Copies torch_memory_saver's source (a checkout, or a bare git directory's HEAD) into `src`,
    replacing what was there; returns where it came from."""
    source = os.path.abspath(source)
    bare = not os.path.isfile(os.path.join(source, "setup.py"))
    git = ["git", f"--git-dir={source}"] if bare else ["git", "-C", source]
    rev = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = rev.stdout.strip() if rev.returncode == 0 else "unknown"
    if bare and rev.returncode != 0:
        raise SystemExit(f"bench_tms: {source} is neither a checkout (no setup.py) nor a git directory")
    if os.path.isdir(src):
        shutil.rmtree(src)
    os.makedirs(src)
    if bare:
        names = subprocess.run([*git, "ls-tree", "--name-only", "HEAD"], capture_output=True, text=True,
                               check=True).stdout.split()
        tar = subprocess.run([*git, "archive", "HEAD", *[n for n in STAGED if n in names]], capture_output=True,
                             check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            archive.extractall(src, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    else:
        for name in STAGED:
            path = os.path.join(source, name)
            if os.path.isdir(path):
                shutil.copytree(path, os.path.join(src, name), ignore=shutil.ignore_patterns("__pycache__", "*.so"))
            elif os.path.isfile(path):
                shutil.copy2(path, src)
    where = f"{source} at {commit}"
    with open(os.path.join(src, "STAGED_FROM"), "w") as f:
        f.write(where + "\n")
    return where


def cuda_home() -> str | None:
    """The CUDA toolkit the build compiles against: CUDA_HOME / CUDA_PATH, nvcc's, /usr/local/cuda;
    the first with cuda.h and a libcudart.so to link."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in filter(None, candidates):
        if (os.path.isfile(os.path.join(home, "include", "cuda.h"))
                and glob.glob(os.path.join(home, "lib64", "libcudart.so*"))):
            return home
    return None


def toolkit_major(home: str) -> int | None:
    with open(os.path.join(home, "include", "cuda.h")) as f:
        for line in f:
            if line.startswith("#define CUDA_VERSION "):
                return int(line.split()[2]) // 1000
    return None


def libcuda_folder(home: str, link_dir: str) -> tuple[str | None, str | None]:
    """(a folder to add to the linker's path or None when none is needed, the problem or None):
    setup.py links -lcuda and looks in the toolkit's lib64/stubs only; without the stubs the
    driver's libcuda.so.1 is linked through a libcuda.so link made in `link_dir`."""
    dirs = [os.path.join(home, "lib64", "stubs"), *os.environ.get("LIBRARY_PATH", "").split(os.pathsep),
            "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/lib/wsl/lib"]
    for d in filter(None, dirs):
        if os.path.exists(os.path.join(d, "libcuda.so")):
            return None, None
    ldconfig = shutil.which("ldconfig")
    known = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout if ldconfig else ""
    drivers = [os.path.join(d, "libcuda.so.1") for d in filter(None, dirs)]
    drivers += [line.split("=>")[-1].strip() for line in known.splitlines() if line.strip().startswith("libcuda.so.1 ")]
    for driver in drivers:
        if os.path.exists(driver):
            os.makedirs(link_dir, exist_ok=True)
            link = os.path.join(link_dir, "libcuda.so")
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(os.path.realpath(driver), link)
            return link_dir, None
    return None, (f"no libcuda.so to link against: neither {home}/lib64/stubs nor the driver's libcuda.so.1 "
                  "(set LIBRARY_PATH to a folder that has one)")


def built_library(src: str, major: int) -> str | None:
    found = glob.glob(os.path.join(src, f"{STEM}_cu{major}.*.so"))
    return found[0] if len(found) == 1 else None


def build(src: str, torch_version: str, cuda_major: int) -> tuple[bool, str]:
    """Builds the staged torch_memory_saver in place unless it was built for this torch, Python
    and toolkit from these sources; (built, what happened or why not)."""
    problem = staged_problem(src)
    if problem:
        return False, problem
    home = cuda_home()
    if home is None:
        return False, "no CUDA toolkit with include/cuda.h and lib64/libcudart.so (set CUDA_HOME)"
    sources = [os.path.join(src, "setup.py"), *glob.glob(os.path.join(src, "csrc", "*"))]
    stamp = {"python": sys.version, "torch": torch_version, "cuda_major": cuda_major, "cuda_home": home,
             "sources": max(os.path.getmtime(p) for p in sources)}
    stamp_path = os.path.join(src, "build", "bench_tms_stamp.json")
    library = built_library(src, cuda_major)
    if library and os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return True, f"{os.path.basename(library)} already built"
    extra, problem = libcuda_folder(home, os.path.join(src, "build", "link"))
    if problem:
        return False, problem
    for old in glob.glob(os.path.join(src, "torch_memory_saver_hook_mode_*.so")):
        os.remove(old)
    env = {**os.environ, "TMS_PLATFORM": "cuda", "TMS_CUDA_MAJOR": str(cuda_major), "CUDA_HOME": home}
    if extra:
        env["LIBRARY_PATH"] = os.pathsep.join(filter(None, [extra, os.environ.get("LIBRARY_PATH")]))
    log = os.path.join(src, "build", "bench_tms_build.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=src, env=env,
                              stdout=out, stderr=subprocess.STDOUT)
    library = built_library(src, cuda_major)
    if proc.returncode != 0 or library is None:
        with open(log) as f:
            tail = [line.rstrip() for line in f if line.strip()][-12:]
        return False, f"setup.py build_ext failed (exit {proc.returncode}; {log}):\n    " + "\n    ".join(tail)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    toolkit = toolkit_major(home)
    note = "" if toolkit in (None, cuda_major) else f"; the toolkit is CUDA {toolkit}, torch's CUDA {cuda_major}"
    return True, f"built {os.path.basename(library)} against {home} in {time.perf_counter() - start:.0f} s{note}"


# ---------------------------------------------------------------- the workload (in a child)

def tensor_plan(total: int, seed: int = 0) -> list[tuple[int, str]]:
    """(bytes, dtype) of the tensors: about one per AVG_SIZE, log-uniform sizes (4 KiB multiples)
    between MIN_SIZE and MAX_SIZE summing to `total` (a multiple of 4 KiB), uint8 or bfloat16."""
    rng = random.Random(seed)
    n = min(total // MIN_SIZE, max(round(total / AVG_SIZE), -(-total // MAX_SIZE)))
    if n < 1:
        return [(total, "uint8")]
    exps = [rng.uniform(21, 29) for _ in range(n)]
    dtypes = [rng.choice(("uint8", "bfloat16")) for _ in range(n)]

    def sizes(shift):
        return [min(MAX_SIZE, max(MIN_SIZE, int(2 ** (e + shift)) // ALIGN * ALIGN)) for e in exps]

    lo, hi = -30.0, 30.0  # the shift that makes the sizes sum to total, from below
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(sizes(mid)) <= total else (lo, mid)
    out = sizes(lo)
    left = total - sum(out)
    for i in sorted(range(n), key=lambda i: out[i]):  # the remainder on the smallest first
        add = min(left, MAX_SIZE - out[i])
        out[i] += add
        left -= add
    return list(zip(out, dtypes))


def block_sums(torch, t):
    """The int64 sums of the int32 words of each BLOCK of `t` (its last, shorter block too)."""
    words = t.view(-1).view(torch.uint8).view(torch.int32)
    per_block, per_chunk = BLOCK // 4, CHUNK // 4
    sums = []
    for start in range(0, words.numel(), per_chunk):
        chunk = words[start:start + per_chunk]
        full = chunk.numel() // per_block * per_block
        if full:
            sums.append(chunk[:full].view(-1, per_block).sum(dim=1, dtype=torch.int64))
        if full < chunk.numel():
            sums.append(chunk[full:].sum(dtype=torch.int64).view(1))
    return torch.cat(sums).cpu()


def workload(total: int, cycles: int, retain: bool, seed: int) -> dict:
    """What every configuration runs, under whichever package `torch_memory_saver` names."""
    out = {"stage": "import", "cycles": []}
    try:
        import torch
        import torch_memory_saver as package
        from torch_memory_saver import torch_memory_saver as saver

        out["module"] = package.__file__
        saver.hook_mode = "torch"
        if not hasattr(type(saver), "retain_cpu_backup"):
            if retain:
                return {**out, "stage": "unavailable", "error": "this torch_memory_saver has no retain_cpu_backup"}
        else:
            saver.retain_cpu_backup = retain  # initialises the package, the library loaded
            out["retain_cpu_backup"] = bool(saver.retain_cpu_backup)

        out["stage"] = "allocate"
        plan = tensor_plan(total, seed)
        free, _ = torch.cuda.mem_get_info()
        if free < total + GiB:
            return {**out, "error": f"{total / GiB:.1f} GiB + 1 GiB of device memory needed, {free / GiB:.1f} free"}
        with saver.region(tag=TAG, enable_cpu_backup=True):
            tensors = [torch.empty(size // (2 if dtype == "bfloat16" else 1), dtype=getattr(torch, dtype),
                                   device="cuda") for size, dtype in plan]
        for i, t in enumerate(tensors):
            gen = torch.Generator(device="cuda").manual_seed(seed + i)
            if t.is_floating_point():
                t.normal_(generator=gen)
            else:
                t.random_(generator=gen)
        reference = [block_sums(torch, t) for t in tensors]
        out.update(tensors=len(tensors), bytes=sum(t.nbytes for t in tensors))

        for c in range(cycles):
            out["stage"] = f"cycle {c + 1}"
            torch.cuda.synchronize()
            before = torch.cuda.mem_get_info()[0]
            start = time.perf_counter()
            saver.pause(TAG)
            torch.cuda.synchronize()
            pause_s = time.perf_counter() - start
            freed = torch.cuda.mem_get_info()[0] - before
            start = time.perf_counter()
            saver.resume(TAG)
            torch.cuda.synchronize()
            resume_s = time.perf_counter() - start
            out["cycles"].append({"pause_s": pause_s, "resume_s": resume_s, "freed_bytes": freed})
            bad = [i for i, t in enumerate(tensors) if not torch.equal(block_sums(torch, t), reference[i])]
            if bad:
                return {**out, "stage": "contents", "error": f"after resume {c + 1}, tensors {bad[:8]} of "
                        f"{len(tensors)} differ from before the first pause"}
        out["stage"] = "done"
    except BaseException as e:  # reported to the parent, which says which configuration and where
        out["error"] = f"{type(e).__name__}: {e}".strip()[:600]
    return out


def child_main(spec: str) -> None:
    args = json.loads(spec)
    result = workload(args["total"], args["cycles"], args["retain"], args["seed"])
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    # Teardown is not measured; a package whose exit path breaks would otherwise hide the figures.
    os._exit(0)


# ---------------------------------------------------------------- the parent

def round_order(configs, r: int):
    """Round r's order: every configuration, rotated by r."""
    k = r % len(configs)
    return list(configs[k:]) + list(configs[:k])


def figures(result: dict) -> dict:
    """One process's figures: its first cycle in ms, the median GB/s of its later cycles."""
    cycles, total = result["cycles"], result["bytes"]
    later = cycles[1:]
    return {
        "first_pause_ms": cycles[0]["pause_s"] * 1e3,
        "first_resume_ms": cycles[0]["resume_s"] * 1e3,
        "pause_gbps": statistics.median(total / c["pause_s"] / GB for c in later),
        "resume_gbps": statistics.median(total / c["resume_s"] / GB for c in later),
        "freed_gib": cycles[0]["freed_bytes"] / GiB,
    }


KEYS = ("first_pause_ms", "first_resume_ms", "pause_gbps", "resume_gbps", "freed_gib")


def summarize(rounds: list[dict], base: str = "tb") -> tuple[dict, dict]:
    """(medians over rounds per configuration key, {other key: median of the per-round ratios
    base / other, per figure}), from each round's {key: figures} (a failed process is absent)."""
    keys = list(dict.fromkeys(k for r in rounds for k in r))
    medians = {k: {f: statistics.median(r[k][f] for r in rounds if k in r) for f in KEYS} for k in keys}
    ratios = {}
    for other in keys:
        paired = [r for r in rounds if base in r and other in r]
        if other == base or not paired:
            continue
        ratios[other] = {f: statistics.median(r[base][f] / r[other][f] for r in paired) for f in KEYS[:4]}
    return medians, ratios


def result_line(medians: dict, ratios: dict, tms: str, why: str | None, extra: dict) -> str:
    """`RESULT bench_tms ...`: each configuration's four figures, the ratios to torch_memory_saver,
    and tms=ran|unavailable|failed (with why= when it did not run)."""
    parts = {**extra}
    for key, m in medians.items():
        parts.update({f"{key}_{f}": f"{m[f]:.2f}" for f in KEYS[:4]})
    for other, r in ratios.items():
        parts.update({f"tb_over_{other}_{f}": f"{r[f]:.2f}" for f in ("pause_gbps", "resume_gbps")})
    parts["tms"] = tms
    if why:
        parts["why"] = why
    return "RESULT bench_tms " + " ".join(f"{k}={v}" for k, v in parts.items())


def child_env(config: Config, shim: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    preload = [p for p in env.pop("LD_PRELOAD", "").split(":") if p and "torch_memory_saver" not in p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    first = [SRC] if config.real else [shim, REPO]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*first, os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(config: Config, shim: str, total: int, cycles: int, seed: int, timeout: float) -> dict:
    spec = json.dumps({"total": total, "cycles": cycles, "retain": config.retain, "seed": seed})
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec], cwd=REPO,
                              env=child_env(config, shim), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"stage": "timeout", "error": f"no result after {timeout:.0f} s", "cycles": []}
    lines = [line[len(MARK):] for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        said = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        last = said[-1] if said else ""
        return {"stage": "crashed", "error": f"exit {proc.returncode} without a result: {last}"[:600], "cycles": []}
    result = json.loads(lines[-1])
    expected = SRC if config.real else shim
    module = result.get("module")
    if module and not os.path.realpath(module).startswith(os.path.realpath(expected) + os.sep):
        result.update(stage="import", error=f"torch_memory_saver came from {module}, not from {expected}")
    return result


def fmt_round(config: Config, f: dict) -> str:
    return (f"  {config.name:40} first pause {f['first_pause_ms']:8.1f} ms, resume {f['first_resume_ms']:8.1f} ms; "
            f"later pause {f['pause_gbps']:6.1f} GB/s, resume {f['resume_gbps']:6.1f} GB/s; "
            f"freed {f['freed_gib']:.2f} GiB")


def print_table(configs, medians: dict, ratios: dict, rounds: int) -> None:
    print(f"\nmedians of {rounds} round(s)")
    print(f"{'configuration':42} {'first pause ms':>15} {'first resume ms':>16} {'pause GB/s':>11} "
          f"{'resume GB/s':>12} {'freed GiB':>10}")
    for c in configs:
        if c.key in medians:
            m = medians[c.key]
            print(f"{c.name:42} {m['first_pause_ms']:15.1f} {m['first_resume_ms']:16.1f} {m['pause_gbps']:11.1f} "
                  f"{m['resume_gbps']:12.1f} {m['freed_gib']:10.2f}")
    for c in configs:
        if c.key in ratios:
            r = ratios[c.key]
            print(f"{'torch_budget / ' + c.name:42} {r['first_pause_ms']:14.2f}x {r['first_resume_ms']:15.2f}x "
                  f"{r['pause_gbps']:10.2f}x {r['resume_gbps']:11.2f}x")
    if ratios:
        print("(ratios: medians of each round's paired ratio; ms below 1x and GB/s above 1x favour torch_budget)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/bench_tms.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="GiB of tensors under the tag (default 8)")
    ap.add_argument("--cycles", type=int, default=4, help="pause/resume cycles per process (default 4; >= 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each running every configuration (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retained", action="store_true", help="also torch_budget with retain_cpu_backup = True")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one process may take (default 300)")
    ap.add_argument("--stage", metavar="SOURCE", help="copy torch_memory_saver's source (a checkout or a bare "
                    "git directory) into .tms_src/, then go on")
    ap.add_argument("--build-only", action="store_true", help="build the staged torch_memory_saver and stop")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child_main(args.child)
    if args.gib <= 0 or args.cycles < 2 or args.rounds < 1:
        ap.error("--gib must be positive, --cycles at least 2 and --rounds at least 1")
    if args.stage:
        print(f"bench_tms: staged torch_memory_saver from {stage(args.stage, SRC)} in {SRC}")

    from _bench import cuda_torch, pin_near_gpu

    pin_near_gpu()  # the children inherit it: host backups land beside the GPU
    if args.build_only:
        import torch

        if not torch.version.cuda:
            print("bench_tms: this torch has no CUDA version to build torch_memory_saver for")
            return 1
        ok, said = build(SRC, torch.__version__, int(torch.version.cuda.split(".")[0]))
        print(f"bench_tms: torch_memory_saver {'ready' if ok else 'not built'}: {said}")
        return 0 if ok else 1
    torch = cuda_torch("bench_tms", "pause and resume of GPU memory")
    if torch is None:
        return 0

    total = max(int(args.gib * GiB) // ALIGN * ALIGN, MIN_SIZE)
    plan = tensor_plan(total, args.seed)
    sizes = [s for s, _ in plan]
    print(f"bench_tms: {len(plan)} tensors of {min(sizes) / MiB:.0f} to {max(sizes) / MiB:.0f} "
          f"MiB ({sum(d == 'bfloat16' for _, d in plan)} bf16), {total / GiB:.2f} GiB under tag {TAG!r}; "
          f"{args.cycles} cycles per process, {args.rounds} rounds")
    all_configs = list(CONFIGS) + ([TB_RETAIN] if args.retained else [])
    ok, said = build(SRC, torch.__version__, int(torch.version.cuda.split(".")[0]))
    tms, tms_why = "ran", None
    if ok:
        origin = "unrecorded"
        if os.path.isfile(os.path.join(SRC, "STAGED_FROM")):
            with open(os.path.join(SRC, "STAGED_FROM")) as f:
                origin = f.read().strip()
        print(f"bench_tms: torch_memory_saver from {SRC} (staged from {origin}): {said}")
        configs = list(all_configs)
    else:
        tms, tms_why = "unavailable", "not_staged" if staged_problem(SRC) else "build_failed"
        print(f"bench_tms: torch_memory_saver unavailable, torch_budget measured alone: {said}")
        configs = [c for c in all_configs if not c.real]

    per_round, failures = [], {}
    with tempfile.TemporaryDirectory(prefix="tms-shim-") as tmp:
        shim = write_shim(tmp)
        for r in range(args.rounds):
            print(f"round {r + 1}:")
            figs = {}
            for config in round_order(configs, r):
                if config not in configs:  # dropped earlier in this round
                    continue
                result = run_child(config, shim, total, args.cycles, args.seed, args.timeout)
                if result.get("stage") == "done":
                    figs[config.key] = figures(result)
                    print(fmt_round(config, figs[config.key]), flush=True)
                    continue
                why = f"{result.get('stage')}: {result.get('error')}"
                print(f"  {config.name:40} FAILED ({why})", flush=True)
                failures.setdefault(config.key, why)
                if config.real and result.get("stage") in ("import", "unavailable"):
                    # Not a figure of this round: the package (or this option) cannot run here at all.
                    gone = [c for c in configs if c.real] if result["stage"] == "import" else [config]
                    configs = [c for c in configs if c not in gone]
                    if result["stage"] == "import":
                        tms, tms_why = "unavailable", "import_failed"
            per_round.append(figs)
    rounds = [r for r in per_round if r]
    if not rounds:
        print("bench_tms: no configuration produced figures")
        print("RESULT bench_tms failed=" + ",".join(failures))
        return 1
    medians, ratios = summarize(rounds)
    print_table(all_configs, medians, ratios, len(rounds))
    for key, why in failures.items():
        print(f"{key} failed in at least one round: {why}")
    if tms == "ran" and any(k.startswith("tms") for k in failures) and not any(k.startswith("tms") for k in medians):
        tms, tms_why = "failed", failures.get("tms", failures.get("tms_retain", "")).split(":")[0]
    extra = {"gib": f"{total / GiB:.2f}", "tensors": len(plan), "rounds": len(rounds), "cycles": args.cycles}
    if "tb" in failures:
        extra["tb"] = "failed"
    print(result_line(medians, ratios, tms, tms_why, extra))
    return 1 if "tb" in failures else 0


if __name__ == "__main__":
    sys.exit(main())
