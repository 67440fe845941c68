"""GPU differential fuzzer: seeded random programs run under torch_budget.install() and under
torch's native allocator, each in its own process; the two must read the same bytes.

A program allocates int32 tensors on several streams and fills each with a pattern derived
from its id, frees them, reads them back (every read checks the pattern), uses them on other
streams (an event, a kernel, record_stream, then a free while that kernel may still run),
captures and replays CUDA graphs (private pools, a pool shared by two graphs, a pool under a
tag), runs torch.compile(mode="reduce-overhead") steps (CUDA graph trees and their pool
checkpoints), allocates inside a torch.cuda.MemPool, empties the cache, and, installed only,
changes the budget and releases and restores a tag with every backup mode (contents checked
after pinned / cpu / disk backups, zeros after memset). After every operation the device's mismatch
counter is read every few steps, and installed, the ledger must equal the live blocks and the
budget must hold. With --faults RATE the driver refuses memory at that rate: every refusal must
be an OutOfMemoryError (the tensor is then skipped in both runs) or a retry that succeeded.

    python tools/fuzz_gpu.py --seeds 0-3 --ops 20000 [--faults 0.01] [--share] [--jobs 4]
                             [--without sleep,budget] [--conf route:pool]

A failing read names the operation, the tensor, its wrong bytes and every allocation of the
program that overlapped it.

prints one line per seed and `RESULT fuzz_gpu ...` last.
"""
import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MAX_LIVE = 64
SIZES = [1, 100, 1000, 64 << 10, 1 << 20, 3 << 20, 16 << 20]  # int32 elements


def program(seed, n):
    """The operations, as plain tuples; drawn without torch, the same in both processes."""
    rng = random.Random(seed)
    ops, live, next_id = [], [], 0
    for _ in range(n):
        r = rng.random()
        if (r < 0.35 and len(live) < MAX_LIVE) or not live:
            ops.append(("alloc", next_id, rng.choice(SIZES) + rng.randrange(7), rng.randrange(3),
                        rng.random() < 0.25))
            live.append(next_id)
            next_id += 1
        elif r < 0.6:
            ops.append(("free", live.pop(rng.randrange(len(live)))))
        elif r < 0.8:
            ops.append(("check", rng.choice(live), rng.randrange(3)))
        elif r < 0.9:
            ops.append(("cross", rng.choice(live), rng.randrange(3), rng.random() < 0.5))
        elif r < 0.93:
            ops.append(("graph", rng.choice(live), rng.choice(["private", "shared", "tagged"])))
        elif r < 0.95:
            ops.append(("compiled", rng.choice(live)))
        elif r < 0.96:
            ops.append(("mempool", rng.choice(SIZES)))
        elif r < 0.97:
            ops.append(("empty_cache",))
        elif r < 0.985:
            ops.append(("sleep", rng.choice(["none", "memset", "cpu", "pinned", "disk", "cpu+retain", "pinned+retain"])))
        else:
            ops.append(("budget", rng.choice([1.0, 0.5, 0.25])))
    return ops


def pattern_of(torch, tid, n_el, device):
    """What tensor `tid` of `n_el` int32 elements holds: derived from its id and each index."""
    return ((torch.arange(n_el, device=device, dtype=torch.int64) * 7 + tid * 2654435761) & 0x7FFFFFFF).to(
        torch.int32)


