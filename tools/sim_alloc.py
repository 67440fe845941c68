"""Replays allocation traces over the host stand-in of the driver (no GPU): what the VMM route's
policy does to packing and how many driver calls it makes, in seconds instead of GPU time.

    python tools/sim_alloc.py [TRACE ...] [--capacity 141GiB] [--map-run 16MiB] [--noreuse] [--no-parking]
                              [--packing-time SHARE] [--costs] [--gap SECONDS] [--passes N]

TRACE is a file (torch_budget.replay.trace) or `mix:<spec>`; the default is the benchmark's
mixes and recorded traces. Per trace: peak reserved over the trace's peak live bytes (the
benchmark's figure: over every pass, and the first pass's alone), cuMemMap / cuMemUnmap calls
per thousand operations, clean blocks adopted across streams (Note [Adopting clean blocks]) per
thousand in the last pass, and an estimate of the
driver time per operation from the per-call costs measured on an H200 (DESIGN.md: a mapping's
create + map + access + unmap + release is about 55 us). Last, the core's own time per operation
in the steady state: the trace replayed three more times by a C loop (tb_host_replay), so without
Python's loop or torch; it is the core's bookkeeping over the stand-in on this machine's CPU, not
the GPU path, and what changes to the hot path are compared by. With --costs the stand-in's
VMM calls spin for what they take on an H200 (TB_HOST_DRIVER_COSTS=1), so the packing figures
show what a policy bounded in time (Note [Packing time]) does, Python's loop standing in for
torch's time between operations, and `pack %` the share of the last pass's time packing moves
took. --turns N idles after every slice as a process in lockstep with N - 1 others does while they
take their turns, and then says the wait earns no packing credit, as lockstep does (--waits-earn:
it earns). --gap idles that long before each pass, as bench_alloc's processes do while they time their
calibration loop and a server does between bursts: the packing credit refills meanwhile (without
it, the stand-in showed 0.1 bounding lognormal churn, which on an H200 then moved in every pass).

Needs the host core: TORCH_BUDGET_BUILD=_host_core python setup.py build_ext --inplace.
"""
import argparse
import glob
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from torch_budget.replay.child import read_trace  # noqa: E402
from torch_budget.replay.compare import SLICE_OPS  # noqa: E402  (lockstep's turn)
from torch_budget.units import parse_bytes  # noqa: E402

# µs per mapping made and later undone (create 8.6 + map 2.1 + access 20 + unmap 14 + release 10).
US_PER_MAPPING = 55.0
DEFAULT_TRACES = ["mix:serving", "mix:small", "mix:lognormal"] + sorted(
    glob.glob(os.path.join(HERE, "traces", "*.tbtrace.gz")))


def simulate(spec, capacity, map_run, reuse, passes, packing_time, gap=0.0, turns=1, waits_earn=False, parking=True):
    from _hostcore import Host

    trace = read_trace(spec)
    h = Host(capacity=capacity, route="vmm", reuse_before_grow=reuse, map_run=map_run, packing_time=packing_time)
    h.lib.tb_host_parking(int(parking))
    streams = [h.stream() for _ in range(max(trace.num_streams, 1))]
    ops = list(zip(trace.ids, trace.sizes, trace.streams))
    out = {}
    for p in range(passes):
        slots = {}
        before = h.counters()
        time.sleep(gap)
        st = h.stats()
        adopted, packing = st["num_adoptions"], st["packing_ns"]
        dt = 0.0
        for a in range(0, len(ops), SLICE_OPS):
            t0 = time.perf_counter()
            for tid, size, s in ops[a:a + SLICE_OPS]:
                if size:
                    slots[tid] = h.malloc(size, streams[s])
                else:
                    h.free(slots.pop(tid))
            took = time.perf_counter() - t0
            dt += took
            if turns > 1:
                time.sleep(took * (turns - 1))  # the other configurations' turns
                if not waits_earn:
                    h.lib.tb_packing_idle(0)  # as replay's lockstep says it waited (Note [Packing time])
        for ptr in slots.values():
            h.free(ptr)
        after = h.counters()
        maps = after["maps"] - before["maps"]
        unmaps = after["unmaps"] - before["unmaps"]
        if p == 0:
            out["rsv_first"] = h.stats()["reserved_bytes"]["all"]["peak"] / trace.peak_live()
        out[f"pass{p}"] = (maps, unmaps, dt / len(ops) * 1e6, h.stats()["num_adoptions"] - adopted)
        out["pack_share"] = (h.stats()["packing_ns"] - packing) / 1e9 / dt
    out["ops"] = len(ops)
    out["rsv_over_live"] = h.stats()["reserved_bytes"]["all"]["peak"] / trace.peak_live()  # every pass's peak
    # The core's own time: the steady state again, replayed by a C loop (median of three).
    replay = h.replayer(trace, streams)
    times = []
    for _ in range(3):
        times.append(replay() / len(ops) * 1e9)
        replay.free_all()
    out["core_ns"] = sorted(times)[1]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="*", default=DEFAULT_TRACES)
    ap.add_argument("--capacity", default="141GiB")
    ap.add_argument("--map-run", default="0", help="bytes per run mapping (0: the default)")
    ap.add_argument("--noreuse", action="store_true")
    ap.add_argument("--no-parking", action="store_true",
                    help="without Note [The parked block]: what it saves is the core ns/op column's difference")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--packing-time", type=float, default=None, help="share of time packing may take")
    ap.add_argument("--costs", action="store_true", help="the stand-in's VMM calls take an H200's time")
    ap.add_argument("--gap", type=float, default=0.0, help="seconds idle before each pass")
    ap.add_argument("--turns", type=int, default=1,
                    help="idle after every slice of 2,048 operations for (TURNS - 1) times its time, as a process "
                         "in lockstep with TURNS - 1 others waits for its turn (replay.lockstep)")
    ap.add_argument("--waits-earn", action="store_true",
                    help="with --turns: the waits earn packing credit (lockstep does not let them)")
    args = ap.parse_args()
    if args.costs:
        os.environ["TB_HOST_DRIVER_COSTS"] = "1"
    from _hostcore import in_child
    print(f"{'trace':22} {'rsv/live':>8} {'rsv 1st':>7} {'maps/kop':>9} {'unmaps/kop':>10} {'est us/op':>9} "
          f"{'last pass maps/kop':>18} {'est us/op':>9} {'pack %':>6} {'adopted/kop':>11} {'core ns/op':>10}")
    for spec in args.traces:
        r = in_child(simulate, spec, parse_bytes(args.capacity), parse_bytes(args.map_run), not args.noreuse,
                     args.passes, args.packing_time, args.gap, args.turns, args.waits_earn, not args.no_parking)
        n = r["ops"]
        m0, u0, _, _ = r["pass0"]
        m1, u1, _, a1 = r[f"pass{args.passes - 1}"]
        name = os.path.basename(spec).replace(".tbtrace.gz", "")
        print(f"{name:22} {r['rsv_over_live']:8.3f} {r['rsv_first']:7.3f} {m0 * 1e3 / n:9.2f} {u0 * 1e3 / n:10.2f} "
              f"{max(m0, u0) * US_PER_MAPPING / n:9.3f} {m1 * 1e3 / n:18.2f} "
              f"{max(m1, u1) * US_PER_MAPPING / n:9.3f} {100 * r['pack_share']:6.1f} {a1 * 1e3 / n:11.2f} "
              f"{r['core_ns']:10.0f}")


if __name__ == "__main__":
    main()
