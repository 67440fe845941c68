"""Byte units: the constants, reading sizes written by people, and printing them.

Binary units (KiB, MiB, GiB, TiB: powers of 1024) are what devices and torch report.
Decimal units (KB, MB, GB, TB: powers of 1000) are accepted too, because card vendors
and people write "60GB"; they mean exactly what they say (60GB = 60 * 10**9 bytes).
"""
from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str, what: str = "size") -> tuple[float, str]:
    """("12.5", "GiB") style split of a size string; ValueError naming `what` if it is not one."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"cannot read {what} {text!r}: use a number with an optional unit, e.g. 40GiB")
    unit = m.group(2).lower()
    if unit not in UNITS:
        raise ValueError(f"unknown unit {m.group(2)!r} in {what} {text!r} "
                         "(binary: B, KiB, MiB, GiB, TiB; decimal: KB, MB, GB, TB)")
    return float(m.group(1)), unit


def parse_bytes(text: str, what: str = "size") -> int:
    """Bytes from "40GiB", "512 MiB", "60GB" or "1024"."""
    number, unit = parse_size(text, what)
    return int(number * UNITS[unit])


def format_bytes(n: int) -> str:
    """GiB from 1 GiB up, MiB below; signed, so an over-commitment reads as such."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"
