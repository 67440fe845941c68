"""The long run of the host stand-in's random programs (tests/test_core_vmm_fuzz.py, and
tests/test_core_pool_fuzz.py's as the `pools` configuration): many seeds
of every configuration, optionally over the AddressSanitizer build of the core, each program in
its own process, with progress and a table at the end. No GPU: this reaches the error paths the
driver seldom takes (injected failures of five VMM entry points, budgets, tag release / restore
with retained backups, sharing; private pools, their checkpoints and options); tools/fuzz_gpu.py is
its counterpart on a device.

    python tools/fuzz_host.py [--seeds 100] [--ops 10000] [--configs moves,budget,...]
                              [--asan] [--jobs 2] [--first-seed 1000]

Every program checks, every 50 operations, that the ledger equals what the stand-in holds, that
the budget holds and that every live granule reads back its stamp, and at its end that nothing
leaked. A failing program prints its configuration, seed and the child's traceback; the exit
status is 1 then (86 / 87 from the sanitizers show as failures too).

Needs the host core: TORCH_BUDGET_BUILD=_host_core (and _host_core_asan for --asan).
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
if {config!r} == "pools":
    from test_core_pool_fuzz import Program
    program = Program({seed}, library={library!r})
else:
    from test_core_vmm_fuzz import CONFIGS, Program
    program = Program({seed}, library={library!r}, **CONFIGS[{config!r}])
t0 = time.perf_counter()
for step in range({ops}):
    program.step()
    if step % 50 == 0:
        program.check(step)
moves = program.finish()
print("RESULT " + json.dumps({{"moves": moves, "seconds": time.perf_counter() - t0}}))
"""


def asan_env():
    out = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = out.stdout.strip()
    if out.returncode or not os.path.isabs(path) or not os.path.exists(path):
        sys.exit("fuzz_host: --asan needs the AddressSanitizer runtime (g++ -print-file-name=libasan.so found none)")
    return dict(os.environ, LD_PRELOAD=path, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86",
                UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87")


def one(config, seed, ops, library, env):
    code = CHILD.format(root=ROOT, tests=TESTS, seed=seed, library=library, config=config, ops=ops)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    result = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")), None)
    if p.returncode or result is None:
        return config, seed, None, f"exit status {p.returncode}\n{p.stdout[-4000:]}{p.stderr[-8000:]}"
    return config, seed, result, None


def main(argv=None):
    from test_core_vmm_fuzz import CONFIGS as VMM_CONFIGS

    CONFIGS = [*VMM_CONFIGS, "pools"]

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=100, help="programs per configuration")
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--ops", type=int, default=10000, help="operations per program")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--asan", action="store_true", help="over _host_core_asan, with the sanitizer runtime preloaded")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or args.seeds < 1 or args.ops < 1 or args.jobs < 1:
        ap.error(f"unknown configuration(s) {unknown}; known: {sorted(CONFIGS)}" if unknown
                 else "--seeds, --ops and --jobs must be at least 1")
    library = "_host_core_asan" if args.asan else "_host_core"
    env = asan_env() if args.asan else dict(os.environ)
    jobs = [(c, args.first_seed + i) for i in range(args.seeds) for c in configs]
    done = {c: [] for c in configs}
    failures = []
    t0 = time.perf_counter()
    print(f"fuzz_host: {len(jobs)} programs x {args.ops} operations over {library}, {args.jobs} at a time", flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(one, c, s, args.ops, library, env) for c, s in jobs]
        for n, f in enumerate(concurrent.futures.as_completed(futures), 1):
            config, seed, result, error = f.result()
            if error:
                failures.append((config, seed, error))
                print(f"FAILED {config} seed {seed}: {error}", flush=True)
            else:
                done[config].append(result)
            if n % max(1, len(jobs) // 20) == 0 or n == len(jobs):
                print(f"  {n}/{len(jobs)} programs, {len(failures)} failed, {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n{'configuration':28} {'programs':>8} {'operations':>11} {'moves':>8} {'failed':>6}")
    for c in configs:
        fails = sum(1 for f in failures if f[0] == c)
        print(f"{c:28} {len(done[c]):8d} {len(done[c]) * args.ops:11d} {sum(r['moves'] for r in done[c]):8d} {fails:6d}")
    total = sum(len(v) for v in done.values()) * args.ops
    print(f"RESULT fuzz_host library={library} programs={len(jobs)} operations={total} failed={len(failures)} "
          f"seconds={time.perf_counter() - t0:.0f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, TESTS)
    sys.exit(main())