def run(seed, n, installed, faults, skip, share, without=()):
    import torch

    tb = None
    if installed:
        import tempfile

        import torch_budget as tb
        from torch_budget.sleep import set_disk_backup_dir

        tb.install()
        set_disk_backup_dir(tempfile.mkdtemp(prefix="tb-fuzz-disk-"))  # for backup "disk"; emptied by restores
    dev = torch.device("cuda")
    streams = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(2)]
    ops = ops_of(seed, n, without)
    # Mismatches seen by the reads of each operation: one slot per operation, so the first
    # failing read is known without a synchronisation that would change the timing.
    bad = torch.zeros(len(ops), dtype=torch.int64, device=dev)
    log = []  # (operation, tensor id, address, bytes): every allocation the program holds
    tensors, tagged = {}, set()
    digests, ooms = [], []
    graphs = {}
    compiled = torch.compile(lambda x: x * 3 + 1, mode="reduce-overhead")
    total = torch.cuda.get_device_properties(0).total_memory

    def pattern(tid, n_el):
        return pattern_of(torch, tid, n_el, dev)

    def check(t, tid):
        bad[i].add_((t != pattern(tid, t.numel())).sum())

    def held(tid, t):
        log.append((i, tid, t.data_ptr(), t.numel() * t.element_size()))

    def first_bad():
        slots = torch.nonzero(bad).flatten()
        return int(slots[0]) if slots.numel() else None

    def used_on(t, own, s):
        # Read or written on another stream than its own: its memory waits for that stream.
        if s != own:
            t.record_stream(streams[s])

    def ledger_ok():
        if not installed:
            return
        torch.cuda.synchronize()
        snap = torch.cuda.memory_snapshot()
        live = sum(b["size"] for s in snap for b in s["blocks"] if b["state"] == "active_allocated")
        assert live == torch.cuda.memory_allocated(), (live, torch.cuda.memory_allocated())
        budget = tb.stats()["budget"]
        if budget:
            assert torch.cuda.memory_reserved() <= budget, (torch.cuda.memory_reserved(), budget)

    lib = None
    if installed and faults > 0:
        from torch_budget import _native

        lib = _native.load()
    for i, op in enumerate(ops):
        kind = op[0]
        # Captures and compiled steps run without injected failures: a failure there ends the
        # capture, which is torch's business; the allocation paths are what is under test.
        if lib is not None:
            lib.tb_inject_driver_faults(0.0 if kind in ("graph", "compiled", "sleep") else faults, seed + i)
        try:
            if kind == "alloc":
                _, tid, n_el, s, under_tag = op
                if tid in skip:
                    continue
                with torch.cuda.stream(streams[s]):
                    if installed and under_tag:
                        with tb.region("fuzz", route="vmm"):
                            t = torch.empty(n_el, dtype=torch.int32, device=dev)
                    else:
                        t = torch.empty(n_el, dtype=torch.int32, device=dev)
                    t.copy_(pattern(tid, n_el))
                tensors[tid] = (t, s)
                held(tid, t)
                if installed and under_tag:
                    tagged.add(tid)
            elif kind == "free":
                tensors.pop(op[1], None)
                tagged.discard(op[1])
            elif kind == "check" and op[1] in tensors:
                t, s = tensors[op[1]]
                streams[op[2]].wait_stream(streams[s])
                with torch.cuda.stream(streams[op[2]]):
                    check(t, op[1])
                    digests.append(int(t[: min(t.numel(), 64)].sum().item()) if i % 17 == 0 else 0)
                used_on(t, s, op[2])
            elif kind == "cross" and op[1] in tensors:
                t, s = tensors[op[1]]
                other = streams[op[2]]
                other.wait_stream(streams[s])
                with torch.cuda.stream(other):
                    torch.cuda._sleep(2000)
                    check(t, op[1])
                    t.add_(0)
                t.record_stream(other)
                if op[3]:
                    tensors.pop(op[1])  # freed while `other` may still run: record_stream holds it
                    tagged.discard(op[1])
            elif kind == "graph" and op[1] in tensors:
                t, s = tensors[op[1]]
                torch.cuda.synchronize()
                kw = {}
                if op[2] == "shared" and "shared" in graphs:
                    kw["pool"] = graphs["shared"].pool()
                ctx = tb.region("fuzz_graphs", route="vmm") if installed and op[2] == "tagged" else _Null()
                g = torch.cuda.CUDAGraph()
                with ctx, torch.cuda.graph(g, **kw):
                    out = t * 2 + 5
                held(-1 - i, out)
                for _ in range(3):
                    g.replay()
                used_on(t, s, 0)
                bad[i].add_((out != pattern(op[1], t.numel()) * 2 + 5).sum())
                if op[2] == "shared":
                    graphs["shared"] = g
                del out, g
            elif kind == "compiled" and op[1] in tensors and tensors[op[1]][0].numel() >= 1024:
                t, s = tensors[op[1]]  # one shape, so the step compiles once
                with torch.cuda.stream(streams[0]):
                    streams[0].wait_stream(streams[s])
                    y = compiled(t[:1024]).clone()
                    held(-1 - i, y)
                    bad[i].add_((y != pattern(op[1], 1024) * 3 + 1).sum())
                used_on(t, s, 0)
            elif kind == "mempool":
                pool = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(pool):
                    m = torch.empty(op[1], dtype=torch.int32, device=dev)
                    m.copy_(pattern(7, op[1]))
                held(-1 - i, m)
                check(m, 7)
                del m, pool
            elif kind == "empty_cache":
                torch.cuda.empty_cache()
            elif kind == "sleep" and installed and tagged:
                backup, _, retain = op[1].partition("+")  # retained: the next release copies what changed
                tb.release("fuzz", backup=backup, retain=bool(retain))
                tb.restore("fuzz")
                for tid in tagged:
                    t, s = tensors[tid]
                    if backup in ("cpu", "pinned", "disk"):
                        check(t, tid)
                        used_on(t, s, 0)
                    else:
                        # Read and refilled on its own stream: a read on another stream
                        # would race the refill.
                        with torch.cuda.stream(streams[s]):
                            if backup == "memset":
                                bad[i].add_((t != 0).sum())
                            t.copy_(pattern(tid, t.numel()))
            elif kind == "budget" and installed:
                used = torch.cuda.memory_reserved()
                try:
                    tb.set_budget(max(op[1], used / total + 0.01) if op[1] < 1 else 1.0)
                except (ValueError, RuntimeError):
                    pass  # below what is allocated now: refused, nothing changed
        except torch.cuda.OutOfMemoryError:
            ooms.append(op[1] if kind == "alloc" else -1)
        if i % 64 == 0:
            j = first_bad()
            if j is not None:
                raise AssertionError(diagnose(torch, ops, j, int(bad[j]), tensors, log, pattern))
            if i % 512 == 0:
                ledger_ok()
    torch.cuda.synchronize()
    mismatches = int(bad.sum().item())
    j = first_bad()
    if j is not None:
        raise AssertionError(diagnose(torch, ops, j, int(bad[j]), tensors, log, pattern))
    ledger_ok()
    shared_ok = None
    if share and tensors:
        shared_ok = share_with_child(torch, tensors, pattern)
    out = {"mismatches": mismatches, "digests": digests, "ooms": ooms, "ops": n, "shared": shared_ok}
    if installed and faults > 0:
        from torch_budget import _native

        out["injected"] = int(_native.load().tb_inject_driver_faults(0.0, 0))
    return out


