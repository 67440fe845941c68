#!/usr/bin/env python3
"""torch_memory_saver's own examples (its repository's test/examples), run against torch_budget's
adapter: each example imports `torch_memory_saver` and finds torch_budget.adapters.torch_memory_saver
there, so nothing in the examples changes.

    python tools/tms_examples.py EXAMPLES_DIR [--cases simple,cuda_graph,...] [--out DIR]

EXAMPLES_DIR is a checkout's test/examples (torch_memory_saver's code, not this project's: copy it
into .tms_examples/, which git ignores, and carry it to the GPU machine). The cases follow the
matrix of its test/test_examples.py for CUDA: each example's entry point, with both hook modes where
it runs both and the variables it sets. Every case runs in a fresh process (the allocator is chosen
before CUDA starts) with a shim package on the path: `torch_memory_saver` re-exports the adapter,
and `torch_memory_saver.testing_utils` / `.utils` provide the few helpers the examples import,
written here. A case passes when its process exits 0; it is "unsupported" when the adapter raised
UnsupportedError (what torch_budget says it cannot do, and why); anything else fails. Cases that
need two devices are skipped with fewer. The last line is `RESULT tms_examples passed=.. ...`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SHIM_INIT = '''"""torch_memory_saver's import name over torch_budget's adapter (tools/tms_examples.py)."""
from torch_budget.adapters import torch_memory_saver as _adapter

globals().update({k: v for k, v in vars(_adapter).items() if not k.startswith("__")})
'''
SHIM_TESTING = '''"""The helpers torch_memory_saver's examples import, for a CUDA device."""
import gc

import torch


def get_device():
    return "cuda"


def empty_cache():
    gc.collect()
    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message, gpu_id=0):
    free, total = torch.cuda.mem_get_info(gpu_id)
    used = total - free
    print(f"GPU {gpu_id} memory used: {used / (1 << 30):.2f} GiB ({message})", flush=True)
    return used
'''
SHIM_UTILS = '''"""change_env, as torch_memory_saver's examples use it."""
import contextlib
import os


@contextlib.contextmanager
def change_env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
'''


@dataclass
class Case:
    module: str
    function: str = "run"
    hook_modes: tuple = ("preload", "torch")
    env: dict = field(default_factory=dict)
    devices: int = 1
    not_applicable: str = ""  # why the case cannot say anything about the adapter

    def names(self):
        for mode in self.hook_modes:
            yield f"{self.module}.{self.function}[{mode}]", mode


# test/test_examples.py's matrix for CUDA, one entry per test function.
CASES = [
    Case("simple"),
    Case("cuda_graph"),
    Case("cpu_backup"),
    Case("cpu_backup", "run_backend_from_env", env={"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}),
    Case("cpu_backup", "run_preload_backend_from_env", hook_modes=("preload",),
         env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1", "TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}),
    Case("cpu_backup", "run_retain_from_env", env={"TMS_RETAIN_CPU_BACKUP": "1"}),
    Case("cpu_backup", "run_multi_device_mmap_restore", devices=2),
    Case("cpu_backup", "run_rss", hook_modes=("torch",)),
    Case("disk_backup"),
    Case("multi_device", devices=2),
    Case("multi_device_torch_mode", hook_modes=("torch",), devices=2),
    Case("rl_example"),
    Case("training_engine", hook_modes=("preload",), env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}),
    Case("cuda_vmm_granularity", hook_modes=("preload",), env={"TMS_INIT_ENABLE": "1"},
         not_applicable="it calls torch_memory_saver's preloaded C library (tms_pause, ...) through ctypes"),
    Case("nested_region", hook_modes=("preload",), env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}),
]


def write_shim(folder: str) -> str:
    pkg = os.path.join(folder, "torch_memory_saver")
    os.makedirs(pkg, exist_ok=True)
    for name, text in (("__init__.py", SHIM_INIT), ("testing_utils.py", SHIM_TESTING), ("utils.py", SHIM_UTILS)):
        with open(os.path.join(pkg, name), "w") as f:
            f.write(text)
    return folder


def classify(returncode: int, output: str) -> tuple[str, str]:
    """(outcome, the line that says why) of one case's process."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    if returncode == 0:
        return "passed", ""
    for line in reversed(lines):
        if "UnsupportedError" in line:
            return "unsupported", line.strip()
    if not lines:
        return "failed", f"exit {returncode}"
    # where it failed: the innermost frame of the traceback and its source line
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    if frames and frames[-1] + 1 < len(lines):
        frame = lines[frames[-1]].strip()
        where = frame.split('"')[1].rsplit(os.sep, 1)[-1] + ":" + frame.split(", line ")[1].split(",")[0]
        return "failed", f"{lines[-1].strip()} at {where}: {lines[frames[-1] + 1].strip()}"
    return "failed", lines[-1].strip()


def run_case(case: Case, mode: str, examples: str, shim: str, timeout: float) -> tuple[str, str]:
    code = (f"import sys; sys.path[:0] = [{shim!r}, {examples!r}]; import {case.module} as m; "
            f"m.{case.function}({mode!r})")
    env = {**os.environ, **case.env, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=examples)
    except subprocess.TimeoutExpired:
        return "failed", f"timed out after {timeout:.0f} s"
    outcome, why = classify(proc.returncode, proc.stdout + proc.stderr)
    if outcome == "failed":  # what it printed last (the examples print the memory they see) goes to the log
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-FAILED_TAIL:]
        print("\n".join("    | " + line for line in tail), file=sys.stderr, flush=True)
    return outcome, why


FAILED_TAIL = 25  # lines of a failed case's output shown


def device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/tms_examples.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("examples", help="torch_memory_saver's test/examples folder")
    ap.add_argument("--cases", default="", help="comma-separated example modules (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--devices", type=int, default=None, help="devices to assume (default: what torch sees)")
    args = ap.parse_args(argv)
    examples = os.path.abspath(args.examples)
    if not os.path.isfile(os.path.join(examples, "simple.py")):
        print(f"tms_examples: {examples} is not torch_memory_saver's test/examples (no simple.py)", file=sys.stderr)
        return 2
    wanted = {c for c in args.cases.split(",") if c}
    devices = device_count() if args.devices is None else args.devices
    counts = {"passed": 0, "unsupported": 0, "failed": 0, "skipped": 0}
    with tempfile.TemporaryDirectory(prefix="tms-shim-") as tmp:
        shim = write_shim(tmp)
        for case in CASES:
            if wanted and case.module not in wanted:
                continue
            for name, mode in case.names():
                if case.not_applicable:
                    outcome, why = "skipped", case.not_applicable
                elif devices < case.devices:
                    outcome, why = "skipped", f"needs {case.devices} device{'s' if case.devices > 1 else ''}, {devices} here"
                elif not os.path.isfile(os.path.join(examples, case.module + ".py")):
                    outcome, why = "skipped", "not in this checkout"
                else:
                    outcome, why = run_case(case, mode, examples, shim, args.timeout)
                counts[outcome] += 1
                print(f"{name:52} {outcome:11} {why[:240]}", flush=True)
    print("RESULT tms_examples " + " ".join(f"{k}={v}" for k, v in counts.items()))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
