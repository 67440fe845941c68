"""The ledger shows each tag's own budget, what is allocated under it and its headroom: the
table, the picture, the JSON the demo saves and `torch-budget report` reads, and the reading
of torch_budget.stats() (over the host stand-in)."""
import json

import pytest

from _hostcore import Host, isolated, python_api_over
from conftest import GiB, MiB
from torch_budget import cli
from torch_budget.report import (TagBudget, format_table, ledger_json, load_ledger, load_report,
                                 measured_ledger, tag_budgets, write_png)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

BUDGETS = [TagBudget("graphs", 512 * MiB, 384 * MiB, 448 * MiB, "graph_pools", "graph pools, graph workspace"),
           TagBudget("kv", 40 * GiB, 40 * GiB - 3 * MiB, 40 * GiB, "kv_pool", "KV pool"),
           TagBudget("weights", 16 * GiB, 16 * GiB, None, "weights", "weights")]


def ledger():
    return measured_ledger(80 * GiB, weights=16 * GiB, kv_pool=40 * GiB, graph_pools=384 * MiB)


def budget_table(text):
    """The header and the rows of the budget table."""
    part = text.split("tag budgets:", 1)[1].splitlines()
    rows = []
    for row in part[3:]:
        if not row.strip():
            break
        rows.append(row)
    return part[1], rows


def budget_rows(text):
    """The cells of the budget table's rows, by tag."""
    return {row.split()[0]: row.split() for row in budget_table(text)[1]}


def test_headroom_is_budget_minus_what_is_allocated_under_the_tag():
    assert BUDGETS[0].headroom == 128 * MiB and BUDGETS[1].headroom == 3 * MiB and BUDGETS[2].headroom == 0


def test_the_table_shows_each_budgeted_tags_budget_use_headroom_and_peak():
    text = format_table(ledger(), 80 * GiB, "measured", BUDGETS)
    rows = budget_rows(text)
    assert rows["graphs"][:9] == ["graphs", "512.0", "MiB", "384.0", "MiB", "128.0", "MiB", "448.0", "MiB"], rows
    assert rows["graphs"][9] == "87.5%" and " ".join(rows["graphs"][10:]) == "graph pools, graph workspace"
    assert rows["kv"][5:7] == ["3.0", "MiB"]
    assert rows["weights"][7:9] == ["-", "-"], "an unknown peak is shown as unknown, not as 0"
    header, _ = budget_table(text)
    assert header.split() == ["tag", "budget", "in", "use", "headroom", "peak", "peak/budget", "bounds"]


def test_a_ledger_without_budgets_has_no_budget_table():
    assert "tag budgets" not in format_table(ledger(), 80 * GiB)


def test_budget_columns_are_right_aligned():
    header, rows = budget_table(format_table(ledger(), 80 * GiB, budgets=BUDGETS))
    end = header.index("budget") + len("budget")
    assert all(row[end - 3:end] in ("MiB", "GiB") and row[end] == " " for row in rows), (header, rows)


@pytest.mark.parametrize("bad,message", [
    (dict(budget=-1), "negative budget"),
    (dict(used=-1), "negative used"),
    (dict(category="snacks"), "category 'snacks'"),
])
def test_a_tag_budget_refuses_what_a_ledger_cannot_hold(bad, message):
    with pytest.raises(ValueError, match=message):
        TagBudget(**{"tag": "kv", "budget": GiB, "used": 0, **bad})


def test_budgets_survive_the_json_form_and_a_plan_reads_with_none(tmp_path):
    src = tmp_path / "measured.json"
    src.write_text(ledger_json("measured", 80 * GiB, ledger(), BUDGETS))
    assert load_report(src) == ("measured", 80 * GiB, ledger(), BUDGETS)
    assert load_ledger(src) == ("measured", 80 * GiB, ledger())
    src.write_text(ledger_json("no budgets", 80 * GiB, ledger()))
    assert "budgets" not in json.loads(src.read_text()) and load_report(src)[3] == []


def test_budgets_that_are_not_a_list_are_refused(tmp_path):
    src = tmp_path / "bad.json"
    lines = [{"name": "headroom", "category": "headroom", "bytes": GiB}]
    src.write_text(json.dumps({"total": GiB, "lines": lines, "budgets": {"kv": 1}}))
    with pytest.raises(ValueError, match="'budgets' must be a list"):
        load_report(src)
    src.write_text(json.dumps({"total": GiB, "lines": lines, "budgets": [{"tag": "kv", "used": 1}]}))
    with pytest.raises(ValueError, match="lacks the key 'budget'"):
        load_report(src)


