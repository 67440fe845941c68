#!/usr/bin/env python3
"""PyTorch's own allocator tests (test/test_cuda.py), run natively, then under torch_budget.install().

Selection, unless -k EXPR replaces it: collect the file, keep the node ids whose class and test name match
  TestBlockStateAbsorption, TestMemPool  every test
  TestCudaMallocAsync                     name ~ snapshot|plot|oom|history
  TestCuda                                name ~ memory|oom|fraction|allocat|record_stream|empty_cache|
                                          mem_get_info|snapshot|history|graph|pool|checkpoint,
                                          except name ~ pinned|host|accessing|backwards (host allocator,
                                          not memory tests)
Each pass runs the selection twice: torch's @serialTest tests (mark `serial`) alone, the rest with -n WORKERS
(pytest-xdist); --timeout per test (pytest-timeout) and an empty pytest.ini (the repo's pyproject makes warnings
errors). The installed pass puts OUT/site first on PYTHONPATH: its sitecustomize.py chains to the sitecustomize
it shadows, if any, then calls torch_budget.install() when TORCH_BUDGET_AUTO_INSTALL=1, so pytest, its workers
and the subprocesses test_cuda.py starts with sys.executable are all installed before anything touches CUDA.
Outcomes come from --junitxml. Always exits 0: it is a report (full list in OUT/torch_tests.txt).

A test that passes natively and fails installed in the parallel part may only fail after what its worker ran
before it (torch's tests leave graphs, pools and generator states behind). Each such test is run again, in
one process per allocator: alone (one process at a time), and after exactly the tests its worker ran before
it, in that order (read from pytest's verbose log). Failing natively in that same order makes it an order-dependent test of torch's
suite, reported as such; the serial part already runs in one order for both allocators. A test that fails
natively in the suite is run alone, natively and installed (a few processes at a time): where it passes
natively alone, it joins the comparison.

From the repo root on a GPU machine, after the build:
  python3 tools/torch_allocator_tests.py --out /tmp/torch_tests [--workers 8] [--timeout 120] [-k EXPR]
  python3 tools/torch_allocator_tests.py --out /tmp/torch_tests --collect-only   # just the selection
"""
import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import traceback
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULES = {  # class: (keep when the test name matches, then drop when it matches this)
    "TestBlockStateAbsorption": ("", None),
    "TestMemPool": ("", None),
    "TestCudaMallocAsync": ("snapshot|plot|oom|history", None),
    "TestCuda": ("memory|oom|fraction|allocat|record_stream|empty_cache|mem_get_info|snapshot|history|graph|pool"
                 "|checkpoint", "pinned|host|accessing|backwards"),
}
SITE = """# Written by tools/torch_allocator_tests.py: chain to the sitecustomize this one shadows, then
# install torch_budget before anything in this process can touch CUDA.
import os, sys
_previous = {previous!r}
if _previous:
    import importlib.util
    _spec = importlib.util.spec_from_file_location("_chained_sitecustomize", _previous)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _module
    _spec.loader.exec_module(_module)
if os.environ.get("TORCH_BUDGET_AUTO_INSTALL") == "1":
    import torch_budget
    torch_budget.install()
"""


def existing_sitecustomize(site_dir):
    module = sys.modules.get("sitecustomize")
    path = getattr(module, "__file__", None)
    if path is None:
        spec = importlib.util.find_spec("sitecustomize")
        path = spec.origin if spec is not None and spec.has_location else None
    if path is None or os.path.dirname(os.path.abspath(path)) == os.path.abspath(site_dir):
        return None
    return os.path.abspath(path)


def chosen(node_id):
    parts = node_id.split("::")
    if len(parts) != 3 or parts[1] not in RULES:
        return False
    keep, drop = RULES[parts[1]]
    return bool(re.search(keep, parts[2], re.I)) and not (drop and re.search(drop, parts[2], re.I))


def run(cmd, env, log, limit):
    """Runs cmd in its own session; past `limit` s it gets SIGINT (pytest still writes its junit), then SIGKILL."""
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                return proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait()


def outcomes(paths):
    """{"Class::test": (status, first line of the failure)} from junit files; failed beats skipped beats passed."""
    found = {}
    for path in paths:
        try:
            cases = ET.parse(path).iter("testcase")
        except (OSError, ET.ParseError):
            continue
        for case in cases:
            key = case.get("classname", "").rsplit(".", 1)[-1] + "::" + case.get("name", "")
            bad = [e for e in case if e.tag in ("failure", "error")] or [e for e in case if e.tag == "skipped"]
            if not bad:
                found[key] = ("passed", "")
                continue
            lines = [l.strip() for l in (bad[0].get("message") or bad[0].text or "").splitlines()]
            found[key] = ("skipped" if bad[0].tag == "skipped" else "failed", next((l for l in lines if l), "")[:300])
    return found


VERBOSE_LINE = re.compile(r"^\[(gw\d+)\] \[\s*\d+%\] [A-Z]+ (\S+::\S+)")


