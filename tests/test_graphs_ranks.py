"""Two ranks over gloo on CPU agree on the graph key (bucket, tier) before replaying."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from torch_budget.graphs import GraphPoolManager

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    choices = json.loads(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    manager = GraphPoolManager("cpu")
    agreed = [list(manager.agree(bucket, tier)) for bucket, tier in choices]
    dist.destroy_process_group()
    print(json.dumps(agreed))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agree_on_two_ranks(rank0, rank1):
    """Run manager.agree for each (bucket, tier) pair on two gloo ranks; return each rank's answers."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(rank), str(port), json.dumps(choices)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for rank, choices in enumerate([rank0, rank1])
    ]
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"rank {rank} did not finish within 120 s")
        if proc.returncode != 0:
            pytest.fail(f"rank {rank} failed (rc={proc.returncode})\n{out}\n{err}")
        results.append([tuple(pair) for pair in json.loads(out.strip().splitlines()[-1])])
    return results


def test_ranks_agree_on_their_key_or_fall_back_to_the_most_conservative():
    rank0 = [[16, "full"], [8, "full"], [16, "full"], [32, "piecewise"], [None, "full"], [4, 0]]
    rank1 = [[16, "full"], [32, "full"], [16, "piecewise"], [8, "full"], [64, "full"], [4, 2]]
    r0, r1 = _agree_on_two_ranks(rank0, rank1)
    assert r0 == r1, "ranks left agree() with different keys"
    assert r0 == [
        (16, "full"),        # same choice everywhere: kept
        (32, "full"),        # buckets differ: the largest, so every rank's rows fit
        (16, "piecewise"),   # tiers differ: the most conservative tier
        (32, "piecewise"),   # both differ: each falls back on its own axis
        (None, "full"),      # one rank must run eagerly: all run eagerly
        (4, 2),              # integer tiers: larger is more conservative
    ]
