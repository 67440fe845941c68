"""Byte units: the constants, reading sizes written by people, and printing them.

Binary units (KiB, MiB, GiB, TiB: powers of 1024) are what devices and torch report.
Decimal units (KB, MB, GB, TB: powers of 1000) are accepted too, because card vendors
and people write "60GB"; they mean exactly what they say (60GB = 60 * 10**9 bytes).

A size of device memory (a budget, a card, a cap) written without a unit is bytes only from
1 MiB up: "1" or "80" is almost never meant as a byte count, so a bare number below 1 MiB is
refused with a message that says how to write it (`memory_bytes`).
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

from ._validate import INT64_MAX

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}

# A bare number (no unit) of device memory below this is refused: write the unit.
BARE_BYTES_MIN = MiB

_SIZE = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def _named(what: str, shown: str) -> str:
    return f"{what} {shown}" if what else shown


def parse_size(text: str, what: str = "size") -> tuple[float, str]:
    """("12.5", "GiB") style split of a size string; ValueError naming `what` if it is not one."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"cannot read {_named(what, repr(text))}: write a number with a unit, e.g. 40GiB")
    unit = m.group(2).lower()
    if unit not in UNITS:
        raise ValueError(f"unknown unit {m.group(2)!r} in {_named(what, repr(text))} "
                         "(binary: B, KiB, MiB, GiB, TiB; decimal: KB, MB, GB, TB)")
    number = float(m.group(1))
    if not math.isfinite(number * UNITS[unit]):  # more digits than a float holds: int() would overflow
        raise ValueError(f"{_named(what, repr(text))} is far past any size (at most 2**63 - 1 bytes)")
    return number, unit


def _whole_bytes(text: str, unit: str, what: str) -> int:
    """The bytes `text` (a size parse_size read, with its `unit`) names, counted exactly (a float
    holds whole numbers only to 2**53): a fraction of a byte is refused where the unit is bytes,
    else dropped ("0.1KiB" is 102 bytes)."""
    exact = Fraction(_SIZE.fullmatch(text).group(1)) * UNITS[unit]
    if exact.denominator != 1 and UNITS[unit] == 1:
        raise ValueError(f"{_named(what, repr(text))} is not a whole number of bytes")
    return math.floor(exact)


def check_max_bytes(n: int, what: str, shown: object) -> int:
    """`n` bytes, if the core can hold them (INT64_MAX, _validate.py)."""
    if n > INT64_MAX:
        raise ValueError(f"{what or 'a size'} of {shown!r} is more bytes than any device has (at most 2**63 - 1)")
    return n


def parse_bytes(text: str, what: str = "size") -> int:
    """Bytes from "40GiB", "512 MiB", "60GB" or "1024"; never negative."""
    number, unit = parse_size(text, what)
    if number < 0:
        raise ValueError(f"{what} must be 0 or more bytes, got {text!r}")
    return check_max_bytes(_whole_bytes(text, unit, what), what, text)


def bare_number_message(what: str, shown: str, *, fraction: bool = False) -> str:
    """Why a bare number below BARE_BYTES_MIN is refused, and how to write what was meant.
    `shown` is the value as the user wrote it."""
    ways = 'a size with a unit ("40GiB", "512MiB"; "1B" is one byte)'
    if fraction:
        ways += ' or a fraction of the card in (0, 1] ("1.0" is the whole card)'
    return f"{_named(what, shown)} has no unit, and a bare number is bytes only from 1 MiB up: write {ways}"


def memory_bytes(text: str, what: str = "size", *, zero: bool = False, fraction_hint: bool = False) -> int:
    """Bytes of device memory from a size people write: a number with a unit ("40GiB",
    "512 MiB", "60GB", "1.5TiB"), or a bare whole number of bytes from 1 MiB up. More than 0
    bytes, or 0 too with `zero`. `fraction_hint` adds to the bare-number message that a fraction
    of the card may be written instead (for budgets)."""
    number, unit = parse_size(text, what)
    if number < 0 or (number == 0 and not zero):
        raise ValueError(f"{what or 'a size'} must be {'0 or more' if zero else 'more than 0'} bytes, got {text!r}")
    if unit == "":
        if "." in text:
            raise ValueError(f"{_named(what, repr(text))} has no unit: write one, e.g. \"{text.strip()}GiB\"")
        if 0 < number < BARE_BYTES_MIN:
            raise ValueError(bare_number_message(what, repr(text), fraction=fraction_hint))
    n = check_max_bytes(_whole_bytes(text, unit, what), what, text)
    if n == 0 and not zero:
        raise ValueError(f"{what or 'a size'} must be more than 0 bytes, got {text!r} (less than one byte)")
    return n


def format_bytes(n: int) -> str:
    """GiB from 1 GiB up, MiB below; signed, so an over-commitment reads as such."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"
