"""What every command shares: the program's name, the argparse types that check user input when
it is read (whole numbers, fractions, sizes of memory with units, files to write), and parsing
that reports instead of exiting."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from torch_budget.units import memory_bytes, parse_size

PROG = "torch-budget"


def whole_number(text: str) -> int:
    """argparse type: a whole number."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def seed(text: str) -> int:
    """argparse type: a random seed, a whole number in [0, 2**63) (torch's generators take no more)."""
    value = whole_number(text)
    if not 0 <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"{text!r}: a seed is a whole number from 0 below 2**63")
    return value


def positive_int(text: str) -> int:
    """argparse type: a positive whole number below 2**63 (what the planner and the core take),
    so that a larger one is named by its flag, not by a parameter deep inside."""
    value = whole_number(text)
    if not 0 < value < 1 << 63:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number below 2**63")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


def _memory(text: str, *, zero: bool, bare_gib: bool) -> int:
    """Bytes of device memory: a size with a unit (torch_budget.units.memory_bytes: a bare number
    is bytes only from 1 MiB up), or with `bare_gib` a bare number of GiB (the older *-gib flags).
    One rule for the sign: more than 0, or 0 too with `zero`."""
    try:
        number, unit = parse_size(text, "")
        if number < 0 or (number == 0 and not zero):
            raise ValueError(f"must be {'0 or more' if zero else 'more than 0'}, got {text!r}")
        if bare_gib and unit == "":
            return memory_bytes(f"{text.strip()}GiB", "", zero=zero)
        return memory_bytes(text, "", zero=zero)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size(text: str) -> int:
    """argparse type: bytes of memory, more than 0, written with a unit ("80GiB")."""
    return _memory(text, zero=False, bare_gib=False)


def size_or_zero(text: str) -> int:
    """argparse type: bytes of memory, 0 or more, written with a unit ("2GiB")."""
    return _memory(text, zero=True, bare_gib=False)


def gib(text: str) -> int:
    """argparse type of the older *-gib flags: a number of GiB, or a size with a unit; more than 0."""
    return _memory(text, zero=False, bare_gib=True)


def gib_or_zero(text: str) -> int:
    """argparse type of the older *-gib flags: as `gib`, 0 allowed."""
    return _memory(text, zero=True, bare_gib=True)


def output_file(text: str) -> Path:
    """argparse type: a file the command will write. One rule for every output of the command
    line: its folder must exist (nothing is created), and it must not be a folder itself;
    checked when the arguments are read, before any work."""
    path = Path(text)
    problem = output_problem(path)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def output_problem(path: Path) -> str | None:
    """Why `path` cannot be written as a new or replaced file, or None."""
    if path.is_dir():
        return f"{str(path)!r} is a folder; give a file path, e.g. {str(path / 'out.json')!r}"
    folder = path.parent
    if not folder.exists():
        return f"the folder {str(folder)!r} does not exist; create it first (no folder is created)"
    if not folder.is_dir():
        return f"{str(folder)!r} is a file, not a folder, so {str(path)!r} cannot be written"
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"{str(path)!r} cannot be written here: permission denied"
    return None


def why_no_gpu() -> str | None:
    """Why this process cannot measure a GPU ("torch is not installed", "no CUDA device is
    visible"), or None when it can: what the commands that need one say before they stop."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "no CUDA device is visible"


def parse(parser: argparse.ArgumentParser, argv: list[str]):
    """(namespace, None), or (None, exit code) when parsing ended the command (--help, bad input)."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as e:
        return None, int(e.code or 0)
