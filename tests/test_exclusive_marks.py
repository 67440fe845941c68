"""Every test that reads the device's free memory (torch.cuda.mem_get_info) runs alone: it carries
the `exclusive` marker, itself or through its module's pytestmark, so the GPU suite runs it while
no other test's process allocates. Read from the test modules' source: a test reads free memory
when it, or a function of its module it names (a fresh-process body, a helper), calls
mem_get_info and uses the first number; the total alone (mem_get_info()[1]) is the same for every
process. A test without the marker that compared free memory failed beside 14 workers on an H100
(the OOM observer's: 4.3 GB apart)."""
import ast
import glob
import os

import pytest

from _harness import REPO

TESTS = sorted(glob.glob(os.path.join(REPO, "tests", "test_*.py")))


def _reads_free(fn: ast.FunctionDef) -> bool:
    """Whether `fn` itself calls mem_get_info and uses the free bytes it returns."""
    parents = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
    loaded = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    for call in ast.walk(fn):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "mem_get_info"):
            continue
        parent = parents.get(call)
        if isinstance(parent, ast.Subscript) and parent.value is call:
            if isinstance(parent.slice, ast.Constant) and parent.slice.value == 1:
                continue  # the total only
            return True
        if isinstance(parent, ast.Assign) and isinstance(parent.targets[0], ast.Tuple):
            first = parent.targets[0].elts[0]
            if isinstance(first, ast.Name) and first.id not in loaded:
                continue  # the free bytes are never read
            return True
        return True
    return False


def _marked_exclusive(node) -> bool:
    return any("exclusive" in ast.unparse(d) for d in node.decorator_list)


def offenders(path: str) -> list[str]:
    """The tests of the module at `path` that read free memory without the exclusive marker."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    module_marks = [ast.unparse(n.value) for n in tree.body
                    if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)]
    if any("exclusive" in m for m in module_marks):
        return []
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    calls = {name: {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in functions and n.id != name}
             for name, fn in functions.items()}
    direct = {name for name, fn in functions.items() if _reads_free(fn)}

    def reaches(name, seen):
        if name in direct:
            return True
        seen.add(name)
        return any(reaches(c, seen) for c in calls[name] if c not in seen)

    return [name for name, fn in functions.items()
            if name.startswith("test_") and not _marked_exclusive(fn) and reaches(name, set())]


@pytest.mark.parametrize("path", TESTS, ids=[os.path.basename(p) for p in TESTS])
def test_tests_reading_the_devices_free_memory_are_exclusive(path):
    assert offenders(path) == [], f"{os.path.basename(path)}: mark these @pytest.mark.exclusive"


def test_the_check_finds_free_memory_read_through_a_body_and_a_helper(tmp_path):
    module = tmp_path / "test_sample.py"
    module.write_text(
        "import pytest\nimport torch\n\n"
        "def _free():\n    return torch.cuda.mem_get_info()[0]\n\n"
        "def body():\n    before = _free()\n    return before\n\n"
        "def total_only():\n    return torch.cuda.mem_get_info()[1]\n\n"
        "def unused_free():\n    free, total = torch.cuda.mem_get_info()\n    return total\n\n"
        "def compared():\n    free_now, total = torch.cuda.mem_get_info()\n    assert free_now > 0\n\n"
        "def test_through_a_body(fresh):\n    fresh(body)\n\n"
        "@pytest.mark.exclusive\ndef test_marked(fresh):\n    fresh(body)\n\n"
        "def test_total(fresh):\n    fresh(total_only)\n\n"
        "def test_unused(fresh):\n    fresh(unused_free)\n\n"
        "def test_compared():\n    compared()\n")
    assert offenders(str(module)) == ["test_through_a_body", "test_compared"]
    module.write_text(module.read_text().replace("import torch\n", "import torch\npytestmark = pytest.mark.exclusive\n", 1))
    assert offenders(str(module)) == []