def worker_orders(log):
    """{node id: the node ids its xdist worker ran before it, in order} from a `pytest -v -n N` log."""
    runs, before = {}, {}
    try:
        with open(log) as f:
            for line in f:
                m = VERBOSE_LINE.match(line)
                if m:
                    seq = runs.setdefault(m.group(1), [])
                    before[m.group(2)] = list(seq)
                    seq.append(m.group(2))
    except OSError:
        pass
    return before


def recheck(regressions, by_key, log, alone, replay):
    """Runs each regression of the parallel part again: alone, then after what its worker ran before it
    (one replay per worker, through its last regression), natively and installed. by_key: {"Class::test":
    node id}. Returns report lines."""
    before = worker_orders(log)
    sequences = {}
    for k in regressions:
        node = by_key[k]
        if node in before:  # a parallel-part test: keep the longest prefix per worker
            seq = before[node] + [node]
            if len(seq) > len(sequences.get(seq[0], [])):
                sequences[seq[0]] = seq
    single = alone([by_key[k] for k in regressions], at_once=1)  # one at a time: nothing else on the device
    ordered = {"native": {}, "installed": {}}
    for seq in sequences.values():
        for name in ordered:
            ordered[name].update(replay(name, seq))
    lines = ["rechecked in one process per allocator (alone | after its worker's earlier tests, in order):"]
    for k in regressions:
        a = "/".join(single[n].get(k, ("not run", ""))[0] for n in ("native", "installed"))
        node = by_key[k]
        if node not in before:
            lines.append(f"  {k}: alone native/installed {a}; serial part: same order both ways")
            continue
        o = "/".join(ordered[n].get(k, ("not run", ""))[0] for n in ("native", "installed"))
        verdict = ("order-dependent in torch's suite: fails natively in the same order"
                   if ordered["native"].get(k, ("",))[0] == "failed" else
                   "REGRESSION" if ordered["installed"].get(k, ("",))[0] != "passed" or
                   single["installed"].get(k, ("",))[0] != "passed" else "passes both ways when rerun")
        lines.append(f"  {k}: alone native/installed {a}; after {len(before[node])} earlier tests of its worker "
                     f"native/installed {o} -> {verdict}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", default=".torch_tests/test_cuda.py")
    ap.add_argument("--out", required=True, help="folder for logs, junit xml and torch_tests.txt")
    ap.add_argument("--workers", type=int, default=8, help="pytest-xdist -n for the non-serial tests")
    ap.add_argument("-k", dest="k", default=None, help="pytest -k expression replacing the built-in selection")
    ap.add_argument("--timeout", type=int, default=120, help="per-test limit in s (pytest-timeout)")
    ap.add_argument("--run-timeout", type=int, default=900, help="limit in s for each pytest invocation")
    ap.add_argument("--collect-only", action="store_true", help="print the selection and stop")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    site_dir = os.path.join(out, "site")
    os.makedirs(site_dir, exist_ok=True)
    tests = os.path.relpath(os.path.abspath(args.tests), ROOT)
    ini = os.path.join(out, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\nmarkers =\n    serial: torch's @serialTest, run alone\n")
    base = [sys.executable, "-m", "pytest", "-c", ini, "--rootdir", ROOT, "-p", "no:cacheprovider"]
    old_path = os.environ.get("PYTHONPATH")
    native_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, old_path])))
    native_env.pop("TORCH_BUDGET_AUTO_INSTALL", None)

    listing = subprocess.run(base + ["--collect-only", "-q", tests] + (["-k", args.k] if args.k else []), cwd=ROOT,
                             env=native_env, capture_output=True, text=True, timeout=600)
    collected = [l.strip() for l in listing.stdout.splitlines() if "::" in l and not l.startswith(" ")]
    ids = collected if args.k else [n for n in collected if chosen(n)]
    with open(os.path.join(out, "selected.txt"), "w") as f:
        f.write("".join(n + "\n" for n in ids))
    print(f"collected {len(collected)} tests in {tests}, selected {len(ids)} (list: {out}/selected.txt)")
    if not ids:
        print((listing.stdout + listing.stderr)[-3000:])
        print("torch_tests native_pass=0 installed_pass=0 regressions=0 error=nothing_selected")
        return
    if args.collect_only:
        print("".join(f"  {n}\n" for n in ids), end="")
        return

    opts = ["-v", "-rfE"] + (["--timeout", str(args.timeout)] if importlib.util.find_spec("pytest_timeout") else [])
    parallel = ["-n", str(args.workers)] if args.workers > 1 and importlib.util.find_spec("xdist") else []

    def run_pass(name, env):
        junits = []
        for part, marker, extra in (("serial", "serial", []), ("parallel", "not serial", parallel)):
            junits.append(os.path.join(out, f"{name}_{part}.xml"))
            log = os.path.join(out, f"{name}_{part}.log")
            rc = run(base + opts + extra + ["-m", marker, "--junitxml", junits[-1]] + ids, env, log, args.run_timeout)
            print(f"{name} {part}: pytest rc={rc}, log {log}")
        return outcomes(junits)

    native = run_pass("native", native_env)
    previous = existing_sitecustomize(site_dir)
    print(f"sitecustomize: chaining to {previous}" if previous else "sitecustomize: none to chain to")
    with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
        f.write(SITE.format(previous=previous))
    installed_env = dict(native_env, TORCH_BUDGET_AUTO_INSTALL="1",
                         PYTHONPATH=os.pathsep.join(filter(None, [site_dir, ROOT, old_path])))
    probe = subprocess.run([sys.executable, "-c", "import sys, torch_budget; sys.exit(0 if torch_budget.installed() else 3)"],
                           cwd=ROOT, env=installed_env, capture_output=True, text=True, timeout=300)
    installed, note = (run_pass("installed", installed_env), "") if probe.returncode == 0 else ({}, " error=install")
    if note:
        print(f"installed pass not run: a fresh process did not get torch_budget installed (rc={probe.returncode}):\n"
              + probe.stderr[-2000:])

    envs = {"native": native_env, "installed": installed_env}

    def in_one_process(allocator, node_ids, stem):
        """Outcomes of node_ids run in this order in one fresh pytest process (log and junit: OUT/stem.*)."""
        junit = os.path.join(out, stem + ".xml")
        if os.path.exists(junit):
            os.remove(junit)
        run(base + opts + ["-p", "no:xdist", "--junitxml", junit] + node_ids, envs[allocator],
            os.path.join(out, stem + ".log"), args.run_timeout)
        return outcomes([junit])

    def replay(allocator, node_ids):
        return in_one_process(allocator, node_ids, f"replay_{allocator}")

    def alone(node_ids, at_once=4):
        """{"native": outcomes, "installed": outcomes} of each node id run alone in a fresh pytest process,
        at_once processes at a time; logs and junit files under OUT/alone/."""
        os.makedirs(os.path.join(out, "alone"), exist_ok=True)
        jobs = [(allocator, node) for node in node_ids for allocator in ("native", "installed")]
        found = {"native": {}, "installed": {}}
        with ThreadPoolExecutor(at_once) as pool:
            results = pool.map(lambda job: in_one_process(job[0], [job[1]], os.path.join(
                "alone", job[0] + "_" + "_".join(job[1].split("::")[1:]))), jobs)
            for (allocator, _), res in zip(jobs, results):
                found[allocator].update(res)
        return found

    by_key = {"::".join(n.split("::")[1:]): n for n in ids}
    keys = list(by_key)
    status = {k: (native.get(k, ("not run", ""))[0], installed.get(k, ("not run", ""))) for k in keys}
    count = {s: sum(1 for k in keys if status[k][0] == s) for s in ("passed", "failed", "skipped", "not run")}
    native_pass = [k for k in keys if status[k][0] == "passed"]
    regressions = [k for k in native_pass if status[k][1][0] != "passed"]
    lines = [f"{k}: {status[k][1][0].upper()}: {status[k][1][1]}" for k in regressions]
    if regressions and installed:
        lines += recheck(regressions, by_key, os.path.join(out, "installed_parallel.log"), alone, replay)
    # A test that fails natively in the suite may fail only after what ran before it: alone, it can
    # still be compared.
    native_failed = [k for k in keys if status[k][0] == "failed"]
    single = alone([by_key[k] for k in native_failed]) if native_failed and installed else {}
    alone_pass = [k for k in native_failed if single and single["native"].get(k, ("",))[0] == "passed"]
    alone_regressions = [k for k in alone_pass if single["installed"].get(k, ("",))[0] != "passed"]
    alone_lines = [f"  {k}: alone native/installed "
                   + "/".join(single[n].get(k, ("not run", ""))[0] for n in ("native", "installed"))
                   + (f" ({single['installed'][k][1]})" if k in alone_regressions else "")
                   for k in native_failed if single]
    report = [f"selection: {len(keys)} tests of {tests}" + (f" (-k {args.k})" if args.k else ""),
              "native: " + ", ".join(f"{v} {s}" for s, v in count.items()),
              f"installed: {len(native_pass) - len(regressions)} of the {len(native_pass)} native passes pass",
              f"pass natively, not installed ({len(regressions)}):"] + [f"  {l}" for l in lines]
    if alone_lines:
        report += [f"fail natively in the suite, each run alone ({len(alone_pass)} pass natively alone, "
                   f"{len(alone_pass) - len(alone_regressions)} of them installed):"] + alone_lines
    with open(os.path.join(out, "torch_tests.txt"), "w") as f:
        f.write("\n".join(report) + "\n\nall (native | installed):\n")
        f.write("".join(f"  {k}: {status[k][0]} | {status[k][1][0]} {status[k][1][1]}\n" for k in keys))
    print("\n".join(report))
    print(f"torch_tests native_pass={len(native_pass)} installed_pass={len(native_pass) - len(regressions)} "
          f"regressions={len(regressions)} order_dependent={sum('order-dependent' in l for l in lines)} "
          f"alone_native_pass={len(alone_pass)} alone_installed_pass={len(alone_pass) - len(alone_regressions)}"
          f"{note}")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # a report: say what broke, never fail the caller
        traceback.print_exc()
        print("torch_tests error=script")
    sys.exit(0)
