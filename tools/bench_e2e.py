"""End to end: the three real workloads of tools/workloads.py, natively and under
torch_budget.install(), each in its own process, the two in lockstep (torch_budget.replay.lockstep):
both processes warm up, then take turns, one timed run each (the order alternates), so a slow
spell of the machine falls on both alike. Prints the timed part's seconds (the paired median of
installed / native over every pair of every round, and each round's median), peak reserved bytes
of both, and whether the outputs' checksums agree: equal, DIFFERS, or VARY where one side's own runs
already disagree (a workload that is not deterministic on the GPU, whose checksums then say nothing of
the allocator). The last line is `RESULT bench_e2e ...`.

Every process runs beside the GPU and times on one core there, the same core for both
(workloads.py --pin), unless BENCH_E2E_PIN=0.

Environment: BENCH_E2E_ROUNDS (2: fresh processes each), BENCH_E2E_REPEATS (timed runs per process
and round, 24), BENCH_E2E_PIN (1), BENCH_E2E_WORKLOADS (comma-separated).
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench import cuda_torch  # noqa: E402
from torch_budget.replay.compare import median_interval  # noqa: E402  (no torch import: the parent stays light)
from torch_budget.replay.configs import CLEAN_ENVIRONMENT  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ["llama_generate", "resnet_amp", "decode_graphs"]
TIMEOUT = 600.0


def one_round(name, repeats, pin):
    """Native and installed processes of `name` in lockstep: {side: {"runs": [...], peaks}} or
    {"error": ...}."""
    from torch_budget.replay import lockstep

    env = {**os.environ, **CLEAN_ENVIRONMENT, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.join(HERE, "workloads.py"), name, "--lockstep"] + (["--pin"] if pin else [])
    started = lockstep.start({"native": (cmd, env), "installed": (cmd + ["--install"], env)}, TIMEOUT)
    children = {k: v for k, v in started.items() if isinstance(v, lockstep.Child)}
    try:
        if len(children) < 2:
            return {"error": "; ".join(str(v) for v in started.values() if not isinstance(v, lockstep.Child))}
        out = {side: {"runs": []} for side in children}
        for k in range(repeats):
            for side in lockstep.rotation(["native", "installed"], k):
                out[side]["runs"].append(json.loads(children[side].ask("run", TIMEOUT)))
        for side, child in children.items():
            out[side].update(json.loads(child.ask("result", TIMEOUT)))
        return out
    except lockstep.ChildError as e:
        return {"error": str(e)}
    finally:
        for child in children.values():
            child.close()


def checks(rounds):
    """What the outputs' checksums say over rounds of (native runs, installed runs), run k of one
    side against run k of the other (the same work: a workload's runs may differ from each other,
    a training step or a new prompt each): "equal" when every pair agrees; else "VARY" when a side's
    run k gives another checksum in another round (fresh processes repeating the same runs: the
    workload is not deterministic on the GPU, so a difference says nothing of the allocator), and
    "DIFFERS" when it does not (one round cannot tell the two apart). With the number of distinct
    checksums of each side."""
    pairs = [(a, b) for nat, ins in rounds for a, b in zip(nat, ins)]
    key = lambda run: repr(run["check"])  # noqa: E731

    def varies(side):  # a run index whose checksum is not the same in every round
        by_index: dict = {}
        for runs in side:
            for k, run in enumerate(runs):
                by_index.setdefault(k, set()).add(key(run))
        return any(len(v) > 1 for v in by_index.values())

    if all(key(a) == key(b) for a, b in pairs):
        verdict = "equal"
    else:
        verdict = "VARY" if varies([n for n, _ in rounds]) or varies([i for _, i in rounds]) else "DIFFERS"
    return verdict, len({key(a) for a, _ in pairs}), len({key(b) for _, b in pairs})


def gpu_side(ok):
    """For a workload that describes its GPU side (weights_graph), whether both sides launched the
    same kernels and how their weights were aligned: a line, or None."""
    described = [(x["native"].get("describe"), x["installed"].get("describe")) for x in ok]
    described = [(a, b) for a, b in described if a and b]
    if not described:
        return None
    a, b = described[0]
    ka, kb = a["kernels"], b["kernels"]
    if ka == kb:
        kernels = f"the same {len(ka)} kernels"
    else:
        at = next((i for i, (p, q) in enumerate(zip(ka, kb)) if p != q), min(len(ka), len(kb)))
        first = lambda k: k[at][:60] if at < len(k) else "(none)"
        kernels = (f"kernels DIFFER ({len(ka)} native, {len(kb)} installed; first at #{at}: "
                   f"{first(ka)} | {first(kb)})")
    return f"{kernels}; weight alignment, least: native {min(a['align'])} B, installed {min(b['align'])} B"


def paired(out):
    """Each installed run's seconds over the native run's next to it, in one round."""
    return [b["seconds"] / a["seconds"] for a, b in zip(out["native"]["runs"], out["installed"]["runs"])]


def main():
    if cuda_torch("bench_e2e", "real workloads end to end") is None:
        return 0
    rounds = int(os.environ.get("BENCH_E2E_ROUNDS", "2"))
    # 24 pairs a round: a run is short next to a process's start, and 16 pairs left a 95% interval
    # about ±10% wide on one H100, wider than the gaps it was asked about
    repeats = int(os.environ.get("BENCH_E2E_REPEATS", "24"))
    pin = os.environ.get("BENCH_E2E_PIN", "1") != "0"
    names = os.environ.get("BENCH_E2E_WORKLOADS", ",".join(WORKLOADS)).split(",")
    res = {n: [] for n in names}
    for r in range(rounds):
        for n in names:
            out = one_round(n, repeats, pin)
            res[n].append(out)
            if "error" in out:
                what = "FAILED: " + out["error"]
            else:
                what = (f"native {statistics.median(x['seconds'] for x in out['native']['runs']):.3f} s, installed "
                        f"{statistics.median(x['seconds'] for x in out['installed']['runs']):.3f} s, paired median "
                        f"{statistics.median(paired(out)):.3f}x")
            print(f"[round {r + 1}] {n}: {what}", file=sys.stderr, flush=True)
    print(f"{'workload':16} {'native s':>9} {'tb s':>9} {'x native':>9} {'95% interval':>13} {'<=1 in':>7} "
          f"{'native rsv MiB':>15} {'tb rsv MiB':>11} {'checks':>8} {'kinds':>6}")
    summary, failed = [], 0
    for n in names:
        ok = [x for x in res[n] if "error" not in x]
        if not ok:
            failed += 1
            print(f"{n:16} FAILED: {next((x['error'] for x in res[n]), 'no result')}")
            continue
        pairs = [(a, b) for x in ok for a, b in zip(x["native"]["runs"], x["installed"]["runs"])]
        ratios = [q for x in ok for q in paired(x)]
        per_round = [statistics.median(paired(x)) for x in ok]
        ratio = statistics.median(ratios)
        nat_rsv = statistics.median(x["native"]["peak_reserved"] for x in ok)
        tb_rsv = statistics.median(x["installed"]["peak_reserved"] for x in ok)
        verdict, native_kinds, tb_kinds = checks([(x["native"]["runs"], x["installed"]["runs"]) for x in ok])
        wins = sum(1 for q in ratios if q <= 1.0)
        # Pairs as draws of one ratio: an interval that excludes 1.0 says these runs tell the two apart.
        interval = median_interval(ratios)
        shown = f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else "too few"
        print(f"{n:16} {statistics.median(a['seconds'] for a, _ in pairs):9.3f} "
              f"{statistics.median(b['seconds'] for _, b in pairs):9.3f} {ratio:8.3f}x {shown:>13} {wins:>3}/{len(ratios):<3} "
              f"{nat_rsv / 2**20:15.0f} {tb_rsv / 2**20:11.0f} {verdict:>8} {native_kinds:>2}/{tb_kinds:<3}  rounds: "
              + " ".join(f"{x:.3f}" for x in per_round))
        summary.append(f"{n}={ratio:.3f}x[{shown}],rsv={tb_rsv / nat_rsv:.2f}{'' if verdict == 'equal' else ',CHECKS_' + verdict}")
    for n in names:
        line = gpu_side([x for x in res[n] if "error" not in x])
        if line:
            print(f"{n}: {line}")
    errors = [x["error"] for n in names for x in res[n] if "error" in x]
    print("(paired: each installed run over the native run next to it, the two processes taking turns; '<=1 in' "
          "counts the pairs at or under native; '95% interval' bounds the median ratio, pairs taken as independent draws (an "
          "interval holding 1.0: these runs cannot tell the two apart); peak reserved is each process's, medians over rounds; 'checks' "
          "compares the outputs' checksums run by run: equal, DIFFERS, or VARY where a side's run gives another "
          "checksum in another round (not deterministic: says nothing of the allocator); 'kinds' counts each "
          "side's distinct checksums, native/installed)")
    print("RESULT bench_e2e " + " ".join(summary) + (f" failed={failed}" if failed else "")
          + (f" failed_rounds={len(errors)}" if errors else ""))
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
