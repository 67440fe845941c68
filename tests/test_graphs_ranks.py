"""Two ranks over gloo on CPU agree on the graph key (bucket, tier) before replaying."""

import json
import os


def agree(choices):
    """One rank: manager.agree for each (bucket, tier) pair; prints the agreed keys as JSON."""
    import torch.distributed as dist
    from torch_budget.graphs import GraphPoolManager

    dist.init_process_group("gloo", init_method=os.environ["TB_INIT_METHOD"], rank=int(os.environ["RANK"]),
                            world_size=2)
    manager = GraphPoolManager("cpu")
    agreed = [list(manager.agree(bucket, tier)) for bucket, tier in choices]
    dist.destroy_process_group()
    print(json.dumps(agreed))


def _agree_on_two_ranks(ranks, rank0, rank1):
    """Run manager.agree for each (bucket, tier) pair on two gloo ranks; return each rank's answers."""
    outs = ranks(agree, 2, timeout=120, rank_args=[[rank0], [rank1]])
    return [[tuple(pair) for pair in json.loads(out.strip().splitlines()[-1])] for out in outs]


def test_ranks_agree_on_their_key_or_fall_back_to_the_most_conservative(ranks):
    rank0 = [[16, "full"], [8, "full"], [16, "full"], [32, "piecewise"], [None, "full"], [4, 0]]
    rank1 = [[16, "full"], [32, "full"], [16, "piecewise"], [8, "full"], [64, "full"], [4, 2]]
    r0, r1 = _agree_on_two_ranks(ranks, rank0, rank1)
    assert r0 == r1, "ranks left agree() with different keys"
    assert r0 == [
        (16, "full"),        # same choice everywhere: kept
        (32, "full"),        # buckets differ: the largest, so every rank's rows fit
        (16, "piecewise"),   # tiers differ: the most conservative tier
        (32, "piecewise"),   # both differ: each falls back on its own axis
        (None, "full"),      # one rank must run eagerly: all run eagerly
        (4, 2),              # integer tiers: larger is more conservative
    ]


def agree_or_raise(choices, tiers):
    """One rank: manager.agree for each (bucket, tier) pair with a manager listing `tiers`;
    prints each answer, or the exception's type, as JSON."""
    import torch.distributed as dist
    from torch_budget.graphs import GraphPoolManager

    dist.init_process_group("gloo", init_method=os.environ["TB_INIT_METHOD"], rank=int(os.environ["RANK"]),
                            world_size=2)
    manager = GraphPoolManager("cpu", tiers=tiers)
    answers = []
    for bucket, tier in choices:
        try:
            answers.append(list(manager.agree(bucket, tier)))
        except (TypeError, ValueError) as e:
            answers.append(type(e).__name__)
    dist.destroy_process_group()
    print(json.dumps(answers))


def test_a_choice_one_rank_refuses_raises_on_every_rank_and_the_next_agreement_still_works(ranks):
    tiers = ["full", "piecewise", "eager"]
    # 2**62 is the code the exchange uses for "this rank runs eagerly": a bucket that large is refused, not read
    # as eager by every rank
    rank0 = [[8, "full"], [8, "full"], [0, "full"], [8, 2.5], [2**62, "full"], [16, "full"]]
    rank1 = [[8, 7], [8, "turbo"], [8, "full"], [8, "full"], [8, "full"], [8, "eager"]]
    outs = ranks(agree_or_raise, 2, timeout=120, rank_args=[[rank0, tiers], [rank1, tiers]])
    r0, r1 = (json.loads(out.strip().splitlines()[-1]) for out in outs)
    assert r0 == ["InvalidArgumentError"] * 3 + ["TypeError", "InvalidArgumentError", [16, "eager"]]
    assert r1 == ["InvalidArgumentError"] * 5 + [[16, "eager"]]


def test_ranks_whose_managers_list_different_tiers_all_raise(ranks):
    choices = [[8, 0], [8, 1]]
    outs = ranks(agree_or_raise, 2, timeout=120,
                 rank_args=[[choices, ["full", "piecewise"]], [choices, ["full", "eager"]]])
    assert [json.loads(out.strip().splitlines()[-1]) for out in outs] == [["InvalidArgumentError"] * 2] * 2


def agree_over_runners(runner_buckets, choices):
    """One rank: runners named by `runner_buckets` (name -> this rank's buckets), then
    manager.agree(bucket, "full", runner=runners[name]) for each (name, bucket) in `choices` (name
    None: no runner); prints each agreed bucket as JSON, after checking the rank's runner has it."""
    import torch
    import torch.distributed as dist
    from torch_budget.graphs import GraphPoolManager, StaticInput

    dist.init_process_group("gloo", init_method=os.environ["TB_INIT_METHOD"], rank=int(os.environ["RANK"]),
                            world_size=2)
    manager = GraphPoolManager("cpu")
    runners = {name: manager.runner(name, lambda b: {"y": b["x"] * 2}, buckets=buckets,
                                    inputs=[StaticInput("x", torch.float32, ())])
               for name, buckets in runner_buckets.items()}
    agreed = []
    for name, bucket in choices:
        runner = runners.get(name)
        got, _ = manager.agree(bucket, "full", runner=runner)
        assert runner is None or got is None or got in runner.buckets, f"agreed on {got}, not among {runner.buckets}"
        agreed.append(got)
    dist.destroy_process_group()
    print(json.dumps(agreed))


def test_ranks_agree_only_on_a_bucket_every_ranks_runner_has_or_all_run_eagerly(ranks):
    # Bucket 8 failed to capture on rank 1 (capture() goes on past a failed bucket, so the ranks' buckets may
    # differ): agree() took the largest choice, 8, and rank 1's step raised while rank 0 replayed its
    # collectives and waited for it.
    rank0 = {"a": [2, 4, 8, 16], "b": [2, 8]}
    rank1 = {"a": [2, 4, 16], "b": [2, 16]}
    choices0 = [["a", 8], ["a", 4], ["a", 3], ["a", 9], ["a", 2], ["b", 8], ["b", 2], ["b", 2], ["a", 8]]
    choices1 = [["a", 4], ["a", 8], ["a", 2], ["a", 2], ["a", None], ["b", 4], ["b", 2], ["b", 4], [None, 4]]
    outs = ranks(agree_over_runners, 2, timeout=120, rank_args=[[rank0, choices0], [rank1, choices1]])
    r0, r1 = (json.loads(out.strip().splitlines()[-1]) for out in outs)
    assert r0 == r1, "ranks left agree() with different buckets"
    assert r0 == [
        16,    # the largest choice, 8, is not rank 1's: rank 1 rounds up to 16, which rank 0 has too
        16,    # rank 1 pads its 8 rows to its own bucket, 16, before the exchange
        4,     # 3 rows pad to 4 on rank 0; rank 1's 2 fits in it
        16,    # 9 rows pad to 16
        None,  # one rank runs eagerly: all do
        None,  # 8 is rank 0's largest, 16 rank 1's: no bucket both have, so all run eagerly
        2,     # both chose 2: kept
        None,  # rank 1 pads 4 to 16, which rank 0 lacks
        8,     # a rank that names no runner takes any bucket
    ]
