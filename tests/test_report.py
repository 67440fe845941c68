import json

import pytest

from conftest import GiB, MiB
from torch_budget import cli
from torch_budget.planner import CacheCost, Profile, Reserve, plan
from torch_budget.report import LedgerLine, format_table, load_ledger, measured_ledger, write_png
from torch_budget.units import format_bytes


def cli_report(args):
    return cli.main(["report", *args])

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def sample_plan():
    prof = Profile.from_measurements(torch_peak=20 * GiB, torch_used=21 * GiB, total_used=22 * GiB,
                                     total=80 * GiB, model_bytes=16 * GiB)
    return plan(prof, CacheCost(slope=128 * 1024),
                beside_peak=[Reserve("encoder outputs", 1 * GiB, "vision tower")],
                from_kv=[Reserve("decode graphs", 2 * GiB, "captured after KV", "graph_pools")],
                title="sample")


def test_format_bytes_uses_gib_from_one_gib_and_mib_below():
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    assert format_bytes(512 * MiB) == "512.0 MiB"
    assert format_bytes(-2 * GiB) == "-2.00 GiB"


def test_table_shows_each_line_with_size_and_share_of_card():
    lines = measured_ledger(80 * GiB, weights=16 * GiB, kv_pool=40 * GiB, activations=512 * MiB)
    text = format_table(lines, 80 * GiB, title="measured")
    rows = {row.split()[0]: row for row in text.splitlines()}
    assert "16.00 GiB" in rows["weights"] and "20.0%" in rows["weights"]
    assert "512.0 MiB" in rows["activations"] and "0.6%" in rows["activations"]
    assert "23.50 GiB" in rows["headroom"] and "29.4%" in rows["headroom"]
    assert text.splitlines()[0] == "measured"


def test_table_columns_are_aligned():
    text = format_table(sample_plan().lines, 80 * GiB)
    rows = [r for r in text.splitlines() if "%" in r and not r.startswith("line")]
    ends = {r.index("%") for r in rows}
    assert len(ends) == 1, text


def test_table_totals_match_the_card_for_a_plan():
    p = sample_plan()
    text = format_table(p.lines, p.total)
    assert text.count("80.00 GiB") >= 2 and "100.0%" in text


def test_measured_ledger_headroom_is_what_is_left_and_zero_lines_are_dropped():
    lines = measured_ledger(10 * GiB, weights=4 * GiB, non_torch=1 * GiB)
    assert [line.category for line in lines] == ["weights", "non_torch", "headroom"]
    assert lines[-1].bytes == 5 * GiB


def test_measured_ledger_puts_the_allocator_cache_after_non_torch():
    lines = measured_ledger(10 * GiB, weights=4 * GiB, non_torch=1 * GiB, allocator_cache=256 * MiB,
                            reserves=128 * MiB)
    assert [(line.name, line.category) for line in lines] == [
        ("weights", "weights"), ("non-torch", "non_torch"), ("allocator cache", "allocator_cache"),
        ("reserves", "reserve"), ("headroom", "headroom")]
    assert sum(line.bytes for line in lines) == 10 * GiB


def test_every_category_has_a_colour():
    from torch_budget.report import CATEGORIES
    from torch_budget.report.picture import COLOURS

    assert list(COLOURS) == list(CATEGORIES)


def test_ledger_line_rejects_unknown_category_and_negative_bytes():
    with pytest.raises(ValueError, match="category"):
        LedgerLine("x", "snacks", 1, "")
    with pytest.raises(ValueError, match="negative"):
        LedgerLine("weights", "weights", -1, "")
    assert LedgerLine("headroom", "headroom", -1, "over").bytes == -1


def test_png_is_written_and_is_a_valid_png(tmp_path):
    from PIL import Image

    p = sample_plan()
    out = write_png(p.lines, p.total, tmp_path / "ledger.png", title=p.title)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(out) as img:
        img.verify()
    with Image.open(out) as img:
        width, height = img.size
    assert width > 800 and height > 200


