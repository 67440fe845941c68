"""Per-tag budgets (Note [Tag budgets] in csrc/core/budget.h) over the host stand-in: a tag's
budget limits what is allocated under it, inside the device's budget; passing it is an
out-of-memory error naming the tag while other tags keep serving; set_budget(tag=...),
install(budgets=...) and TORCH_BUDGET_CONF set it; stats() shows budget and headroom; emptying
the cache and a release / restore keep the tag's figures exact."""
import pytest
import torch

import torch_budget
from _hostcore import MiB, Host, isolated, python_api_over
from torch_budget import config
from torch_budget.errors import ConfigError, InvalidArgumentError

pytestmark = pytest.mark.built("_host_core")


def _installed_host(**install):
    host = Host(configure=False)
    python_api_over(host)
    torch_budget.install(**{"route": "vmm", **install})
    return host


def _under(host, tag, nbytes):
    with torch_budget.region(tag):
        return host.malloc(nbytes)


@isolated
def test_a_tag_past_its_budget_fails_naming_it_while_other_tags_keep_serving():
    host = _installed_host(budgets={"kv": "8MiB"})
    kept = [_under(host, "kv", 3 * MiB), _under(host, "kv", 5 * MiB)]  # exactly the budget
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        _under(host, "kv", 512)
    message = str(raised.value)
    for words in ("tag 'kv' would exceed its budget of 8.00 MiB", "it has 8.00 MiB allocated, 0 bytes left, and this allocation counts 512 bytes",
                  "set_budget(..., tag='kv')", "budgets={'kv': ...}", "TORCH_BUDGET_CONF=budget.kv:"):
        assert words in message, (words, message)
    weights = _under(host, "weights", 64 * MiB)  # no budget of its own: only the device's holds
    untagged = host.malloc(16 * MiB)
    st = torch_budget.stats()["by_tag"]
    assert st["kv"]["allocated"] == 8 * MiB and st["kv"]["budget"] == 8 * MiB and st["kv"]["headroom"] == 0
    assert st["weights"]["budget"] is None and st["weights"]["headroom"] is None
    assert torch_budget.stats()["raw"]["num_ooms"] == 1
    host.free(kept[0])  # freeing under the tag makes room again
    assert _under(host, "kv", 3 * MiB)
    for p in (weights, untagged):
        host.free(p)


@isolated
def test_the_exact_block_counts_not_the_request():
    host = _installed_host(budgets={"small": "4KiB"})
    _under(host, "small", 4000)  # rounded to 4096 bytes: the whole budget
    with pytest.raises(torch.cuda.OutOfMemoryError, match="tag 'small'"):
        _under(host, "small", 1)
    assert torch_budget.stats()["by_tag"]["small"]["allocated"] == 4096


@isolated
def test_a_cached_block_larger_than_the_request_counts_whole():
    host = _installed_host()
    with torch_budget.region("x", route="sync"):
        host.free(host.malloc(12 * MiB))  # one 12 MiB segment, cached
        torch_budget.set_budget("12032KiB", tag="x")  # 11.75 MiB
        reserved = torch_budget.stats()["reserved"]
        # 11.5 MiB fits the budget, but the cached block it would take is not split (the
        # rest is too small): 12 MiB would be charged.
        with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
            host.malloc(11 * MiB + 512 * 1024)
        assert ("tag 'x' would exceed its budget of 11.75 MiB: it has 0 bytes allocated, 11.75 MiB left, and this "
                "allocation counts 12.00 MiB (its block, rounded up)") in str(raised.value), str(raised.value)
        assert torch_budget.stats()["by_tag"]["x"]["allocated"] == 0
        assert torch_budget.stats()["reserved"] == reserved  # the block went back to the cache
        assert host.malloc(10 * MiB)  # split (2 MiB remain): 10 MiB charged
        assert torch_budget.stats()["by_tag"]["x"]["allocated"] == 10 * MiB


@isolated
def test_a_tag_budget_never_raises_the_device_budget():
    host = _installed_host(budget="32MiB", budgets={"kv": "1GiB"})
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        _under(host, "kv", 64 * MiB)
    assert "exceed the budget of 32.00 MiB" in str(raised.value), str(raised.value)
    assert _under(host, "kv", 16 * MiB)


