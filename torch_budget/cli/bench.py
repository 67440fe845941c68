"""`torch-budget bench`: the allocator benchmark of a source checkout, in a process of its own."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from torch_budget.cli.arguments import PROG, parse, positive_int, why_no_gpu


def bench_script() -> Path:
    """Where the benchmark script sits in a source checkout (it is not part of the package)."""
    return Path(__file__).resolve().parents[2] / "tools" / "bench_alloc.py"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} bench",
        description="Run the allocator benchmark: a serving-like mix, a small-only mix and a lognormal mix, "
                    "the recorded traces of real workloads in tools/traces/, and torch.empty + del round trips "
                    "at 4 KiB, 1 MiB and 64 MiB, for torch's native allocator and each torch_budget route, "
                    "interleaved and repeated, side by side. Needs a CUDA device and a source checkout "
                    "(the script is tools/bench_alloc.py); `torch-budget replay` runs it on your own trace.")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="interleaved rounds per configuration; the table shows medians (default 3)")
    return p


def run(argv: list[str]) -> int:
    args, rc = parse(parser(), argv)
    if rc is not None:
        return rc
    script = bench_script()
    if not script.is_file():
        print(f"{PROG} bench: no benchmark script at {script}. The benchmarks live in tools/bench_alloc.py of "
              "the torch_budget source repository; run this command from a source checkout "
              "(pip install --no-build-isolation -e .) or run that script directly.", file=sys.stderr)
        return 1
    why = why_no_gpu()
    if why is not None:
        print(f"{PROG} bench: the benchmark times GPU allocations and {why}; nothing was measured.",
              file=sys.stderr)
        return 1
    # Its own process: benchmarks install the allocator, which must happen before CUDA starts.
    env = dict(os.environ, BENCH_ALLOC_ROUNDS=str(args.rounds))
    return subprocess.call([sys.executable, str(script)], cwd=script.parent.parent, env=env)
