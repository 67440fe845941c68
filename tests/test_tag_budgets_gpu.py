"""Per-tag budgets on a device (Note [Tag budgets] in csrc/core/budget.h): CUDA tensors under a
tag past its budget raise torch's OutOfMemoryError naming the tag while other tags keep
serving; the tag's line sits inside the device budget; emptying the cache and a release /
restore keep its figures exact."""
import pytest
import torch  # importing touches no device: each body installs before its first allocation

import torch_budget
from torch_budget.units import MiB

pytestmark = pytest.mark.gpu


def test_a_tag_past_its_budget_raises_naming_it_and_the_others_keep_serving(fresh):
    out = fresh(tag_past_its_budget_raises_naming_it_and_the_others_keep_serving)
    assert "tag budgets ok" in out


def tag_past_its_budget_raises_naming_it_and_the_others_keep_serving():
    torch_budget.install(route="vmm", budgets={"kv": "64MiB"})
    with torch_budget.region("kv"):
        kv = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4)]  # the whole line
    try:
        with torch_budget.region("kv"):
            torch.empty(1, device="cuda")
        raise SystemExit("an allocation past the tag's budget went through")
    except torch.cuda.OutOfMemoryError as e:
        assert "tag 'kv' would exceed its budget of 64.00 MiB" in str(e), str(e)
    with torch_budget.region("weights"):
        w = torch.ones(256 * MiB // 4, device="cuda")  # no line of its own: only the device's budget
    x = torch.ones(1000, device="cuda") * 3             # untagged work goes on
    assert float(w.sum()) == 256 * MiB // 4 and float(x.sum()) == 3000
    st = torch_budget.stats()["by_tag"]
    assert st["kv"]["allocated"] == 64 * MiB and st["kv"]["headroom"] == 0, st["kv"]

    # Emptying the cache and a release / restore keep the tag's figures.
    del kv[0]
    torch.cuda.empty_cache()
    assert torch_budget.stats()["by_tag"]["kv"]["allocated"] == 48 * MiB
    kv[0].fill_(7)
    torch_budget.release("kv", backup="pinned")
    assert torch_budget.stats()["by_tag"]["kv"]["allocated"] == 48 * MiB   # released, still allocated
    torch_budget.restore("kv")
    assert int(kv[0][:1000].sum()) == 7000
    with torch_budget.region("kv"):
        kv.append(torch.empty(16 * MiB, dtype=torch.uint8, device="cuda"))  # the freed room, exactly
    assert torch_budget.stats()["by_tag"]["kv"]["headroom"] == 0

    # The tag's line is inside the device budget: a lower device budget refuses first, as the
    # device's refusal (no tag budget is involved for 'weights').
    torch_budget.set_budget(torch.cuda.memory_reserved() + 8 * MiB)
    try:
        with torch_budget.region("weights"):
            torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        raise SystemExit("an allocation past the device budget went through")
    except torch.cuda.OutOfMemoryError as e:
        assert "would exceed the budget of" in str(e) and "its budget" not in str(e), str(e)
    torch_budget.set_budget(1.0)
    with torch_budget.region("weights"):
        torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    print("tag budgets ok")
