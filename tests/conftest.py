import os
import subprocess
import sys
import textwrap

import pytest

MiB = 1 << 20
GiB = 1 << 30


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_fresh(code, timeout=300, env=None):
    """Run `code` in a fresh Python process (needed for anything that swaps torch's
    allocator or captures graphs) and return its stdout; fail the test with the
    child's output when it exits non-zero."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=full_env,
    )
    if proc.returncode != 0:
        pytest.fail(f"child process failed (rc={proc.returncode})\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc.stdout


@pytest.fixture
def fresh():
    return run_fresh
