"""Replays traces under several allocator configurations side by side and prints what each
costs and saves: time per operation as a paired ratio against torch's native allocator, and
peak reserved bytes over the trace's peak live bytes.

Timing moves by up to 2x between processes on one machine (a process runs everything slower or
faster, by the core it landed on), so every figure comes from rounds:
each round runs every (trace, configuration, pinning) once, in its own process, in an order
that rotates from round to round; a configuration's ratio is the median over rounds of its
time divided by native's time in the same round and pinning. The calibrated ratio (`x cal`)
divides each process's time by its own speed first: a loop of small CPU tensor allocations
(child.calibrate, the same Python and dispatch without the CUDA allocator), timed in the same
process before each pass.

That is not enough on every machine: a core's speed can halve for a second or more inside a
pass, which no calibration taken before it sees. With `lockstep` (the default) the configurations
of a round run at once instead, each in its own process, taking turns slice by slice
(replay.lockstep): every slow spell falls on all of them alike, and a configuration's ratio is
the median over every grown pass of every round of its pass time over native's same pass.
The time a process waits for its turn earns torch_budget no packing credit (lockstep.turn_starts;
Note [Packing time]: moves draw on a share of wall-clock time): it packs as a process timed alone.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

from torch_budget.replay import lockstep
from torch_budget.replay.child import MIN_GROWN_SECONDS, read_trace, wants_another_pass
from torch_budget.replay.configs import BASELINE, CONFIGS, environment

SLICE_OPS = 2048  # operations a configuration runs before the next one takes its turn: a few ms


@dataclass
class Run:
    trace: str
    config: str
    pinned: bool
    rounds: list = field(default_factory=list)  # one child's result per round (None: it failed)
    errors: list = field(default_factory=list)


def _child(config: str, traces: list, pinned: bool, passes: int, touch: bool, history_only: bool = False) -> tuple:
    """The command line and environment of a child replaying `traces` under `config`."""
    cmd = [sys.executable, "-m", "torch_budget.replay.child", config, *traces, "--passes", str(passes)]
    if pinned:
        cmd.append("--pin")
    if touch:
        cmd.append("--touch")
    if history_only:
        cmd.append("--history-only")
    env = {**os.environ, **environment(config)}
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return cmd, env


def run_child(config: str, traces: list, pinned: bool, passes: int, touch: bool, timeout: float,
              history_only: bool = False) -> list:
    """One process of `config` replaying every trace; a result (or {"error": ...}) per trace."""
    cmd, env = _child(config, traces, pinned, passes, touch, history_only)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        out = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("REPLAY ")]
        why = f"exit {proc.returncode}: " + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    except subprocess.TimeoutExpired:
        out, why = [], f"timed out after {timeout:.0f} s"
    by_trace = {r["trace"]: r for r in out}
    return [by_trace.get(t, {"error": why}) for t in traces]


def run_lockstep(configs: list, traces: list, lengths: list, pinned: bool, passes: int, touch: bool,
                 timeout: float, slice_ops: int = SLICE_OPS, min_grown_seconds: float = MIN_GROWN_SECONDS,
                 history_only: bool = False) -> dict:
    """One round: a process per configuration, all at once, replaying every trace (`lengths`: its
    operations) in turns of `slice_ops` operations; the order rotates from slice to slice and pass
    to pass. Every configuration runs the same passes: the requested ones, then more while the
    first configuration's passes after the first add up to less than `min_grown_seconds`.
    Returns {config: [a result, or {"error": ...}, per trace]}; a child that fails leaves the round."""
    children = {}
    for c in configs:
        cmd, env = _child(c, traces, pinned, passes, touch, history_only)
        children[c] = (cmd + ["--lockstep"], env)
    started = lockstep.start(children, timeout)
    live = {c: x for c, x in started.items() if isinstance(x, lockstep.Child)}
    errors = {c: str(x) for c, x in started.items() if not isinstance(x, lockstep.Child)}

    def each(names, command):
        """Every named live child's answer to `command`; a child that fails it leaves the round."""
        answers = {}
        for c in names:
            if c in live:
                try:
                    answers[c] = live[c].ask(command, timeout)
                except lockstep.ChildError as e:
                    errors[c] = str(e)
                    live.pop(c).close(timeout=5.0)
        return answers

    results = {c: [] for c in configs}
    try:
        for t, n in enumerate(lengths):
            each(list(live), f"begin {t}")
            done, grown = 0, 0.0
            while live and wants_another_pass(done, passes, grown, min_grown_seconds):
                each(list(live), "pass")
                lead = next(iter(live))  # the configuration whose grown passes decide how many run
                for k, a in enumerate(range(0, n, slice_ops)):
                    answers = each(lockstep.rotation(list(live), k + done), f"run {a} {min(a + slice_ops, n)}")
                    if done > 0 and lead in answers:
                        grown += float(answers[lead])
                each(list(live), "end_pass")
                done += 1
            answers = each(list(live), "result")
            for c in configs:
                results[c].append(json.loads(answers[c]) if c in answers else {"error": errors.get(c, "no result")})
    finally:
        for child in live.values():
            child.close()
    return results


