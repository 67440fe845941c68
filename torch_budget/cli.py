"""`torch-budget`: the command line (`torch-budget <command> ...` or `python -m torch_budget ...`).

Each command lives in the module that owns its subject; this file only dispatches, so that
`torch-budget --help` stays cheap (torch is imported by the command that needs it, not here).
Exit codes: 0 success, 1 the command ran and failed, 2 bad input (a message, never a traceback).
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
from pathlib import Path

PROG = "torch-budget"

USAGE = f"""usage: {PROG} <command> [options]

commands:
  doctor   versions, devices, and the allocation route install() would choose
  demo     serve the built-in model inside a planned budget; compare plan and measurement
  plan     plan a card's budgets for a described model (no GPU needed)
  report   render a plan or ledger JSON as a table and a PNG
  bench    run the allocator benchmarks (tools/bench_alloc.py in a source checkout)

`{PROG} <command> --help` describes a command's options."""


def _parse_no_args(command: str, description: str, argv: list[str]) -> int | None:
    """Parse a command that takes no options; returns an exit code when parsing ended the command."""
    parser = argparse.ArgumentParser(prog=f"{PROG} {command}", description=description)
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return None


def _doctor(argv: list[str]) -> int:
    rc = _parse_no_args("doctor", "Print versions, visible devices, their capabilities and the route "
                                  "torch_budget.install() would choose.", argv)
    if rc is not None:
        return rc
    from torch_budget import allocator

    try:
        print(allocator.doctor())
    except (OSError, allocator.TorchBudgetError) as e:
        # OSError: the extension exists but cannot be loaded, e.g. built against another torch.
        print(f"{PROG} doctor: the compiled extension could not answer: {e}", file=sys.stderr)
        return 1
    return 0


def _demo(argv: list[str]) -> int:
    from torch_budget import demo

    return demo.main(argv)


def _plan(argv: list[str]) -> int:
    from torch_budget.budget import cli_plan

    return cli_plan(argv)


def _report(argv: list[str]) -> int:
    from torch_budget.report import cli_report

    return cli_report(argv)


def bench_script() -> Path:
    """Where the benchmark script sits in a source checkout (it is not part of the package)."""
    return Path(__file__).resolve().parent.parent / "tools" / "bench_alloc.py"


def _bench(argv: list[str]) -> int:
    script = bench_script()
    if not script.is_file():
        print(f"{PROG} bench: no benchmark script at {script}. The benchmarks live in tools/bench_alloc.py of "
              "the torch_budget source repository; run this command from a source checkout "
              "(pip install --no-build-isolation -e .) or run that script directly.", file=sys.stderr)
        return 1
    # Its own process: benchmarks install the allocator, which must happen before CUDA starts.
    return subprocess.call([sys.executable, str(script), *argv], cwd=script.parent.parent)


COMMANDS = {"doctor": _doctor, "demo": _demo, "plan": _plan, "report": _report, "bench": _bench}


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
    try:
        return int(handler(rest) or 0)
    except KeyboardInterrupt:
        print(f"\n{PROG} {command}: interrupted", file=sys.stderr)
        return 130
