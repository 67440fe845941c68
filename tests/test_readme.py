"""Every Python snippet of the README runs as written, each in a fresh process.

Snippets that install the allocator need a CUDA device and carry the `gpu` marker.
"""
import re

import pytest

from _harness import REPO, run_fresh

SNIPPETS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def _cases():
    for i, code in enumerate(SNIPPETS):
        marks = [pytest.mark.gpu] if "install(" in code else []
        yield pytest.param(code, id=f"snippet{i}", marks=marks)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("code", list(_cases()))
def test_readme_snippet_runs_as_written(code):
    run_fresh(code, timeout=300)
