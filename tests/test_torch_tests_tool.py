"""tools/torch_allocator_tests.py's reading of its own runs (no GPU): which tests an xdist worker ran
before a failure, and the verdict on a test that failed only installed."""
from _harness import load_tool

tool = load_tool("torch_allocator_tests")

F = ".torch_tests/test_cuda.py::"
IDS = [F + n for n in ("TestCuda::test_a", "TestCuda::test_b", "TestCuda::test_c", "TestCuda::test_d",
                       "TestMemPool::test_serial")]
LOG = f"""collecting ...
[gw1] [ 20%] PASSED {F}TestCuda::test_a
[gw0] [ 40%] PASSED {F}TestCuda::test_b
[gw1] [ 60%] FAILED {F}TestCuda::test_c
[gw0] linux -- Python 3.12.3
[gw1] [ 80%] XFAIL {F}TestCuda::test_d
"""


def test_worker_orders_lists_what_each_worker_ran_before_each_test(tmp_path):
    log = tmp_path / "installed_parallel.log"
    log.write_text(LOG)
    before = tool.worker_orders(str(log))
    assert before[F + "TestCuda::test_a"] == []
    assert before[F + "TestCuda::test_b"] == []
    assert before[F + "TestCuda::test_c"] == [F + "TestCuda::test_a"]
    assert before[F + "TestCuda::test_d"] == [F + "TestCuda::test_a", F + "TestCuda::test_c"]
    assert tool.worker_orders(str(tmp_path / "missing.log")) == {}


def _recheck(tmp_path, regressions, outcome):
    """recheck() with runs replaced by outcome(allocator, kind, key, sequence)."""
    log = tmp_path / "installed_parallel.log"
    log.write_text(LOG)
    calls = []

    def keys(nodes):
        return ["::".join(n.split("::")[1:]) for n in nodes]

    def alone(nodes, at_once=4):
        return {a: {k: (outcome(a, "alone", k, [k]), "") for k in keys(nodes)} for a in ("native", "installed")}

    def replay(allocator, nodes):
        calls.append((allocator, keys(nodes)))
        return {k: (outcome(allocator, "ordered", k, keys(nodes)), "") for k in keys(nodes)}

    return tool.recheck(regressions, {"::".join(n.split("::")[1:]): n for n in IDS}, str(log), alone, replay), calls


def test_a_test_failing_natively_after_the_same_tests_is_order_dependent(tmp_path):
    lines, calls = _recheck(tmp_path, ["TestCuda::test_c"],
                            lambda a, kind, k, seq: "failed" if kind == "ordered" and k == "TestCuda::test_c"
                            else "passed")
    assert ("native", ["TestCuda::test_a", "TestCuda::test_c"]) in calls
    assert ("installed", ["TestCuda::test_a", "TestCuda::test_c"]) in calls
    assert "order-dependent in torch's suite" in lines[1] and "after 1 earlier tests" in lines[1]


def test_a_test_failing_only_installed_is_a_regression(tmp_path):
    lines, _ = _recheck(tmp_path, ["TestCuda::test_c"],
                        lambda a, kind, k, seq: "failed" if a == "installed" and k == "TestCuda::test_c"
                        else "passed")
    assert lines[1].endswith("REGRESSION"), lines
    assert "alone native/installed passed/failed" in lines[1]


def test_one_replay_per_worker_through_its_last_regression_and_serial_tests_are_not_replayed(tmp_path):
    lines, calls = _recheck(tmp_path, ["TestCuda::test_c", "TestCuda::test_d", "TestMemPool::test_serial"],
                            lambda a, kind, k, seq: "passed")
    assert calls == [("native", ["TestCuda::test_a", "TestCuda::test_c", "TestCuda::test_d"]),
                     ("installed", ["TestCuda::test_a", "TestCuda::test_c", "TestCuda::test_d"])]
    assert "passes both ways when rerun" in lines[1]
    assert "serial part: same order both ways" in lines[3]
