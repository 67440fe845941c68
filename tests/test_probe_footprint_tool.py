"""tools/probe_footprint.py: a cachegrind output file is summed over the core's functions only
(the harness's loop and code evictor and the dynamic loader are not the core's cost), and a file
that is not one is refused."""
import pytest

from _harness import load_tool


def test_totals_sum_the_cores_functions_and_leave_out_the_harness_and_the_loader(tmp_path):
    out = tmp_path / "cg.out"
    out.write_text(
        "desc: I1 cache: 32768 B, 64 B, 8-way associative\n"
        "cmd: roundtrip 4096 10 1\n"
        "events: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw\n"
        "fl=/src/roundtrip.cpp\n"
        "fn=main\n"
        "20 1000 5 0 300 200 0 10 4 0\n"
        "fn=evict_code()\n"
        "11 81920 1280 0 0 0 0 0 0 0\n"
        "fl=/src/csrc/core/device_allocator.cpp\n"
        "fn=tb::DeviceAllocator::malloc(unsigned long, CUstream_st*, int, int)\n"
        "230 500 40 0 120 30 0 80 5 0\n"
        "231 100 10 0 20 0 0 0 0 0\n"
        "fl=/src/csrc/core/ledger.h\n"
        "fn=tb::DeviceAllocator::account_take_back(tb::Block*, unsigned long, bool)\n"
        "50 300 20 0 60 10 0 60 2 0\n"
        "fl=./elf/dl-lookup.c\n"
        "fn=_dl_lookup_symbol_x\n"
        "5 9999 99 0 999 99 0 9 9 0\n")
    t = load_tool("probe_footprint").totals(str(out))
    assert t["Ir"] == 900 and t["I1mr"] == 70 and t["D1mr"] == 40 and t["D1mw"] == 7


def test_a_file_without_events_is_refused(tmp_path):
    out = tmp_path / "not_cachegrind.txt"
    out.write_text("fn=main\n1 2 3\n")
    with pytest.raises(ValueError, match="not a cachegrind output file"):
        load_tool("probe_footprint").totals(str(out))


def test_the_simulated_caches_are_fixed_so_figures_do_not_follow_the_host(tmp_path, monkeypatch):
    # cachegrind takes the host's caches unless told: with a 64 KiB instruction cache the 40 KiB of
    # code between round trips evicted nothing and every round trip read 0 instruction lines.
    tool = load_tool("probe_footprint")
    seen = []

    class Done:
        returncode = 0
        stderr = ""

    def run(cmd, **kwargs):
        seen.append(cmd)
        out = next(a for a in cmd if a.startswith("--cachegrind-out-file="))
        with open(out.split("=", 1)[1], "w") as f:
            f.write("events: Ir I1mr D1mr D1mw\nfn=tb::x()\n1 10 2 3 4\n")
        return Done()

    monkeypatch.setattr(tool.subprocess, "run", run)
    assert tool.counted("roundtrip", 4096, 10, 1, str(tmp_path))["I1mr"] == 2
    i1 = [a for a in seen[0] if a.startswith("--I1=")]
    assert i1 == ["--I1=32768,8,64"], seen[0]
    assert any(a.startswith("--D1=") for a in seen[0]) and any(a.startswith("--LL=") for a in seen[0])