def diagnose(torch, ops, j, count, tensors, log, pattern):
    """What the first failing read saw: the operation, the tensor, the wrong elements, and every
    other allocation of the program that overlapped its memory, with whose pattern the wrong
    elements hold."""
    torch.cuda.synchronize()
    op = ops[j]
    lines = [f"operation {j} {op}: {count} mismatching elements"]
    tid = op[1] if len(op) > 1 and isinstance(op[1], int) and op[0] != "mempool" else None
    mine = [e for e in log if e[1] == tid]
    if tid is None or not mine or tid not in tensors:
        return "\n".join(lines)
    at, _, ptr, nbytes = mine[-1]
    t = tensors[tid][0]
    wrong = torch.nonzero(t != pattern(tid, t.numel())).flatten()
    lines.append(f"tensor {tid}: allocated at operation {at}, [{ptr:#x}, +{nbytes}) on stream {tensors[tid][1]}; "
                 f"now {wrong.numel()} wrong elements" +
                 (f", bytes {int(wrong[0]) * 4}..{int(wrong[-1]) * 4 + 3}" if wrong.numel() else ""))
    since = [f"{k}:{ops[k][0]}" + (f"({ops[k][1]})" if ops[k][0] in ("sleep", "budget") else "")
             for k in range(at, j + 1) if ops[k][0] in ("sleep", "budget", "empty_cache", "graph", "compiled",
                                                         "mempool")]
    lines.append("since its allocation: " + (", ".join(since[-40:]) or "allocations, frees, reads only"))
    if wrong.numel():
        values = t[wrong]
        for k, other, optr, onb in log:
            if other == tid or optr >= ptr + nbytes or optr + onb <= ptr:
                continue
            freed = next((m for m in range(k + 1, len(ops)) if ops[m][:2] == ("free", other)), None)
            line = (f"  overlapped by {'tensor ' + str(other) if other >= 0 else 'a result'} of operation {k} "
                    f"[{optr:#x}, +{onb}) freed at {freed}")
            if other >= 0:
                idx = wrong + (ptr - optr) // 4
                inside = (idx >= 0) & (idx < onb // 4)
                theirs = pattern(other, onb // 4)
                hits = int((theirs[idx[inside]] == values[inside]).sum()) if bool(inside.any()) else 0
                line += f": {hits} of the wrong elements hold its pattern"
            lines.append(line)
    return "\n".join(lines[:60])


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def share_with_child(torch, tensors, pattern):
    """One tensor to a spawned consumer on torch's native allocator, which checks and changes it."""
    import torch.multiprocessing as mp

    tid, (t, _) = next(iter(tensors.items()))
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consumer, args=(q, back))
    p.start()
    torch.cuda.synchronize()
    q.put((tid, t))
    ok = back.get(timeout=120)
    p.join(120)
    torch.cuda.synchronize()
    return bool(ok) and bool((t == pattern(tid, t.numel()) + 1).all().item())


def _consumer(q, back):
    import torch

    tid, t = q.get()
    ok = bool((t == pattern_of(torch, tid, t.numel(), t.device)).all().item())
    t.add_(1)
    torch.cuda.synchronize()
    back.put(ok)


_PROGRAMS = {}


def ops_of(seed, n, without=()):
    """The program of `seed`, with the operations of the kinds in `without` left out (to narrow
    down a finding: the rest of the program is drawn the same)."""
    key = (seed, n, tuple(sorted(without)))
    if key not in _PROGRAMS:
        _PROGRAMS[key] = [op for op in program(seed, n) if op[0] not in without]
    return _PROGRAMS[key]


def child(args):
    if os.environ.get("TORCH_BUDGET_GRAPH_HISTORY"):  # as tests/_harness.py: torch's stray-block error
        import torch._inductor.config                # in a graph pool then names the allocating stack
        torch._inductor.config.triton.cudagraph_trees_history_recording = True
    skip = set(json.loads(args.skip)) if args.skip else set()
    without = set(filter(None, args.without.split(",")))
    out = run(args.seed, args.ops, args.installed, args.faults, skip, args.share, without)
    print("FUZZ " + json.dumps(out), flush=True)


def one(seed, ops, installed, faults=0.0, skip=(), share=False, timeout=900, without=(), conf=""):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--seed", str(seed), "--ops", str(ops),
           "--faults", str(faults), "--skip", json.dumps(sorted(skip)), "--without", ",".join(sorted(without))]
    cmd += ["--installed"] if installed else []
    cmd += ["--share"] if share else []
    env = {**os.environ, "TORCH_BUDGET_CONF": conf if installed else "", "PYTORCH_CUDA_ALLOC_CONF": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FUZZ ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout).strip()[-3000:]}
    return json.loads(lines[-1][5:])


