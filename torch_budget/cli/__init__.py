"""`torch-budget`: the command line (`torch-budget <command> ...` or `python -m torch_budget ...`).

One module per command (doctor, demo, plan, report, bench, replay: a `parser()` and a `run(argv)`),
and arguments.py for the argument types they share; each command then calls the module that owns
its subject.
`torch-budget --help` stays cheap: torch is imported by the command that needs it.
Exit codes: 0 success, 1 the command ran and failed (an over-committed plan included), 2 bad
input (a message, never a traceback).
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys

from torch_budget.cli import bench, demo, doctor, plan, replay, report
from torch_budget.cli.arguments import PROG

USAGE = f"""usage: {PROG} <command> [options]

commands:
  doctor   versions, devices, settings from TORCH_BUDGET_CONF, and the route install() would choose
  demo     serve the built-in model inside a planned budget; compare plan and measurement
  plan     plan a card's budgets for a described model (no GPU needed)
  report   render a plan or ledger JSON as a table and a PNG
  bench    run the allocator benchmark (tools/bench_alloc.py in a source checkout)
  replay   replay an allocation trace under torch's allocators and torch_budget's routes, side by side

`{PROG} <command> --help` describes a command's options."""

COMMANDS = {"doctor": doctor.run, "demo": demo.run, "plan": plan.run, "report": report.run, "bench": bench.run,
            "replay": replay.run}
PARSERS = {"doctor": doctor.parser, "demo": demo.parser, "plan": plan.parser, "report": report.parser,
           "bench": bench.parser, "replay": replay.parser}


def _alloc_conf_refused() -> str | None:
    """Why torch cannot even be imported under this PYTORCH_CUDA_ALLOC_CONF, or None. torch parses
    it as it loads and stops the whole process on some malformed values (an internal assertion,
    SIGABRT); a command must say so instead of dying with it. Tried in a child, and only when set."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if not conf:
        return None
    r = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=600)
    if r.returncode >= 0:
        return None  # imported, or failed in a way the command itself will show
    what = next((ln.strip() for ln in r.stderr.splitlines() if ln.strip().startswith("what():")), "")
    return (f"PYTORCH_CUDA_ALLOC_CONF={conf!r} stops torch as it is imported (signal {-r.returncode}"
            f"{': ' + what if what else ''}): correct or unset it")


def main(argv=None) -> int:
    """Run one `torch-budget` command and return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if command == "--version":
        from torch_budget import __version__

        print(f"{PROG} {__version__}")
        return 0
    handler = COMMANDS.get(command)
    if handler is None:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"{PROG}: unknown command {command!r}{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    refused = _alloc_conf_refused()
    if refused:
        print(f"{PROG} {command}: error: {refused}", file=sys.stderr)
        return 2
    try:
        return int(handler(rest) or 0)
    except KeyboardInterrupt:
        print(f"\n{PROG} {command}: interrupted", file=sys.stderr)
        return 130
