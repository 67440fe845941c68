"""`torch-budget replay`: allocation traces replayed under each allocator, side by side."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch_budget.cli.arguments import PROG, output_file, parse, positive_int, why_no_gpu
from torch_budget.units import format_bytes


def parser() -> argparse.ArgumentParser:
    from torch_budget.replay.configs import CONFIGS, DEFAULT
    from torch_budget.replay.mixes import MIXES

    p = argparse.ArgumentParser(
        prog=f"{PROG} replay",
        description="Replay allocation traces under torch's native allocator, its expandable segments, "
                    "cudaMallocAsync and torch_budget's routes, each in its own process, those of a round at once "
                    "taking turns slice by slice; "
                    "print time per operation (a paired ratio against native) and peak reserved over peak live "
                    "bytes side by side. A trace is a memory-history pickle from "
                    "torch.cuda.memory._dump_snapshot() (its busiest device's history; PATH@N for device N's), "
                    "a torch_budget trace (.tbtrace[.gz]), or "
                    f"mix:<name> for a built-in mix ({', '.join(MIXES)}, or a size such as mix:1MiB).")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="a memory-history pickle (PATH@N: device N's history), a .tbtrace[.gz] file, or "
                        "mix:<name>")
    p.add_argument("--configs", default=",".join(DEFAULT),
                   help=(f"comma-separated, from {', '.join(CONFIGS)} (default: {', '.join(DEFAULT)}; native is "
                         "always run)").replace("%", "%%"))
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--passes", type=positive_int, default=3,
                   help="replays of the trace in each process, each timed (default 3; a short trace runs more, "
                        "until the replays after the first time 0.25 s)")
    p.add_argument("--pinning", choices=("pinned", "unpinned", "both"), default="pinned",
                   help="run each process on one CPU core beside the GPU, unpinned, or both (default pinned)")
    p.add_argument("--sequential", action="store_true",
                   help="time each process alone, one after the other, instead of all of a round at once taking "
                        "turns slice by slice (the default: a machine whose speed moves while it runs moves every "
                        "configuration alike)")
    p.add_argument("--touch", action="store_true", help="write the first byte of every tensor (launches a kernel "
                                                        "per allocation)")
    p.add_argument("--history-only", action="store_true",
                   help="replay a memory history as recorded, without the blocks live when recording started "
                        "(by default those it frees without allocating them, and those the snapshot holds live "
                        "at its end that it never allocated, such as weights loaded before recording, are "
                        "allocated first); a torch_budget trace or a mix is replayed as it is")
    p.add_argument("--json", metavar="PATH", type=output_file,
                   help="also write every round's figures here; its folder must exist (default: not written)")
    return p


def run(argv: list[str]) -> int:
    args, rc = parse(parser(), argv)
    if rc is not None:
        return rc
    from torch_budget.replay import compare
    from torch_budget.replay.child import read_trace
    from torch_budget.replay.configs import CONFIGS
    from torch_budget.replay.trace import TraceError

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        what = f"unknown configuration {unknown[0]!r}" if unknown else f"--configs {args.configs!r} names none"
        print(f"{PROG} replay: {what}: choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    # A name given twice would be replayed twice into one row, each round counted twice.
    for what, names in (("configuration", configs), ("trace", args.traces)):
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            print(f"{PROG} replay: {what} {twice!r} is given twice", file=sys.stderr)
            return 2
    for spec in args.traces:
        try:
            t = read_trace(spec, args.history_only)
        except TraceError as e:
            print(f"{PROG} replay: {e}", file=sys.stderr)
            return 2
        print(f"{spec}: {len(t)} operations, {t.allocations()} allocations on {t.num_streams} stream(s), "
              f"peak live {format_bytes(t.peak_live())}", file=sys.stderr)
        for comment in t.comments:
            print(f"  {comment}", file=sys.stderr)
    why = why_no_gpu()
    if why is not None:
        print(f"{PROG} replay: the traces above read correctly, but replaying them needs a GPU and {why}.",
              file=sys.stderr)
        return 1
    pinning = {"pinned": (True,), "unpinned": (False,), "both": (True, False)}[args.pinning]
    runs = compare.compare(args.traces, configs, args.rounds, pinning, args.passes, args.touch,
                           progress=lambda line: print(line, file=sys.stderr, flush=True),
                           in_lockstep=not args.sequential, history_only=args.history_only)
    rows = compare.summarise(runs)
    print(compare.table(rows))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps({"rows": rows, "runs": [r.__dict__ for r in runs]}, indent=1))
        except OSError as e:
            print(f"{PROG} replay: cannot write {str(args.json)!r}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 1 if any(r["errors"] for r in rows) else 0
