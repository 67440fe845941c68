"""Synthetic allocation mixes, deterministic for a seed, as traces (replay.trace.Trace).

Each stands for a pattern users run; `MIXES` names them for the benchmark and the CLI
(`mix:<name>` in place of a trace file):
  - serving: 80 % of requests 256 B - 512 KiB, 19.5 % 2 - 64 MiB, 0.5 % 200 MiB - 1.2 GiB
    (log-uniform within each class), with the live set swinging between 120 and 600 tensors;
  - small: 256 B - 512 KiB only, about 400 live;
  - lognormal: a few to 48 live tensors, lognormal sizes around 16 MiB, capped at 512 MiB;
  - one size (`mix:1MiB`, `mix:4KiB`, ...): allocate and free one tensor in a loop.
"""

from __future__ import annotations

import math
import random

from torch_budget.replay.trace import Trace, TraceError
from torch_budget.units import KiB, MiB, parse_bytes

SERVING_CLASSES = ((0.8, 256, 512 * KiB), (0.195, 2 * MiB, 64 * MiB), (0.005, 200 * MiB, 1200 * MiB))


def _swinging(name, ops, seed, low, high, period, draw, free_bias):
    rng = random.Random(seed)
    trace = Trace(name)
    live = []
    next_id = 0
    for step in range(ops):
        target = low + (high - low) * (0.5 + 0.5 * math.sin(step / period))
        if live and (len(live) > target or rng.random() < free_bias):
            trace.free(live.pop(rng.randrange(len(live))))
        else:
            trace.alloc(next_id, draw(rng))
            live.append(next_id)
            next_id += 1
    for tid in live:
        trace.free(tid)
    return trace


def _log_uniform(rng, lo, hi):
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def serving(ops: int = 100_000, seed: int = 0) -> Trace:
    def draw(rng):
        r = rng.random()
        for p, lo, hi in SERVING_CLASSES:
            if r < p:
                return _log_uniform(rng, lo, hi)
            r -= p
        return _log_uniform(rng, SERVING_CLASSES[-1][1], SERVING_CLASSES[-1][2])

    return _swinging("mix:serving", ops, seed, 120, 600, 700.0, draw, 0.3)


def small(ops: int = 100_000, seed: int = 0) -> Trace:
    return _swinging("mix:small", ops, seed, 300, 500, 500.0, lambda rng: _log_uniform(rng, 256, 512 * KiB), 0.3)


def lognormal(ops: int = 20_000, seed: int = 0) -> Trace:
    def draw(rng):
        return int(min(max(rng.lognormvariate(math.log(16 * MiB), 1.6), 4096), 512 * MiB))

    return _swinging("mix:lognormal", ops, seed, 4, 48, 150.0, draw, 0.3)


def one_size(size: int, ops: int = 40_000) -> Trace:
    trace = Trace(f"mix:{size}B")
    for i in range(ops // 2):
        trace.alloc(i, size)
        trace.free(i)
    return trace


MIXES = {"serving": serving, "small": small, "lognormal": lognormal}
MAX_OPS = 10_000_000


def mix(spec: str) -> Trace:
    """`serving`, `small`, `lognormal` (optionally `name:ops` or `name:ops:seed`) or a size (`1MiB`)."""
    name, _, rest = spec.partition(":")
    fields = rest.split(":") if rest else []
    shape = f"{name}[:ops[:seed]]" if name in MIXES else f"{name}[:ops]"
    if len(fields) > (2 if name in MIXES else 1) or not all(f.isascii() and f.isdigit() for f in fields):
        raise TraceError(f"mix {spec!r}: expected {shape}, whole numbers, with ops > 0")
    args = [int(f) for f in fields]
    if args[:1] == [0]:
        raise TraceError(f"mix {spec!r}: expected {shape} with ops > 0")
    if args[:1] and args[0] > MAX_OPS:
        raise TraceError(f"mix {spec!r}: {args[0]} operations; a mix has at most {MAX_OPS} (a trace that long "
                         "takes minutes a pass per configuration)")
    if name not in MIXES and args[:1] and args[0] < 2:
        raise TraceError(f"mix {spec!r}: a size's mix allocates and frees, so it needs ops >= 2")
    if name in MIXES:
        return MIXES[name](*args)
    try:
        size = parse_bytes(name)
    except ValueError as e:
        raise TraceError(f"unknown mix {spec!r}: one of {', '.join(MIXES)} or a size such as 1MiB"
                         f"{'' if name[:1].isalpha() else f' ({e})'}") from None
    if size >= 1 << 63:
        raise TraceError(f"mix {spec!r}: the size must be below 2**63 bytes")
    if size <= 0:
        raise TraceError(f"mix {spec!r}: the size must be positive")
    return one_size(size, *args[:1])
