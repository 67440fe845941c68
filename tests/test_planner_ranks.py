"""Two ranks over gloo on CPU: the planned KV budget is the min over ranks, exchanged in bytes."""

import json

from conftest import GiB
from torch_budget.planner import CacheCost, Profile, plan

# Rank 1 has the smaller card *and* twice the bytes per token, so a min taken over tokens
# would pick rank 0's figure while the min over bytes picks rank 1's.
RANKS = {
    0: dict(total=80 * GiB, slope=64 * 1024),
    1: dict(total=60 * GiB, slope=128 * 1024),
}

CHILD = """
import json, os, sys
import torch.distributed as dist
from torch_budget.planner import CacheCost, Profile, plan

total, slope = (int(a) for a in sys.argv[1:3])
dist.init_process_group("gloo", init_method=os.environ["TB_INIT_METHOD"], rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
GiB = 1 << 30
prof = Profile.from_measurements(torch_peak=20 * GiB, torch_used=20 * GiB, total_used=21 * GiB,
                                 total=total, model_bytes=16 * GiB)
p = plan(prof, CacheCost(slope=slope))
dist.destroy_process_group()
print(json.dumps({"kv_bytes": p.kv_bytes, "kv_tokens": p.kv_tokens, "world_size": p.world_size}))
"""


def _local_budget(total, slope):
    prof = Profile.from_measurements(torch_peak=20 * GiB, torch_used=20 * GiB, total_used=21 * GiB,
                                     total=total, model_bytes=16 * GiB)
    return plan(prof, CacheCost(slope=slope)).kv_bytes


def test_plan_budget_is_min_over_ranks_in_bytes(ranks):
    outs = ranks(CHILD, 2, timeout=120, rank_args=[[cfg["total"], cfg["slope"]] for cfg in RANKS.values()])
    results = {rank: json.loads(out.strip().splitlines()[-1]) for rank, out in enumerate(outs)}
    local = {rank: _local_budget(cfg["total"], cfg["slope"]) for rank, cfg in RANKS.items()}
    assert local[0] != local[1]
    expected = min(local.values())
    for rank, cfg in RANKS.items():
        assert results[rank]["world_size"] == 2
        assert results[rank]["kv_bytes"] == expected
        assert results[rank]["kv_tokens"] == CacheCost(slope=cfg["slope"]).tokens_for_budget(expected)


WORKSPACE_CHILD = """
import json, os, sys
import torch.distributed as dist
from torch_budget.planner import CacheCost, Profile, plan

non_torch, per_token = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=os.environ["TB_INIT_METHOD"], rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
GiB = 1 << 30
prof = Profile.from_measurements(torch_peak=20 * GiB, torch_used=20 * GiB, total_used=20 * GiB + non_torch,
                                 total=80 * GiB, model_bytes=16 * GiB)
p = plan(prof, CacheCost(slope=64 * 1024), workspace_bytes_per_token=per_token, max_batch=64, max_num_tokens=8192,
         max_seq_len=1 << 20)
import torch
after = torch.ones(1)
dist.all_reduce(after)  # the caller's next collective meets the same one on every rank
dist.destroy_process_group()
lines = [line.bytes for line in p.lines if line.name == "per-token workspace"]
print(json.dumps({"kv_bytes": p.kv_bytes, "workspace_tokens": p.workspace_tokens,
                  "workspace": lines[0] if lines else 0, "after": int(after.item())}))
"""


def test_the_workspaces_admission_cap_is_one_for_all_ranks(ranks):
    """1 GiB and 9 GiB outside torch: each rank's own split gives another cap; a scheduler admitting
    up to rank 0's would take rank 1's workspace past its line."""
    outs = ranks(WORKSPACE_CHILD, 2, timeout=120, rank_args=[[1 * GiB, 1024], [9 * GiB, 1024]])
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert [r["after"] for r in results] == [2, 2]
    assert results[0]["kv_bytes"] == results[1]["kv_bytes"]
    assert results[0]["workspace_tokens"] == results[1]["workspace_tokens"] > 0
    assert results[0]["workspace"] == results[1]["workspace"] == results[0]["workspace_tokens"] * 1024


def test_ranks_with_and_without_a_workspace_run_the_same_collectives(ranks):
    """One rank plans a per-token workspace, the other none (a pipeline stage without it): both run
    one collective in plan(), so the caller's next one pairs up on every rank."""
    outs = ranks(WORKSPACE_CHILD, 2, timeout=120, rank_args=[[1 * GiB, 1024], [1 * GiB, 0]])
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert [r["after"] for r in results] == [2, 2]
    assert results[0]["workspace_tokens"] > 0 and results[1]["workspace_tokens"] == 0


def test_a_rank_whose_workspace_admits_no_token_caps_every_rank(ranks):
    """Rank 1 has no KV budget left (60 GiB outside torch on an 80 GiB card), so its workspace admits
    nothing: every rank's cap is that 0, or rank 0 would admit what rank 1 cannot hold."""
    outs = ranks(WORKSPACE_CHILD, 2, timeout=120, rank_args=[[1 * GiB, 1024], [60 * GiB, 1024]])
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert [r["workspace_tokens"] for r in results] == [0, 0]
