"""Running test code in fresh processes: one process, or several ranks of a process group.

Tests that swap torch's allocator or capture graphs need a process of their own; tests of
rank agreement need several. Children find this checkout's package first (PYTHONPATH), and
ranks meet through a file in a fresh temporary directory, so no TCP port can be taken by
someone else between choosing it and binding it.
"""
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def repo_env(extra=None) -> dict:
    """The environment for a child process: this checkout first on PYTHONPATH, plus `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def _fail(what, proc_or_outputs):
    pytest.fail(f"{what}\n{proc_or_outputs}", pytrace=False)


def run_fresh(code: str, timeout: float = 300, env=None) -> str:
    """Runs `code` in a fresh Python process and returns its stdout; fails the test with the
    child's output when it exits non-zero."""
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, env=repo_env(env))
    if proc.returncode != 0:
        _fail(f"child process failed (rc={proc.returncode})",
              f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc.stdout


def run_ranks(code: str, world_size: int = 2, timeout: float = 300, env=None, rank_args=None) -> list:
    """Runs `code` as `world_size` processes and returns each rank's stdout.

    Each rank sees RANK, WORLD_SIZE and TB_INIT_METHOD (a file:// rendezvous for
    torch.distributed.init_process_group) in its environment, and `rank_args[rank]` (a list of
    strings) as sys.argv[1:].
    """
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        procs = []
        for rank in range(world_size):
            rank_env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "TB_INIT_METHOD": init, **(env or {})}
            args = [str(a) for a in (rank_args[rank] if rank_args else [])]
            procs.append(subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code), *args],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=repo_env(rank_env)))
        outputs = []
        try:
            for proc in procs:
                outputs.append(proc.communicate(timeout=timeout))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    failed = [r for r, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        _fail(f"rank(s) {failed} failed",
              "\n".join(f"--- rank {r} stdout\n{o}\n--- rank {r} stderr\n{e}" for r, (o, e) in enumerate(outputs)))
    return [o for o, _ in outputs]