@isolated
def test_set_budget_with_a_tag_sets_changes_and_removes_it():
    host = _installed_host()
    a = _under(host, "act", 6 * MiB)
    with pytest.raises(InvalidArgumentError, match="below what it already has allocated"):
        torch_budget.set_budget("4MiB", tag="act")
    torch_budget.set_budget("8MiB", tag="act")
    assert torch_budget.stats()["by_tag"]["act"]["headroom"] == 2 * MiB
    with pytest.raises(torch.cuda.OutOfMemoryError, match="tag 'act'"):
        _under(host, "act", 4 * MiB)
    torch_budget.set_budget(None, tag="act")  # removed
    b = _under(host, "act", 4 * MiB)
    assert torch_budget.stats()["by_tag"]["act"]["budget"] is None
    torch_budget.set_budget(0.5, tag="act")  # a fraction of the card, as for the device
    total = torch_budget.stats()["total"]
    assert torch_budget.stats()["by_tag"]["act"]["budget"] == total // 2
    with pytest.raises(ConfigError):
        torch_budget.set_budget(0, tag="act")
    with pytest.raises(TypeError):
        torch_budget.set_budget("1GiB", tag=3)
    for p in (a, b):
        host.free(p)


@isolated
def test_empty_cache_and_sleep_keep_a_tags_figures_exact():
    host = _installed_host(budgets={"weights": "16MiB"})
    w = _under(host, "weights", 12 * MiB)
    host.free(_under(host, "weights", 4 * MiB))  # cached, not allocated: room again
    torch_budget.empty_cache()
    assert torch_budget.stats()["by_tag"]["weights"]["headroom"] == 4 * MiB
    torch_budget.release("weights", backup="pinned")
    assert torch_budget.stats()["by_tag"]["weights"]["allocated"] == 12 * MiB  # a restore brings it back
    torch_budget.restore("weights")
    with pytest.raises(torch.cuda.OutOfMemoryError, match="tag 'weights'"):
        _under(host, "weights", 5 * MiB)
    assert _under(host, "weights", 4 * MiB)
    host.free(w)


@isolated
def test_torch_budget_conf_sets_tag_budgets(monkeypatch):
    monkeypatch.setenv(config.ENV_VAR, "budget.kv:2MiB, budget.graphs:0.25")
    settings = _installed_host()
    del settings
    st = torch_budget.stats()
    assert st["by_tag"]["kv"]["budget"] == 2 * MiB
    assert st["by_tag"]["graphs"]["budget"] == round(st["total"] * 0.25)
    assert torch_budget.install()["budgets"] == {"kv": ("bytes", 2 * MiB), "graphs": ("fraction", 0.25)}


@isolated
def test_install_budgets_and_torch_budget_conf_merge_per_tag(monkeypatch):
    from torch_budget.errors import InstallError

    monkeypatch.setenv(config.ENV_VAR, "budget.kv:2MiB, budget.graphs:0.25")
    _installed_host(budgets={"kv": "4MiB", "weights": "8MiB"})  # kv given: the call's; graphs: the variable's
    expected = {"kv": ("bytes", 4 * MiB), "graphs": ("fraction", 0.25), "weights": ("bytes", 8 * MiB)}
    assert torch_budget.install()["budgets"] == expected
    by_tag = torch_budget.stats()["by_tag"]
    assert (by_tag["kv"]["budget"], by_tag["weights"]["budget"]) == (4 * MiB, 8 * MiB)
    assert torch_budget.install(budgets={"weights": "8MiB"})["budgets"] == expected  # agrees per tag
    with pytest.raises(InstallError, match="budgets"):
        torch_budget.install(budgets={"kv": "2MiB"})


def test_tag_budget_settings_are_checked_before_anything_is_installed():
    assert config.parse_conf("budget.kv:8GiB") == {"budgets": {"kv": ("bytes", 8 << 30)}}
    with pytest.raises(ValueError, match="budget.kv is given twice"):
        config.parse_conf("budget.kv:8GiB,budget.kv:4GiB")
    with pytest.raises(ValueError, match="non-empty"):
        config.parse_conf("budget.:8GiB")
    with pytest.raises(ValueError, match="has no unit"):
        config.parse_budgets({"kv": 1})
    with pytest.raises(TypeError, match="dict of tag name to budget"):
        config.parse_budgets(["kv"])