def differential(seed, ops, faults=0.0, share=False, without=(), conf=""):
    """Installed (with faults), then native skipping what the installed run could not allocate.
    Under compute-sanitizer (TORCH_BUDGET_UNDER_SANITIZER=1) without compiled steps: there torch's
    CUDA graph trees refuse their own pool on the native allocator too."""
    if os.environ.get("TORCH_BUDGET_UNDER_SANITIZER") == "1":
        without = (*without, "compiled")
    mine = one(seed, ops, True, faults, share=share, without=without, conf=conf)
    if "error" in mine:
        return {"seed": seed, "ok": False, "why": "installed: " + mine["error"]}
    skip = [x for x in mine["ooms"] if x >= 0]
    ref = one(seed, ops, False, 0.0, skip=skip, without=without)
    if "error" in ref:
        return {"seed": seed, "ok": False, "why": "native: " + ref["error"]}
    # An operation refused midway (not an allocation) reads nothing: digests then differ in
    # length, and only the absence of wrong bytes is compared.
    same = mine["digests"] == ref["digests"] or -1 in mine["ooms"]
    ok = same and mine["mismatches"] == 0 and ref["mismatches"] == 0 and mine["shared"] in (None, True)
    return {"seed": seed, "ok": ok, "same_digests": same, "mismatches": mine["mismatches"],
            "ooms": len(mine["ooms"]), "injected": mine.get("injected", 0), "shared": mine["shared"],
            "why": "" if ok else "digests differ from native" if not same else "mismatch or sharing failed"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default="0-3")
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--faults", type=float, default=0.0)
    ap.add_argument("--installed", action="store_true")
    ap.add_argument("--share", action="store_true")
    ap.add_argument("--skip", default="")
    ap.add_argument("--without", default="", help="operation kinds left out, comma-separated")
    ap.add_argument("--conf", default="", help="TORCH_BUDGET_CONF for the installed run")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at once (each in its own processes)")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    from _bench import cuda_torch

    if cuda_torch("fuzz_gpu", "allocator behaviour on a GPU") is None:
        return 0
    lo, _, hi = args.seeds.partition("-")
    seeds = range(int(lo), int(hi or lo) + 1)
    t0 = time.time()
    without = set(filter(None, args.without.split(",")))
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda s: differential(s, args.ops, args.faults, args.share, without, args.conf),
                                seeds))
    for r in results:
        print(json.dumps(r))
    total = len(results) * args.ops
    failed = [r["seed"] for r in results if not r["ok"]]
    print(f"RESULT fuzz_gpu ops={total} seeds={len(results)} faults={args.faults} failed={failed or 0} "
          f"ooms={sum(r.get('ooms', 0) for r in results)} injected={sum(r.get('injected', 0) for r in results)} "
          f"[{time.time() - t0:.0f} s]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
