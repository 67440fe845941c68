"""Two ranks over gloo on CPU: the planned KV budget is the min over ranks, exchanged in bytes."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import GiB
from torch_budget.budget import CacheCost, Profile, plan

REPO = Path(__file__).resolve().parent.parent

# Rank 1 has the smaller card *and* twice the bytes per token, so a min taken over tokens
# would pick rank 0's figure while the min over bytes picks rank 1's.
RANKS = {
    0: dict(total=80 * GiB, slope=64 * 1024),
    1: dict(total=60 * GiB, slope=128 * 1024),
}

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from torch_budget.budget import CacheCost, Profile, plan

    rank, port, total, slope = (int(a) for a in sys.argv[1:5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    GiB = 1 << 30
    prof = Profile.from_measurements(torch_peak=20 * GiB, torch_used=20 * GiB, total_used=21 * GiB,
                                     total=total, model_bytes=16 * GiB)
    p = plan(prof, CacheCost(slope=slope))
    dist.destroy_process_group()
    print(json.dumps({"kv_bytes": p.kv_bytes, "kv_tokens": p.kv_tokens, "world_size": p.world_size}))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_budget(total, slope):
    prof = Profile.from_measurements(torch_peak=20 * GiB, torch_used=20 * GiB, total_used=21 * GiB,
                                     total=total, model_bytes=16 * GiB)
    return plan(prof, CacheCost(slope=slope)).kv_bytes


def test_plan_budget_is_min_over_ranks_in_bytes():
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(rank), str(port), str(cfg["total"]), str(cfg["slope"])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for rank, cfg in RANKS.items()
    ]
    results = {}
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"rank {rank} failed:\n{err}"
            results[rank] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs:  # a rank left waiting on a dead peer would hang forever
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    local = {rank: _local_budget(cfg["total"], cfg["slope"]) for rank, cfg in RANKS.items()}
    assert local[0] != local[1]
    expected = min(local.values())
    for rank, cfg in RANKS.items():
        assert results[rank]["world_size"] == 2
        assert results[rank]["kv_bytes"] == expected
        assert results[rank]["kv_tokens"] == CacheCost(slope=cfg["slope"]).tokens_for_budget(expected)
