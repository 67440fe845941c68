"""Configurations replayed in lockstep: real child processes (torch_budget.replay.child) over a
stand-in `torch` package, so the protocol, the turns and the pairing run as they do on a GPU."""

import json
import os
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from torch_budget.replay import compare, lockstep

# A `torch` with what the replaying child calls. Each allocation busy-waits for a cost that
# depends on the configuration (read from the environment the configuration sets), so a
# configuration's ratio is known; each slice is logged with its start and end, so the turns can
# be checked; the cudaMallocAsync configuration can be made to fail part way.
FAKE_TORCH = textwrap.dedent('''
    import os, time

    uint8 = "uint8"
    _conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    _cost = float(os.environ["FAKE_US_NATIVE"]) * (2.0 if "expandable" in _conf else 1.0) * 1e-6
    _fail_at = int(os.environ.get("FAKE_FAIL_AT", "0")) if "cudaMallocAsync" in _conf else 0
    _count = 0

    def device(kind, index=None):
        return (kind, index)

    def empty(size, dtype=None, device=None):
        global _count
        _count += 1
        if _fail_at and _count == _fail_at:
            raise RuntimeError("CUDA out of memory (stand-in)")
        end = time.perf_counter() + _cost
        while time.perf_counter() < end:
            pass
        return _Tensor()

    def zeros(*shape, device=None):
        return _Tensor()

    class _Tensor:
        def add_(self, x):
            return self

    class cuda:
        _peak = 0

        @staticmethod
        def current_device():
            return 0

        @staticmethod
        def current_stream():
            return 0

        @staticmethod
        def Stream():
            return 1

        @staticmethod
        def set_stream(s):
            pass

        @staticmethod
        def synchronize():
            pass

        @staticmethod
        def empty_cache():
            pass

        @staticmethod
        def reset_peak_memory_stats():
            pass

        @staticmethod
        def memory_reserved():
            return 0

        @staticmethod
        def max_memory_reserved():
            return 8 << 20

        @staticmethod
        def memory_stats():
            return {"num_device_alloc": _count, "num_device_free": 0}

        @staticmethod
        def get_allocator_backend():
            return "native"
''')


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    # Children get PYTHONPATH = repository + this; the stand-in must come before any real torch.
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FAKE_US_NATIVE", "20")
    monkeypatch.setattr(compare, "_child", _logging(compare._child, tmp_path))
    return tmp_path


def _logging(make, folder):
    """compare._child, with each child's stdin commands and their times written to a log, so the
    test sees the order in which the configurations took their turns."""
    def child(config, traces, pinned, passes, touch, *more):
        cmd, env = make(config, traces, pinned, passes, touch, *more)
        log = folder / f"{config}.log"
        wrapper = ("import runpy, sys, time, io\n"
                   f"log = open({str(log)!r}, 'a')\n"
                   "class Stdin(io.TextIOBase):\n"
                   "    def __iter__(self):\n"
                   "        for line in sys.__stdin__:\n"
                   "            log.write(f'{time.perf_counter()!r} {line.strip()}\\n'); log.flush()\n"
                   "            yield line\n"
                   "sys.stdin = Stdin()\n"
                   "sys.argv = ['child'] + sys.argv[1:]\n"
                   "runpy.run_module('torch_budget.replay.child', run_name='__main__')\n")
        return [sys.executable, "-c", wrapper] + cmd[3:], env  # the arguments after `-m module`
    return child


def _turns(folder, configs):
    """Every `run A B` command, as (time, config, A), in the order they were sent."""
    out = []
    for c in configs:
        for line in (folder / f"{c}.log").read_text().splitlines():
            t, word, *args = line.split()
            if word == "run":
                out.append((float(t), c, int(args[0])))
    return sorted(out)


