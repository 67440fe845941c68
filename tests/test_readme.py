"""Every Python snippet of the README runs as written, each in a fresh process.

Snippets that install the allocator need a CUDA device and carry the `gpu` marker. Under
TORCH_BUDGET_TEST_INSTALLED=1 (CI sets it in a virtual environment that has the wheel
installed) they run as a user runs them: outside the checkout, on the installed package.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _harness import REPO, run_fresh

SNIPPETS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
INSTALLED = os.environ.get("TORCH_BUDGET_TEST_INSTALLED") == "1"


def run_installed(code, cwd):
    """Runs `code` in a fresh process in `cwd`, with nothing of the checkout on its path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def _cases():
    for i, code in enumerate(SNIPPETS):
        marks = [pytest.mark.gpu] if "install(" in code else []
        yield pytest.param(code, id=f"snippet{i}", marks=marks)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("code", list(_cases()))
def test_readme_snippet_runs_as_written(code, tmp_path):
    if INSTALLED:
        run_installed(code, tmp_path)
    else:
        run_fresh(code, timeout=300)


@pytest.mark.skipif(not INSTALLED, reason="checks an installed wheel (CI sets TORCH_BUDGET_TEST_INSTALLED=1)")
def test_the_installed_snippets_import_the_installed_package(tmp_path):
    where = Path(run_installed("import torch_budget; print(torch_budget.__file__)", tmp_path).strip())
    assert REPO not in where.parents, where