def test_png_of_an_overcommitted_ledger_is_still_drawn(tmp_path):
    lines = [LedgerLine("weights", "weights", 9 * GiB, ""), LedgerLine("headroom", "headroom", -1 * GiB, "over")]
    out = write_png(lines, 8 * GiB, tmp_path / "over.png")
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_cli_report_prints_table_and_writes_png(tmp_path, capsys):
    p = sample_plan()
    src = tmp_path / "plan.json"
    src.write_text(p.to_json())
    out = tmp_path / "ledger.png"
    assert cli_report([str(src), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "KV pool" in text and "decode graphs" in text and "sample" in text
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_cli_report_default_png_sits_beside_the_ledger(tmp_path, capsys):
    src = tmp_path / "measured.json"
    lines = measured_ledger(8 * GiB, weights=2 * GiB)
    src.write_text(json.dumps({"total": 8 * GiB, "lines": [line.to_dict() for line in lines]}))
    assert cli_report([str(src)]) == 0
    assert (tmp_path / "measured.png").read_bytes()[:8] == PNG_SIGNATURE


def test_load_ledger_reads_a_plan_file(tmp_path):
    p = sample_plan()
    src = tmp_path / "plan.json"
    src.write_text(p.to_json())
    title, total, lines = load_ledger(src)
    assert (title, total, lines) == (p.title, p.total, p.lines)


HEADROOM = '[{"name": "headroom", "category": "headroom", "bytes": 100}]'  # the lines of a 100-byte card


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ('{"lines": []}', "'total'"),
    ('{"total": -5, "lines": []}', "'total' (-5) must be more than 0"),
    ('{"total": 1%s, "lines": []}' % ("0" * 400), "less than 2**63"),  # format_bytes' float overflowed
    ('{"total": 100, "lines": [{"name": "w", "category": "weights", "bytes": 1%s}]}' % ("0" * 400), "less than 2**63"),
    ('{"total": 100, "lines": %s, "budgets": [{"tag": "kv", "budget": 1%s, "used": 0}]}' % (HEADROOM, "0" * 400),
     "budget 1000000000000000000000"),
    ('{"total": 100, "lines": [{"name": "w", "category": "weights"}]}', "'bytes'"),
    ('{"total": 100, "lines": [{"name": "w", "category": "nope", "bytes": 1}]}', "nope"),
    # each of these three was a traceback (AttributeError, TypeError, TypeError) and exit 1
    ('{"total": 100, "lines": ' + HEADROOM + ', "budgets": ["kv"]}', "a tag budget must be an object"),
    ('{"total": 100, "lines": ' + HEADROOM + ', "budgets": [{"tag": "kv", "budget": null, "used": 0}]}',
     "'budget' must be"),
    ('{"total": 100, "lines": ' + HEADROOM + ', "title": 5}', "'title' must be a string"),
    # these two were drawn and exited 0: a ledger's lines add up to the card
    ('{"total": 100, "lines": []}', "'lines' is empty"),
    ('{"total": 1000, "lines": [{"name": "w", "category": "weights", "bytes": 9223372036854775807}, '
     '{"name": "v", "category": "weights", "bytes": 9223372036854775807}]}',
     "its lines add up to 18446744073709551614 bytes, not the card's 'total' of 1000"),
])
def test_cli_report_bad_input_exits_2_with_a_message(tmp_path, capsys, content, message):
    src = tmp_path / "ledger.json"
    if content is not None:
        src.write_text(content)
    assert cli_report([str(src)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _saved_plan(tmp_path):
    src = tmp_path / "plan.json"
    src.write_text(sample_plan().to_json())
    return src


def test_cli_report_out_into_a_missing_folder_fails_before_the_table(tmp_path, capsys):
    src = _saved_plan(tmp_path)
    assert cli_report([str(src), "--out", str(tmp_path / "pictures" / "ledger.png")]) == 2
    out, err = capsys.readouterr()
    assert f"the folder '{tmp_path / 'pictures'}' does not exist; create it first (no folder is created)" in err
    assert "KV pool" not in out and not (tmp_path / "pictures").exists()


def test_cli_report_out_that_is_a_folder_says_so_without_an_errno(tmp_path, capsys):
    src = _saved_plan(tmp_path)
    assert cli_report([str(src), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"'{tmp_path}' is a folder; give a file path" in err and "Errno" not in err


@pytest.mark.parametrize("out", [None, "same"])
def test_cli_report_never_writes_its_picture_over_the_ledger(tmp_path, capsys, out):
    src = _saved_plan(tmp_path)
    if out is None:  # a ledger named .png: the picture's default path is the ledger itself
        src = src.rename(tmp_path / "ledger.png")
    before = src.read_bytes()
    assert cli_report([str(src)] + ([] if out is None else ["--out", str(src)])) == 2
    assert "is the ledger itself" in capsys.readouterr().err and src.read_bytes() == before


@pytest.mark.parametrize("content,message", [(b"\x1f\x8b\x08binary", "is not text (UTF-8)"),
                                             (b"[" * 100000 + b"]" * 100000, "nests its JSON too deep")])
def test_cli_report_and_plan_name_a_file_they_cannot_read_as_json(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert cli_report([str(bad)]) == 2
    assert cli.main(["plan", "--config", str(bad), "--gpu-mem", "8GiB"]) == 2
    err = capsys.readouterr().err
    assert err.count(message) == 2 and "Traceback" not in err


def test_cli_report_of_a_folder_says_it_is_a_folder(tmp_path, capsys):
    assert cli_report([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"ledger file '{tmp_path}' is a folder; give the JSON file in it" in err and "Errno" not in err


def test_cli_report_without_matplotlib_prints_the_table_and_says_once_what_to_install(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    src = _saved_plan(tmp_path)
    assert cli_report([str(src)]) == 1
    out, err = capsys.readouterr()
    assert "KV pool" in out
    assert err == ("torch-budget report: the table is above; drawing the ledger needs matplotlib: "
                   "pip install 'torch_budget[plot]' (or pip install matplotlib)\n")
    assert not (tmp_path / "plan.png").exists()


# --- released tags (torch_budget.sleep) ---------------------------------------------------------

RELEASED_WEIGHTS = {"allocated": 2 * GiB, "requested": 2 * GiB, "peak_allocated": 2 * GiB, "count": 10,
                    "state": "released", "resident": 0, "released": 2 * GiB, "backup": "pinned",
                    "backup_bytes": 2 * GiB}


def test_tag_state_names_released_bytes_and_backup_and_is_empty_while_live():
    from torch_budget.report import tag_state

    assert tag_state(RELEASED_WEIGHTS) == "released 2.00 GiB, backup pinned (2.00 GiB on host)"
    kv = {"allocated": GiB, "state": "released", "resident": 0, "released": GiB, "backup": "none", "backup_bytes": 0}
    assert tag_state(kv) == "released 1.00 GiB, backup none"
    assert tag_state({**kv, "state": "live", "resident": GiB, "released": 0}) == ""
    assert tag_state({"allocated": GiB, "count": 1}) == "", "a ledger without the sleep keys reads as live"


def test_tag_bytes_counts_only_what_is_resident_once_released():
    from torch_budget.report import tag_bytes

    assert tag_bytes(RELEASED_WEIGHTS) == 0
    assert tag_bytes({**RELEASED_WEIGHTS, "state": "restoring", "resident": GiB}) == GiB
    assert tag_bytes({"allocated": 3 * MiB, "peak_allocated": 5 * MiB}, "peak_allocated") == 5 * MiB
    assert tag_bytes({}) == 0


def test_a_released_line_shows_its_state_and_only_resident_bytes_count_toward_the_card():
    lines = measured_ledger(8 * GiB, weights=0, kv_pool=GiB, states={"weights": "released 2.00 GiB, backup pinned"})
    assert [line.category for line in lines] == ["weights", "kv_pool", "headroom"], "kept at 0 bytes"
    assert lines[-1].bytes == 7 * GiB
    text = format_table(lines, 8 * GiB)
    rows = {row.split()[0]: row for row in text.splitlines()}
    assert "state" in rows["line"]
    assert "0.0 MiB" in rows["weights"] and "released 2.00 GiB, backup pinned" in rows["weights"]
    assert "8.00 GiB" in rows["sum"] and "100.0%" in rows["sum"]
    ends = {r.index("%") for r in text.splitlines() if "%" in r and not r.startswith("line")}
    assert len(ends) == 1, text


def test_a_table_without_released_lines_has_no_state_column():
    assert "state" not in format_table(measured_ledger(8 * GiB, weights=GiB), 8 * GiB)


def test_the_demo_ledger_reads_a_released_tag_from_stats(monkeypatch):
    import torch_budget
    from torch_budget.demo.ledger import measured_lines

    kv = {"allocated": GiB, "requested": GiB, "peak_allocated": GiB, "count": 1}  # an older ledger: no sleep keys
    stats = {"graph_pools": 0, "by_tag": {"weights": RELEASED_WEIGHTS, "kv": kv}}
    monkeypatch.setattr(torch_budget, "stats", lambda device=None: stats, raising=False)

    class Watch:
        peak_used = reserved_at_peak = 4 * GiB

    lines = measured_lines(None, None, "torch_budget", total=8 * GiB, weights=0, kv=0, graph_static=0, pools=0,
                           ws_peak=0, peak_allocated=0, watch=Watch())
    by = {line.category: line for line in lines}
    assert by["weights"].bytes == 0
    assert by["weights"].state == "released 2.00 GiB, backup pinned (2.00 GiB on host)"
    assert by["kv_pool"].bytes == GiB and by["kv_pool"].state == ""
    assert "backup pinned" in format_table(lines, 8 * GiB)


def test_a_released_line_survives_the_json_form_and_the_report_command(tmp_path, capsys):
    lines = measured_ledger(8 * GiB, weights=0, kv_pool=GiB, states={"weights": "released 2.00 GiB, backup pinned"})
    assert [LedgerLine.from_dict(line.to_dict()) for line in lines] == lines
    src = tmp_path / "asleep.json"
    src.write_text(json.dumps({"total": 8 * GiB, "lines": [line.to_dict() for line in lines]}))
    assert cli_report([str(src)]) == 0
    assert "released 2.00 GiB, backup pinned" in capsys.readouterr().out


@pytest.mark.parametrize("ledger", [".", ""])
def test_cli_report_of_a_folder_or_an_empty_path_exits_2_with_a_message(capsys, ledger):
    # the picture's default path was made from the ledger's before the ledger was read: a traceback
    assert cli_report([ledger]) == 2
    err = capsys.readouterr().err
    assert "ledger file" in err and "Traceback" not in err