def compare(traces, configs=None, rounds: int = 3, pinning=(True, False), passes: int = 3, touch: bool = False,
            progress=None, timeout: float = 900.0, unpinned_configs=None, in_lockstep: bool = True,
            history_only: bool = False) -> list:
    """Every (trace, config, pinning) over `rounds` interleaved rounds. In lockstep (the default)
    each round starts one process per (config, pinning), runs those of a pinning at once in turns
    (run_lockstep), and each replays every trace; otherwise each process runs alone, in an order
    that rotates from round to round. `unpinned_configs` limits which configurations also run
    unpinned (default: all); `history_only` is load()'s (replay.trace), in every process. Returns
    the Runs; a trace that cannot be read raises TraceError, naming it, before any process starts."""
    configs = list(configs or CONFIGS)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(CONFIGS)}")
    # every child replays every trace: one that cannot be read would fail them all
    lengths = [len(read_trace(spec, history_only)) for spec in traces]
    if BASELINE not in configs:
        configs.insert(0, BASELINE)
    plan = [(c, p) for p in pinning for c in configs
            if p or unpinned_configs is None or c in unpinned_configs or c == BASELINE]
    runs = {(t, c, p): Run(t, c, p) for c, p in plan for t in traces}

    def record(r, config, pinned, results, step, steps):
        for trace, res in zip(traces, results):
            run = runs[(trace, config, pinned)]
            if "error" in res:
                run.rounds.append(None)
                run.errors.append(res["error"])
            else:
                run.rounds.append(res)
        if progress:
            ok = [x for x in results if "error" not in x]
            what = (f"{len(ok)}/{len(results)} traces, median {statistics.median(_time(x) for x in ok):.2f} us/op"
                    if ok else "FAILED: " + results[0]["error"])
            progress(f"[{step}/{steps}] round {r + 1} {config}{' pinned' if pinned else ''}: {what}")

    done = 0
    for r in range(rounds):
        if in_lockstep:
            for pinned in pinning:
                group = [c for c, p in plan if p == pinned]
                if progress:
                    progress(f"round {r + 1}{' pinned' if pinned else ''}: {', '.join(group)} in lockstep")
                results = run_lockstep(group, list(traces), lengths, pinned, passes, touch, timeout,
                                       history_only=history_only)
                for config in group:
                    done += 1
                    record(r, config, pinned, results[config], done, rounds * len(plan))
            continue
        shift = (r * max(len(plan) // 3, 1)) % len(plan)
        for config, pinned in plan[shift:] + plan[:shift]:
            done += 1
            record(r, config, pinned, run_child(config, list(traces), pinned, passes, touch, timeout,
                                                history_only=history_only), done, rounds * len(plan))
    return list(runs.values())


def median_interval(values, confidence: float = 0.95) -> tuple | None:
    """A distribution-free confidence interval for the median of `values` (independent draws):
    the order statistics (k-th smallest, k-th largest) for the largest k whose chance of the
    median lying outside is at most 1 - confidence, from the binomial distribution with p = 1/2.
    None when there are too few values for any such interval (5 or fewer at 95 %)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
    xs = sorted(values)
    n = len(xs)
    tail, below, k = (1 - confidence) / 2, 0.0, 0
    # below: P(Binomial(n, 1/2) <= k - 1), the chance that fewer than k values lie under the median
    while k < n // 2:
        nxt = below + math.comb(n, k) / 2 ** n
        if nxt > tail:
            break
        below, k = nxt, k + 1
    return (xs[k - 1], xs[n - k]) if k > 0 else None


def _time(res: dict) -> float:
    """µs per operation once the cache has grown: the median of the passes after the first (the
    only pass when there is one)."""
    times = res["us_per_op"]
    return statistics.median(times[1:] or times)


def _paired_ratios(x: dict, n: dict) -> list:
    """x's time over native's, as the two were paired: pass by pass (the passes after the first)
    where they ran in lockstep, each pass's slices next to the other's; else one ratio of the
    grown passes' medians, for processes that ran one after the other."""
    xs, ns = x["us_per_op"], n["us_per_op"]
    if x.get("lockstep") and n.get("lockstep") and len(xs) == len(ns):
        return [a / b for a, b in zip(xs[1:] or xs, ns[1:] or ns)]
    return [_time(x) / _time(n)]


def _calibrated(res: dict) -> float | None:
    """_time over the process's own speed: the grown passes' µs per operation over the median of
    the calibrations taken just before them (child.calibrate); None from a child without them."""
    cal = res.get("calibration_us")
    if not cal or len(cal) != len(res["us_per_op"]):
        return None
    return _time(res) / statistics.median(cal[1:] or cal)


def _backing_share(res: dict) -> float | None:
    """The share of the grown passes' time torch_budget's allocation path spent backing allocations
    with device memory (the driver's calls, packing moves included); None where not reported."""
    backing, times = res.get("backing_ns"), res["us_per_op"]
    if not backing or len(backing) != len(times) or len(times) < 2:
        return None
    grown_us = sum(times[1:]) * res["ops"]
    return sum(b[0] for b in backing[1:]) / 1e3 / grown_us if grown_us else None


def _first(res: dict) -> float:
    """µs per operation of the first pass, which grows the cache from empty."""
    return res["us_per_op"][0]


GRANULE = 2 << 20  # every allocator here reserves device memory in multiples of 2 MiB


def reserved_floor(peak_live: int) -> float:
    """The least peak reserved / peak live any allocator here can reach: the peak live bytes
    rounded up to whole 2 MiB granules (torch's segments and torch_budget's mappings are both
    made of them), over the peak live bytes."""
    return -(-peak_live // GRANULE) * GRANULE / peak_live if peak_live else float("nan")


def summarise(runs: list) -> list:
    """One row per (trace, config, pinning): median µs/op once the cache has grown, the paired
    median ratio against native of that (the median over rounds of each round's paired median)
    and of the first pass (the cache growing from empty: `x_native_first`, with more than one
    pass), rounds it was at or under native, and its memory ratio."""
    base = {(r.trace, r.pinned): r for r in runs if r.config == BASELINE}
    traces = list(dict.fromkeys(r.trace for r in runs))
    configs = list(dict.fromkeys(r.config for r in runs))
    rows = []
    for run in sorted(runs, key=lambda r: (traces.index(r.trace), not r.pinned, configs.index(r.config))):
        ok = [x for x in run.rounds if x is not None]
        row = {"trace": run.trace, "config": run.config, "pinned": run.pinned, "rounds": len(ok),
               "errors": run.errors}
        if ok:
            row["us_per_op"] = statistics.median(_time(x) for x in ok)
            row["reserved_over_live"] = statistics.median(x["reserved_over_live"] for x in ok)
            firsts = [x["first_pass_reserved_over_live"] for x in ok if "first_pass_reserved_over_live" in x]
            if len(firsts) == len(ok):  # older children measured the first pass only
                row["first_pass_reserved_over_live"] = statistics.median(firsts)
            row["peak_live"] = ok[0]["peak_live"]
            row["reserved_floor"] = reserved_floor(row["peak_live"])
            row["ops"] = ok[0]["ops"]
            shares = [v for v in (_backing_share(x) for x in ok) if v is not None]
            if shares and any(shares):
                row["backing_share"] = statistics.median(shares)
            # Driver memory taken or given back per thousand operations in the last pass (the
            # steady state); older children did not report it.
            calls = [x["device_calls"][-1] for x in ok if x.get("device_calls")]
            if calls:
                row["device_calls_per_kop"] = statistics.median(calls) * 1000 / row["ops"]
            nat = base.get((run.trace, run.pinned))
            pairs = [(x, n) for x, n in zip(run.rounds, nat.rounds if nat else []) if x is not None and n is not None]
            if pairs:
                # A round is one sample, its passes are not: a process keeps the core, the node and
                # the neighbours it landed on for its whole round (unpinned, one round put
                # torch_budget's process 1.5x behind native's pass after pass, the next 0.9x), so
                # each round gives its own paired median and the row the median of those.
                ratios = [statistics.median(_paired_ratios(x, n)) for x, n in pairs]
                row["x_native"] = statistics.median(ratios)
                row["wins"] = sum(1 for q in ratios if q <= 1.0)
                row["pairs"] = len(ratios)
                cal = [(_calibrated(x), _calibrated(n)) for x, n in pairs]
                if all(a is not None and b is not None for a, b in cal):
                    row["x_native_calibrated"] = statistics.median(a / b for a, b in cal)
                if all(len(x["us_per_op"]) > 1 and len(n["us_per_op"]) > 1 for x, n in pairs):
                    row["x_native_first"] = statistics.median(_first(x) / _first(n) for x, n in pairs)
        rows.append(row)
    return rows


def table(rows: list) -> str:
    """The rows as a fixed-width text table, grouped by trace."""
    lines = [f"{'trace':28} {'config':16} {'pin':>3} {'us/op':>8} {'x native':>9} {'<=1 in':>7} "
             f"{'x cal':>7} {'1st pass':>9} {'rsv/live':>9} {'rsv 1st':>8} {'floor':>7} {'drv/kop':>8} {'map %':>6}"]
    for row in rows:
        name = os.path.basename(row["trace"])[:28]
        if "us_per_op" not in row:
            lines.append(f"{name:28} {row['config']:16} {'y' if row['pinned'] else 'n':>3} FAILED: "
                         + (row["errors"][0] if row["errors"] else "no result"))
            continue
        ratio = f"{row['x_native']:.2f}x" if "x_native" in row else "-"
        wins = f"{row['wins']}/{row['pairs']}" if "wins" in row else "-"
        calls = f"{row['device_calls_per_kop']:.1f}" if "device_calls_per_kop" in row else "-"
        first = f"{row['x_native_first']:.2f}x" if "x_native_first" in row else "-"
        cal = f"{row['x_native_calibrated']:.2f}x" if "x_native_calibrated" in row else "-"
        backing = f"{100 * row['backing_share']:.1f}" if "backing_share" in row else "-"
        rsv_first = f"{row['first_pass_reserved_over_live']:.3f}" if "first_pass_reserved_over_live" in row else "-"
        lines.append(f"{name:28} {row['config']:16} {'y' if row['pinned'] else 'n':>3} {row['us_per_op']:8.2f} "
                     f"{ratio:>9} {wins:>7} {cal:>7} {first:>9} {row['reserved_over_live']:9.3f} "
                     f"{rsv_first:>8} {row['reserved_floor']:7.3f} {calls:>8} {backing:>6}")
    return "\n".join(lines)
