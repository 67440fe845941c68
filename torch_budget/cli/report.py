"""`torch-budget report`: a saved plan or ledger as a table and a picture."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torch_budget.cli.arguments import PROG, output_file, output_problem, parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROG} report", description="Render a plan or ledger JSON as a table and a PNG.")
    p.add_argument("ledger", help="JSON written by `torch-budget plan --json`, Plan.to_json() or the demo (a measured "
                                  "ledger, with each budgeted tag's budget, use and headroom)")
    p.add_argument("--out", type=output_file,
                   help="PNG path; its folder must exist (default: the ledger path with .png)")
    p.add_argument("--title", help="title for the table and the picture (default: the ledger's own)")
    return p


def _same_file(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve() or os.path.samefile(a, b)
    except OSError:  # the picture does not exist yet
        return False


def run(argv: list[str]) -> int:
    args, rc = parse(parser(), argv)
    if rc is not None:
        return rc
    from torch_budget.report import format_table, load_report, write_png

    try:
        title, total, lines, budgets = load_report(args.ledger)
    except ValueError as e:
        print(f"{PROG} report: error: {e}", file=sys.stderr)
        return 2
    out = args.out or Path(args.ledger).with_suffix(".png")  # a file's path now: it was read
    problem = output_problem(out)
    if not problem and _same_file(out, args.ledger):
        problem = f"{str(out)!r} is the ledger itself, which the picture would overwrite"
    if problem:
        print(f"{PROG} report: error: the picture beside the ledger: {problem}; choose one with --out",
              file=sys.stderr)
        return 2
    title = args.title or title
    print(format_table(lines, total, title, budgets))
    try:
        write_png(lines, total, out, title, budgets)
    except ImportError as e:
        print(f"{PROG} report: the table is above; {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{PROG} report: cannot write {str(out)!r}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"picture written to {out}")
    return 0
