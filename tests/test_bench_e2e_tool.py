"""tools/bench_e2e.py: the outputs' checksums, compared run by run, tell an allocator's difference
(the same run apart on the two sides, each side repeating itself round after round) from a workload
that is not deterministic on the GPU (a side's run k gives another checksum in another round, so a
difference says nothing). The lockstep children (which need a GPU) are stood in for."""
from _harness import REPO, load_tool


def rounds_of(native_checks, installed_checks):
    """Round r of a workload gives each side the checksums listed for it, or the r-th list of them."""
    count = {}

    def one_round(name, repeats, pin):
        r = count[name] = count.get(name, -1) + 1

        def side(checks, seconds):
            checks = checks[r] if isinstance(checks[0], list) else checks
            return {"runs": [{"seconds": seconds, "check": c} for c in checks],
                    "peak_reserved": 100 << 20, "peak_allocated": 90 << 20}
        return {"native": side(native_checks[name], 1.0), "installed": side(installed_checks[name], 0.9)}
    return one_round


def test_checksums_are_compared_run_by_run_and_say_equal_differs_or_vary(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # its _bench, found beside it when run as a script
    tool = load_tool("bench_e2e")
    # "steps": each run a training step of its own, the same on both sides: it had said VARY for good
    native = {"steady": [7, 7, 7], "apart": [7, 7, 7], "steps": [1, 2, 3],
              "noisy": [[7.0, 7.5, 7.25], [7.0, 7.25, 7.5]]}
    installed = {"steady": [7, 7, 7], "apart": [8, 8, 8], "steps": [1, 2, 3], "noisy": [7.0, 7.0, 7.0]}
    monkeypatch.setattr(tool, "cuda_torch", lambda *a: object())
    monkeypatch.setattr(tool, "one_round", rounds_of(native, installed))
    monkeypatch.setenv("BENCH_E2E_WORKLOADS", "steady,apart,steps,noisy")
    monkeypatch.setenv("BENCH_E2E_ROUNDS", "2")
    assert tool.main() == 0
    out = capsys.readouterr().out.splitlines()
    rows = {ln.split()[0]: ln.split() for ln in out if ln.split() and ln.split()[0] in native}
    assert rows["steady"][8:10] == ["equal", "1/1"]
    assert rows["apart"][8:10] == ["DIFFERS", "1/1"]
    assert rows["steps"][8:10] == ["equal", "3/3"]
    assert rows["noisy"][8:10] == ["VARY", "3/1"]
    assert rows["steady"][4] == "0.900-0.900"  # six pairs: the least and the most bound the median
    assert out[-1] == ("RESULT bench_e2e steady=0.900x[0.900-0.900],rsv=1.00 apart=0.900x[0.900-0.900],rsv=1.00,"
                       "CHECKS_DIFFERS steps=0.900x[0.900-0.900],rsv=1.00 noisy=0.900x[0.900-0.900],rsv=1.00,"
                       "CHECKS_VARY")


def test_a_described_gpu_side_names_the_first_kernel_that_differs(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    tool = load_tool("bench_e2e")
    kernels = {"native": ["gemm_a", "norm", "gemm_b"], "installed": ["gemm_a", "norm", "gemm_splitk", "reduce"]}
    align = {"native": [2 << 20, 1 << 19], "installed": [2 << 20, 512]}

    def one_round(name, repeats, pin):
        def side(which):
            out = {"runs": [{"seconds": 1.0, "check": 1.5}], "peak_reserved": 1 << 20, "peak_allocated": 1 << 20}
            if name == "described" or which == "native":  # "plain": only one side describes itself
                out["describe"] = {"kernels": kernels[which], "align": align[which]}
            return out
        return {"native": side("native"), "installed": side("installed")}

    monkeypatch.setattr(tool, "cuda_torch", lambda *a: object())
    monkeypatch.setattr(tool, "one_round", one_round)
    monkeypatch.setenv("BENCH_E2E_WORKLOADS", "described,plain")
    monkeypatch.setenv("BENCH_E2E_ROUNDS", "1")
    assert tool.main() == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("described:", "plain:"))]
    assert lines == ["described: kernels DIFFER (3 native, 4 installed; first at #2: gemm_b | gemm_splitk); "
                     "weight alignment, least: native 524288 B, installed 512 B"]
    same = tool.gpu_side([{"native": {"describe": {"kernels": ["k"], "align": [256]}},
                           "installed": {"describe": {"kernels": ["k"], "align": [4096]}}}])
    assert same == "the same 1 kernels; weight alignment, least: native 256 B, installed 4096 B"


def test_alignment_is_the_largest_power_of_two_dividing_an_address(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    workloads = load_tool("workloads")
    assert [workloads.alignment(a) for a in (0x7F0000200000, 0x7F0000000200, 0x7F0000000000 + 3 * 4096, 0)] == \
        [2 << 20, 512, 4096, 2 << 20]
