"""End to end: the three real workloads of tools/workloads.py, natively and under
torch_budget.install(), each in its own process, interleaved over rounds. Each process times its
part several times after a warm run and reports the median. Prints the timed part's seconds
(paired median ratio installed / native, and each round's ratio), peak reserved bytes of both,
and whether the outputs' checksums agree. The last line is `RESULT bench_e2e ...`.

Every process runs beside the GPU and times on one core there (workloads.py --pin), unless
BENCH_E2E_PIN=0.

Environment: BENCH_E2E_ROUNDS (3), BENCH_E2E_REPEATS (timed runs per process, 5),
BENCH_E2E_PIN (1), BENCH_E2E_WORKLOADS (comma-separated).
"""
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench import cuda_torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ["llama_generate", "resnet_amp", "decode_graphs"]


def run(name, installed):
    cmd = [sys.executable, os.path.join(HERE, "workloads.py"), name,
           "--repeats", os.environ.get("BENCH_E2E_REPEATS", "5")] + (["--install"] if installed else []) + \
        (["--pin"] if os.environ.get("BENCH_E2E_PIN", "1") != "0" else [])
    env = {**os.environ, "TORCH_BUDGET_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("WORKLOAD ")]
    if proc.returncode != 0 or not lines:
        return {"error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}
    return json.loads(lines[-1][9:])


def main():
    if cuda_torch("bench_e2e", "real workloads end to end") is None:
        return 0
    rounds = int(os.environ.get("BENCH_E2E_ROUNDS", "3"))
    names = os.environ.get("BENCH_E2E_WORKLOADS", ",".join(WORKLOADS)).split(",")
    res = {(n, i): [] for n in names for i in (False, True)}
    for r in range(rounds):
        for n in names:
            for installed in ((False, True) if r % 2 == 0 else (True, False)):
                out = run(n, installed)
                res[(n, installed)].append(out)
                what = out.get("error") or f"{out['seconds']:.3f} s, peak reserved {out['peak_reserved'] / 2**20:.0f} MiB"
                print(f"[round {r + 1}] {n} {'installed' if installed else 'native'}: {what}", file=sys.stderr,
                      flush=True)
    print(f"{'workload':16} {'native s':>9} {'tb s':>9} {'x native':>9} {'native rsv MiB':>15} {'tb rsv MiB':>11}"
          f" {'checks equal':>13}")
    summary, failed = [], 0
    for n in names:
        nat, tb = res[(n, False)], res[(n, True)]
        pairs = [(a, b) for a, b in zip(nat, tb) if "error" not in a and "error" not in b]
        if not pairs:
            failed += 1
            err = next((x["error"] for x in nat + tb if "error" in x), "no result")
            print(f"{n:16} FAILED: {err}")
            continue
        ratios = [b["seconds"] / a["seconds"] for a, b in pairs]
        ratio = statistics.median(ratios)
        nat_rsv = statistics.median(a["peak_reserved"] for a, _ in pairs)
        tb_rsv = statistics.median(b["peak_reserved"] for _, b in pairs)
        equal = all(a["check"] == b["check"] for a, b in pairs)
        print(f"{n:16} {statistics.median(a['seconds'] for a, _ in pairs):9.3f} "
              f"{statistics.median(b['seconds'] for _, b in pairs):9.3f} {ratio:8.2f}x {nat_rsv / 2**20:15.0f} "
              f"{tb_rsv / 2**20:11.0f} {str(equal):>13}  rounds: {' '.join(f'{x:.3f}' for x in ratios)}")
        summary.append(f"{n}={ratio:.2f}x,rsv={tb_rsv / nat_rsv:.2f}{'' if equal else ',CHECK_DIFFERS'}")
    print("RESULT bench_e2e " + " ".join(summary) + (f" failed={failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
