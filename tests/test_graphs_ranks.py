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
