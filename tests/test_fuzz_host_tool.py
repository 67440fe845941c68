"""tools/fuzz_host.py: each program runs in its own process over the host core, a failing one is
reported with its seed and makes the exit status 1, and bad arguments are refused."""
import os
import subprocess
import sys

import pytest

from _harness import REPO, load_tool

pytestmark = pytest.mark.built("_host_core")

TOOL = os.path.join(REPO, "tools", "fuzz_host.py")


def run(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, cwd=REPO, timeout=300)


def test_programs_run_and_the_table_and_result_line_add_up():
    p = run("--seeds", "2", "--ops", "300", "--configs", "moves,tags-share-budget-faults", "--jobs", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[-1].startswith("RESULT fuzz_host library=_host_core programs=4 operations=1200 failed=0"), lines[-1]
    assert any(line.split()[:3] == ["moves", "2", "600"] for line in lines), p.stdout


def test_a_failing_program_is_named_with_its_seed_and_fails_the_run(capsys, monkeypatch):
    tool = load_tool("fuzz_host")

    def one(config, seed, ops, library, env):  # the children replaced: seed 1001 fails
        if seed == 1001:
            return config, seed, None, "exit status 86\nAddressSanitizer: heap-use-after-free"
        return config, seed, {"moves": 3, "seconds": 0.1}, None

    monkeypatch.setattr(tool, "one", one)
    assert tool.main(["--seeds", "3", "--ops", "100", "--configs", "moves", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED moves seed 1001: exit status 86" in out and "heap-use-after-free" in out
    assert "programs=3 operations=200 failed=1" in out.splitlines()[-1], out


def test_unknown_configurations_and_bad_counts_are_refused():
    p = run("--configs", "moves,nope")
    assert p.returncode == 2 and "unknown configuration" in p.stderr and "nope" in p.stderr
    p = run("--seeds", "0")
    assert p.returncode == 2 and "at least 1" in p.stderr
