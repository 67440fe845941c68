"""tools/probe_roundtrip.py: each round's tb/native ratios are printed as the round ends, so a run
cut short by its time limit still tells what the finished rounds measured; the final table and
RESULT line take the median over rounds. The children (which need a GPU) are stood in for."""
import sys

from _harness import load_tool


def test_each_round_prints_its_ratios_before_the_median_table(monkeypatch, capsys):
    tool = load_tool("probe_roundtrip")
    native_us = iter([2.0, 4.0, 2.0])  # one per round: the rounds' ratios differ

    def run_together(sizes, batches, library):
        n = next(native_us)
        per = {"native": n, "tb-vmm": 1.0, "floor": 0.8, "meta": 0.5}
        return {c: {(kind, s): (1.0 if kind == "TAKEBACK" else us) for kind in tool.KINDS for s in sizes}
                for c, us in per.items()}

    monkeypatch.setattr(tool, "build_floor", lambda: "lib.so")
    monkeypatch.setattr(tool, "run_together", run_together)
    monkeypatch.setattr(sys, "argv", ["probe_roundtrip.py", "--sizes", "4096,1048576", "--rounds", "3"])
    tool.main()
    out = capsys.readouterr().out.splitlines()
    rounds = [ln for ln in out if ln.startswith("round ")]
    assert rounds == ["round 1/3: tb/native from Python 4096B=0.500 1048576B=0.500",
                      "round 2/3: tb/native from Python 4096B=0.250 1048576B=0.250",
                      "round 3/3: tb/native from Python 4096B=0.500 1048576B=0.500"]
    assert out.index(rounds[-1]) < next(i for i, ln in enumerate(out) if ln.startswith("From Python"))
    result = next(ln for ln in out if ln.startswith("RESULT probe_roundtrip"))
    assert "4096B:tb=0.500x" in result and "1048576B:tb=0.500x" in result  # the median round, 2.0 us native