def test_configurations_take_turns_slice_by_slice_and_each_pass_is_paired(fake_torch, monkeypatch):
    # Each operation's stand-in cost is large beside what a loaded machine adds to every operation
    # alike (under twelve parallel test workers that was ~60 us an operation, which pulled the ratio of
    # 20 us against 40 us down to 1.24).
    monkeypatch.setenv("FAKE_US_NATIVE", "100")
    runs = compare.compare(["mix:small:4200"], ["native", "expandable"], rounds=1, pinning=(False,),
                           passes=3, in_lockstep=True)
    nat, exp = (next(r for r in runs if r.config == c) for c in ("native", "expandable"))
    assert not nat.errors and not exp.errors
    a, b = nat.rounds[0], exp.rounds[0]
    assert a["lockstep"] and b["lockstep"]
    assert len(a["us_per_op"]) == len(b["us_per_op"]) >= 3  # the same passes, so each pairs with its own
    # The turns: every slice of every pass, each configuration in turn, neither running more than two
    # slices in a row (the order rotates), over the same operations.
    turns = _turns(fake_torch, ["native", "expandable"])
    slices = len(range(0, 4200, compare.SLICE_OPS))
    assert slices == 3
    assert len(turns) == 2 * slices * len(a["us_per_op"])
    longest = run = 1
    for prev, cur in zip(turns, turns[1:]):
        run = run + 1 if cur[1] == prev[1] else 1
        longest = max(longest, run)
    assert longest == 2
    assert sorted(x[2] for x in turns if x[1] == "native") == sorted(x[2] for x in turns if x[1] == "expandable")
    # Allocations cost twice as much under the stand-in's "expandable": the paired ratio says so.
    rows = {r["config"]: r for r in compare.summarise(runs)}
    assert 1.4 < rows["expandable"]["x_native"] < 3.0
    assert len(compare._paired_ratios(b, a)) == len(a["us_per_op"]) - 1  # one ratio per grown pass
    assert rows["expandable"]["pairs"] == 1  # and the round's median of them, one sample
    assert rows["native"]["x_native"] == pytest.approx(1.0)


def test_a_configuration_that_fails_leaves_the_round_named_and_the_others_finish(fake_torch, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_AT", "300")
    runs = compare.compare(["mix:small:3000", "mix:1MiB"], ["native", "cudaMallocAsync"], rounds=1,
                           pinning=(False,), passes=2, in_lockstep=True)
    by = {(os.path.basename(r.trace), r.config): r for r in runs}
    failed = by[("mix:small:3000", "cudaMallocAsync")]
    assert failed.rounds == [None] and "cudaMallocAsync" in failed.errors[0] and "out of memory" in failed.errors[0]
    assert by[("mix:1MiB", "cudaMallocAsync")].rounds == [None]  # the child left the round
    assert all(by[(t, "native")].rounds[0] for t in ("mix:small:3000", "mix:1MiB"))
    table = compare.table(compare.summarise(runs))
    assert "FAILED" in table


def test_a_child_that_never_gets_ready_is_reported_not_waited_for(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time; time.sleep(30)\n")
    t0 = time.monotonic()
    out = lockstep.start({"slow": ([sys.executable, str(script)], None)}, timeout=1.0)
    assert isinstance(out["slow"], lockstep.ChildError) and "no answer within 1 s" in str(out["slow"])
    assert time.monotonic() - t0 < 15


def test_an_unknown_command_is_an_error_the_parent_raises(fake_torch):
    cmd, env = compare._child("native", ["mix:1MiB"], False, 2, False)
    started = lockstep.start({"native": (cmd + ["--lockstep"], env)}, timeout=60)
    child = started["native"]
    try:
        with pytest.raises(lockstep.ChildError, match="native: unknown command 'jump'"):
            child.ask("jump", timeout=30)
        # The child goes on: one pass of the whole trace, then its figures.
        assert child.ask("begin 0", timeout=30) == "ok" and child.ask("pass", timeout=30) == "ok"
        assert float(child.ask("run 0 1000", timeout=30)) > 0
        assert child.ask("end_pass", timeout=30) == "ok"
        res = json.loads(child.ask("result", timeout=30))
        assert res["lockstep"] and res["trace"] == "mix:1MiB" and len(res["us_per_op"]) == 1
    finally:
        child.close()


def test_the_turn_order_rotates():
    assert lockstep.rotation(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert lockstep.rotation(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert lockstep.rotation(["a", "b", "c"], 5) == ["c", "a", "b"]
    assert lockstep.rotation([], 3) == []


def _told(monkeypatch, call, device, tell):
    """The devices `tell()` passes to the C ABI's `call`: under torch's own allocator, then installed."""
    import torch_budget
    from torch_budget import _runtime

    calls = []
    monkeypatch.setattr(_runtime, "library", lambda: SimpleNamespace(**{call: lambda d: calls.append(d) or 0}))
    monkeypatch.setattr(_runtime, "current_device", lambda: device)
    monkeypatch.setattr(torch_budget, "installed", lambda: False)
    tell()
    native = list(calls)
    monkeypatch.setattr(torch_budget, "installed", lambda: True)
    tell()
    return native, calls[len(native):]


def test_a_turn_tells_torch_budget_the_wait_earns_no_packing_credit(monkeypatch):
    native, installed = _told(monkeypatch, "tb_packing_idle", 3, lockstep.turn_starts)
    assert native == []  # torch's own allocator: nothing to tell
    assert installed == [3]


def test_each_trace_starts_with_the_packing_credit_of_a_fresh_process(monkeypatch):
    from torch_budget.replay import child

    native, installed = _told(monkeypatch, "tb_packing_refill", 2, child.starts_afresh)
    assert native == []
    assert installed == [2]