@pytest.mark.parametrize("data, said", [
    ({"total": GiB, "lines": [5]}, "a ledger line must be an object"),
    ({"total": "abc", "lines": []}, "'total' must be the card's bytes"),
    ({"total": True, "lines": []}, "'total' must be the card's bytes"),
    ({"total": GiB, "lines": {}}, "'lines' must be a list"),
    ({"total": GiB, "lines": [{"name": "kv", "category": "kv", "bytes": "many"}]}, "'bytes' must be an integer"),
])
def test_a_ledger_of_the_wrong_shape_is_refused_naming_the_file_and_the_field(tmp_path, data, said):
    src = tmp_path / "bad.json"
    src.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=said) as e:
        load_report(src)
    assert "bad.json" in str(e.value)


def test_the_report_command_shows_the_budgets_of_a_measured_ledger(tmp_path, capsys):
    src = tmp_path / "measured.json"
    src.write_text(ledger_json("measured", 80 * GiB, ledger(), BUDGETS))
    assert cli.main(["report", str(src)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("picture written to")
    rows = budget_rows(out.rsplit("\npicture written", 1)[0])
    assert set(rows) == {"graphs", "kv", "weights"} and rows["kv"][5:7] == ["3.0", "MiB"]
    assert (tmp_path / "measured.png").read_bytes()[:8] == PNG_SIGNATURE


def test_the_picture_with_budgets_is_a_taller_valid_png(tmp_path):
    from PIL import Image

    plain = write_png(ledger(), 80 * GiB, tmp_path / "plain.png")
    with_budgets = write_png(ledger(), 80 * GiB, tmp_path / "budgets.png", "measured", BUDGETS)
    sizes = []
    for path in (plain, with_budgets):
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            sizes.append(img.size)
    assert sizes[1][1] > sizes[0][1] + 100, sizes


def test_tag_budgets_reads_only_tags_with_a_budget_from_stats():
    by_tag = {"weights": {"allocated": 2 * GiB, "peak_allocated": 2 * GiB, "budget": 2 * GiB, "headroom": 0},
              "untagged": {"allocated": MiB, "peak_allocated": MiB, "budget": None, "headroom": None},
              "activations": {"allocated": MiB, "peak_allocated": 5 * MiB, "budget": 8 * MiB, "headroom": 7 * MiB}}
    out = tag_budgets(by_tag, {"activations": ("activations", "activations")})
    assert out == [TagBudget("activations", 8 * MiB, MiB, 5 * MiB, "activations", "activations"),
                   TagBudget("weights", 2 * GiB, 2 * GiB, 2 * GiB, "reserve", "")]


@pytest.mark.built("_host_core")
@isolated
def test_tag_budgets_read_off_the_ledger_match_what_was_set_and_allocated():
    import torch_budget

    host = Host(configure=False)
    python_api_over(host)
    torch_budget.install(route="vmm", budgets={"kv": "8MiB"})
    with torch_budget.region("kv"):
        host.malloc(3 * MiB)
        host.free(host.malloc(2 * MiB))  # the peak saw 5 MiB
    with torch_budget.region("weights"):
        host.malloc(4 * MiB)
    [kv] = tag_budgets(torch_budget.stats()["by_tag"], {"kv": ("kv_pool", "KV pool")})
    assert kv == TagBudget("kv", 8 * MiB, 3 * MiB, 5 * MiB, "kv_pool", "KV pool")
    assert kv.headroom == torch_budget.stats()["by_tag"]["kv"]["headroom"] == 5 * MiB


def test_a_budgeted_tags_use_counts_its_familys_tags():
    from torch_budget.report.measure import tag_budgets

    by_tag = {"kv": {"budget": 8 * MiB, "allocated": 4 * MiB}, "kv+cpu": {"budget": None, "allocated": 3 * MiB},
              "kvx": {"budget": None, "allocated": 5 * MiB}}
    (kv,) = tag_budgets(by_tag)
    assert (kv.tag, kv.used) == ("kv", 7 * MiB)  # "kvx" is not of the family


def test_a_family_heads_peak_is_unknown_once_another_tag_of_its_family_allocated():
    """The ledger keeps each tag's own peak, not its family's (Note [Tag families]): kv's own 1 MiB
    is no peak of the 7 MiB its budget bounds now."""
    from torch_budget.report.measure import tag_budgets

    by_tag = {"kv": {"budget": 8 * MiB, "allocated": 1 * MiB, "peak_allocated": 1 * MiB},
              "kv+cpu": {"budget": None, "allocated": 6 * MiB, "peak_allocated": 6 * MiB},
              "weights": {"budget": 8 * MiB, "allocated": 2 * MiB, "peak_allocated": 3 * MiB},
              "weights+cpu": {"budget": None, "allocated": 0, "peak_allocated": 0}}
    kv, weights = tag_budgets(by_tag)
    assert (kv.used, kv.peak) == (7 * MiB, None)
    assert (weights.used, weights.peak) == (2 * MiB, 3 * MiB)  # its family allocated nothing else
