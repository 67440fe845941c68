"""Replays traces under one allocator configuration, in this process (which must not have
started CUDA yet: the configuration decides the allocator), and prints one `REPLAY {json}` line
per trace, in order; each trace starts from an emptied cache (and, under install(), a full packing
credit), as in a process of its own.

    python -m torch_budget.replay.child CONFIG TRACE... [--passes N] [--pin] [--touch] [--lockstep] [--history-only]

TRACE is a file (replay.trace; --history-only as its load()'s history_only) or `mix:<spec>`
(replay.mixes). The trace runs `passes` times
over the same allocator; each pass is timed alone, with Python's garbage collector off (as
timeit does: a collection inside one pass would be charged to whichever allocator ran it). A
short trace runs more passes, up to MAX_PASSES, until the passes after the first add up to
MIN_GROWN_SECONDS: a recorded decode of 4,500 operations is a few milliseconds, which one
scheduling hiccup doubles. Memory: peak reserved bytes over the trace's own peak live bytes
(requested sizes rounded up to 512 bytes, the same denominator for every allocator), from torch's
counters, which every configuration keeps: over every pass, and over the first pass alone.

With --lockstep the child replays slices of the traces as its parent asks (serve(); Note in
replay.lockstep): the parent interleaves the configurations slice by slice and times them together.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

from torch_budget.replay import lockstep
from torch_budget.replay.configs import CONFIGS, apply_config
from torch_budget.replay.machine import pin_near_gpu, pin_to_one_core
from torch_budget.replay.mixes import mix
from torch_budget.replay.trace import load, split_device


MIN_GROWN_SECONDS = 0.25  # the passes after the first time at least this much in all, where MAX_PASSES allow
MAX_PASSES = 64


def wants_another_pass(done: int, requested: int, grown_seconds: float,
                       min_grown_seconds: float = MIN_GROWN_SECONDS, max_passes: int = MAX_PASSES) -> bool:
    """After `done` passes: whether to run one more. Every requested pass runs; past them, more run
    while the passes after the first have timed less than `min_grown_seconds` in all, up to
    `max_passes`."""
    if done < requested:
        return True
    return done < max(max_passes, requested) and grown_seconds < min_grown_seconds


CALIBRATION_OPS = 20000


def calibrate(torch, ops: int = CALIBRATION_OPS) -> float:
    """µs per `torch.empty` + free of a small CPU tensor: the same Python, argument parsing, dispatch
    and tensor bookkeeping as a replayed operation, without the CUDA allocator. A whole process can
    run everything up to 2x slower or faster (by the core it lands on); a pass's time over this,
    taken in the same process just before it, leaves what the allocator costs."""
    empty, uint8 = torch.empty, torch.uint8
    gc.disable()
    t0 = time.perf_counter()
    for _ in range(ops):
        empty(64, dtype=uint8)
    elapsed = time.perf_counter() - t0
    gc.enable()
    return elapsed / ops * 1e6


def read_trace(spec: str, history_only: bool = False):
    """`mix:<spec>`, a trace file, or `PATH@N`: device N's history of a memory snapshot;
    `history_only` leaves out what a snapshot shows live before recording started (replay.trace)."""
    return mix(spec[4:]) if spec.startswith("mix:") else load(*split_device(spec), history_only=history_only)


def _device_calls(torch) -> int | None:
    """Allocations and frees of driver memory so far (cudaMalloc / cudaFree natively, handles
    created and released under torch_budget's VMM route): what the allocator's cache missed. None
    where torch does not count them (its cudaMallocAsync backend reports them as zeros)."""
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        return None
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)


def starts_afresh() -> None:
    """Under install(): the packing credit is a full burst again, as when a process starts (Note
    [Packing time]). One process replays trace after trace, each from an emptied cache with its
    peaks reset; without this a trace also began with whatever credit the one before left (lognormal
    churn spends all of it), and packed as no process of its own does: decode_graphs replayed after
    lognormal churn in lockstep, on an H100, 1.185 peak reserved over peak live where a process of its
    own packs it to 1.013 (over the stand-in with an H200's call costs, 1.185 and 1.013)."""
    lockstep.tell_installed("tb_packing_refill")


def _backing_ns(torch_budget) -> tuple[int, int]:
    """Under install(): the wall time torch_budget's allocation path spent backing allocations
    with device memory so far, and the packing moves' part of it (ledger mapping_ns, packing_ns)."""
    if not torch_budget.installed():
        return 0, 0
    raw = torch_budget.stats()["raw"]
    return raw.get("mapping_ns", 0), raw.get("packing_ns", 0)


class Replayer:
    """One trace over this process's allocator, pass by pass; a pass can run in slices (lockstep)."""

    def __init__(self, trace, touch: bool = False):
        import torch

        import torch_budget

        self._torch, self._tb, self.trace, self.touch = torch, torch_budget, trace, touch
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.streams = [torch.cuda.current_stream()] + [torch.cuda.Stream()
                                                        for _ in range(max(trace.num_streams - 1, 0))]
        self.ops = list(zip(trace.ids, trace.sizes, trace.streams))
        self.slots = [None] * trace.num_tensors
        # Warm-up outside the timed passes: CUDA's context, the first kernels and the streams.
        torch.zeros(1, device=self.dev).add_(1)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        starts_afresh()
        self.base_reserved = torch.cuda.memory_reserved()
        self.times = []  # µs per operation, per pass
        self.calibration = []  # calibrate()'s µs per operation just before each pass
        self.device_calls = []  # memory the allocator took from or gave back to the driver, per pass
        self.backing = []  # (mapping_ns, packing_ns) of torch_budget's allocation path, per pass
        self.first_peak_reserved = None
        self._pass_seconds = 0.0
        self._stream = 0

    def begin_pass(self, calibrate_first: bool = True) -> None:
        self._calls_before = _device_calls(self._torch)
        self._backing_before = _backing_ns(self._tb)
        self._pass_seconds = 0.0
        self._torch.cuda.set_stream(self.streams[0])
        self._stream = 0  # the index of the current stream
        if calibrate_first:
            self.calibration.append(calibrate(self._torch))
        gc.collect()
        gc.disable()

    def run(self, start: int, stop: int) -> float:
        """Operations [start, stop) of the trace; returns their seconds."""
        torch, dev, slots, streams = self._torch, self.dev, self.slots, self.streams
        empty, uint8 = torch.empty, torch.uint8
        ops = self.ops[start:stop]
        current = self._stream
        t0 = time.perf_counter()
        if self.touch:
            for tid, size, s in ops:
                if s != current:
                    torch.cuda.set_stream(streams[s])
                    current = s
                if size:
                    slots[tid] = empty(size, dtype=uint8, device=dev)
                    slots[tid][:1].fill_(1)  # no local name: one would keep the tensor past its free
                else:
                    slots[tid] = None
        else:
            for tid, size, s in ops:
                if s != current:
                    torch.cuda.set_stream(streams[s])
                    current = s
                if size:
                    slots[tid] = empty(size, dtype=uint8, device=dev)
                else:
                    slots[tid] = None
        elapsed = time.perf_counter() - t0
        self._stream = current
        self._pass_seconds += elapsed
        return elapsed

    def end_pass(self) -> float:
        """Ends the pass that ran: records it and frees what the trace left live (weights, say)."""
        gc.enable()  # (a failed pass ends the child: its error is the result)
        torch = self._torch
        torch.cuda.set_stream(self.streams[0])
        self.times.append(self._pass_seconds / len(self.ops) * 1e6)
        calls = _device_calls(torch)
        if calls is not None:  # none counted: no figure, not zero (the table prints "-")
            self.device_calls.append(calls - self._calls_before)
        self.backing.append(tuple(a - b for a, b in zip(_backing_ns(self._tb), self._backing_before)))
        if len(self.times) == 1:
            torch.cuda.synchronize()
            self.first_peak_reserved = torch.cuda.max_memory_reserved() - self.base_reserved
        self.slots = [None] * self.trace.num_tensors
        return self._pass_seconds

    def result(self) -> dict:
        torch, trace = self._torch, self.trace
        torch.cuda.synchronize()
        # The peak over every pass: a cache that packs the first pass tightly and grows in later ones
        # (the layout it left does not fit the next pass) holds its later peak, which the first hides.
        peak_reserved = torch.cuda.max_memory_reserved() - self.base_reserved
        peak_live = trace.peak_live()

        def over_live(b):
            return b / peak_live if peak_live else float("nan")

        return {"us_per_op": self.times, "calibration_us": self.calibration, "device_calls": self.device_calls,
                "backing_ns": self.backing, "ops": len(self.ops), "peak_reserved": peak_reserved,
                "peak_live": peak_live, "reserved_over_live": over_live(peak_reserved),
                "first_pass_reserved_over_live": over_live(self.first_peak_reserved)}


def replay(trace, passes: int = 3, touch: bool = False, min_grown_seconds: float = MIN_GROWN_SECONDS) -> dict:
    """The trace `passes` times (more while short), each pass timed whole."""
    r = Replayer(trace, touch)
    grown_seconds = 0.0
    p = 0
    while wants_another_pass(p, passes, grown_seconds, min_grown_seconds):
        r.begin_pass()
        r.run(0, len(r.ops))
        elapsed = r.end_pass()
        if p > 0:
            grown_seconds += elapsed
        p += 1
    return r.result()


def serve(specs: list, traces: list, touch: bool) -> None:
    """Lockstep (replay.lockstep): replays slices of the traces as the parent asks.

    begin T         start trace T (an index) afresh (starts_afresh)   -> ok
    pass            start a pass                                        -> ok
    run A B         operations [A, B) of the current trace              -> <seconds>
    end_pass        end the pass                                        -> ok
    result          the trace's figures, as replay() returns them       -> <json>
    """
    current = {}  # the trace being replayed: its spec and Replayer

    def begin(t):
        current.update(spec=specs[int(t)], replayer=Replayer(traces[int(t)], touch))
        return "ok"

    def start_pass():
        current["replayer"].begin_pass(calibrate_first=False)
        return "ok"

    def run(start, stop):
        lockstep.turn_starts()
        return repr(current["replayer"].run(int(start), int(stop)))

    def end_pass():
        current["replayer"].end_pass()
        return "ok"

    def result():
        out = current.pop("replayer").result()
        out.update(trace=current["spec"], pid=os.getpid(), lockstep=True)
        return json.dumps(out)

    lockstep.serve({"begin": begin, "pass": start_pass, "run": run, "end_pass": end_pass, "result": result})


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m torch_budget.replay.child")
    ap.add_argument("config", choices=sorted(CONFIGS))
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--min-grown-seconds", type=float, default=MIN_GROWN_SECONDS,
                    help="a short trace runs more passes until those after the first time this much "
                         "(0: exactly --passes)")
    ap.add_argument("--pin", action="store_true", help="pin this process to one CPU core beside the GPU")
    ap.add_argument("--touch", action="store_true", help="write the first byte of every tensor")
    ap.add_argument("--lockstep", action="store_true",
                    help="replay slices as commands on stdin ask (replay.lockstep), pinned once ready")
    ap.add_argument("--history-only", action="store_true",
                    help="leave out the blocks a memory snapshot shows live before recording started")
    args = ap.parse_args(argv)
    if args.pin and not args.lockstep:
        pin_to_one_core()
    elif args.pin:
        pin_near_gpu()
    traces = [read_trace(spec, args.history_only) for spec in args.traces]
    apply_config(args.config)
    if args.lockstep:
        import torch

        torch.zeros(1, device="cuda")  # CUDA's start, on every core of the GPU's node
        if args.pin:
            pin_to_one_core()
        serve(args.traces, traces, args.touch)
        return 0
    for spec, trace in zip(args.traces, traces):
        out = replay(trace, args.passes, args.touch, args.min_grown_seconds)
        out.update(config=args.config, trace=spec, pid=os.getpid())
        print("REPLAY " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
