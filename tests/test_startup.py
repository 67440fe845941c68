"""TORCH_BUDGET_SERVE and the startup file (torch_budget.startup): every Python process started with the
variable serves the named stack, before the stack's own code runs; without it nothing happens.

Each case starts a fresh interpreter that reads the startup file from a site directory (as Python does
for site-packages) and imports stand-ins of TensorRT-LLM's modules from disk."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STARTUP = REPO / "torch_budget" / "startup.pth"

# Stand-ins of the TensorRT-LLM files serve_tensorrt_llm rebinds: its virtual_memory and
# py_executor_creator, which binds `scope` at its import, as TensorRT-LLM's does.
TRT_FILES = {
    "tensorrt_llm/__init__.py": """
        import sys
        ADAPTER_BEFORE_US = "torch_budget.adapters.tensorrt_llm" in sys.modules
    """,
    "tensorrt_llm/_torch/__init__.py": "",
    "tensorrt_llm/_torch/virtual_memory.py": """
        import enum
        RestoreMode = enum.Enum("CudaVirtualMemoryAllocatorRestoreMode", "NONE MEMSET CPU PINNED")

        def _native(name):
            def call(*args, **kwargs):
                raise AssertionError(f"TensorRT-LLM's own {name} was called")
            return call

        scope, maybe_scope, preserve_contents = _native("scope"), _native("maybe_scope"), _native("preserve_contents")
        release_with_tag, materialize_with_tag = _native("release_with_tag"), _native("materialize_with_tag")
    """,
    "tensorrt_llm/_torch/pyexecutor/__init__.py": "",
    "tensorrt_llm/_torch/pyexecutor/py_executor_creator.py": """
        from tensorrt_llm._torch.virtual_memory import RestoreMode
        from tensorrt_llm._torch.virtual_memory import scope as virtual_memory_scope
    """,
}

CHECK = """
import site, sys
site.addsitedir(sys.argv[1])  # reads the startup file there, as Python reads site-packages' at start
started = "torch_budget" in sys.modules  # what the startup file imported
import tensorrt_llm
from tensorrt_llm._torch import virtual_memory as vm
from tensorrt_llm._torch.pyexecutor import py_executor_creator as creator
served = vm.scope.__module__ == "torch_budget.adapters.tensorrt_llm"
if served:
    from torch_budget.adapters import tensorrt_llm as ours
    assert creator.virtual_memory_scope is ours.scope and vm.scope is ours.scope
    assert vm.release_with_tag is ours.release_with_tag and vm.materialize_with_tag is ours.materialize_with_tag
    assert vm.__loader__.get_source(vm.__name__).lstrip().startswith("import enum"), "the real loader answers"
print("served" if served else "untouched", "adapter-first" if tensorrt_llm.ADAPTER_BEFORE_US else "",
      "started" if started else "")
"""


def _start(tmp_path, serve, installed=False, script=CHECK):
    """A fresh interpreter over the stand-ins; the startup file read from a site directory, or with
    `installed`, the one the installed wheel put in site-packages (and that torch_budget)."""
    site_dir, stand_ins = tmp_path / "site", tmp_path / "stand_ins"
    site_dir.mkdir(parents=True)
    if not installed:
        shutil.copy(STARTUP, site_dir / "torch_budget-startup.pth")
    for name, text in TRT_FILES.items():
        path = stand_ins / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if k != "TORCH_BUDGET_SERVE"}
    env["PYTHONPATH"] = os.pathsep.join([str(stand_ins)] if installed else [str(REPO), str(stand_ins)])
    env["CUDA_VISIBLE_DEVICES"] = ""  # importing the adapter installs nothing without a device
    if serve is not None:
        env["TORCH_BUDGET_SERVE"] = serve
    return subprocess.run([sys.executable, "-c", script, str(site_dir)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_with_the_variable_tensorrt_llm_is_served_from_its_first_import(tmp_path):
    proc = _start(tmp_path, "tensorrt_llm")
    assert proc.returncode == 0, proc.stderr
    # The adapter (which installs torch_budget where a device is free) loads as tensorrt_llm starts
    # importing, before any of its code; its executor's bound names are the adapter's.
    assert proc.stdout.split() == ["served", "adapter-first", "started"], proc.stdout + proc.stderr


def test_looking_for_tensorrt_llm_installs_nothing_only_importing_it_does(tmp_path):
    probe = (  # as libraries probe for optional packages
        "import importlib.util, site, sys\n"
        "site.addsitedir(sys.argv[1])\n"
        "assert importlib.util.find_spec('tensorrt_llm') is not None\n"
        "print('adapter' if 'torch_budget.adapters.tensorrt_llm' in sys.modules else 'nothing')\n")
    proc = _start(tmp_path, "tensorrt_llm", script=probe)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["nothing"]


def test_without_the_variable_the_startup_file_imports_nothing(tmp_path):
    proc = _start(tmp_path, None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["untouched"], "torch_budget was imported"
    assert proc.stderr == ""


def test_an_unknown_value_is_reported_and_the_interpreter_still_starts(tmp_path):
    proc = _start(tmp_path, "tensorrt_llm,vllm_x")
    assert proc.returncode == 0, proc.stderr
    assert "TORCH_BUDGET_SERVE" in proc.stderr and "'vllm_x'" in proc.stderr and "nothing is served" in proc.stderr
    assert proc.stdout.split() == ["untouched", "started"]


def test_values_are_parsed_and_checked():
    from torch_budget import startup

    assert startup.parse(" tensorrt_llm , ") == ["tensorrt_llm"]
    assert startup.parse("") == []
    with pytest.raises(ValueError, match="'sglang'.*expected a comma-separated list of tensorrt_llm"):
        startup.parse("sglang")


@pytest.mark.skipif(os.environ.get("TORCH_BUDGET_TEST_INSTALLED") != "1",
                    reason="checks an installed wheel (CI sets TORCH_BUDGET_TEST_INSTALLED=1)")
def test_the_installed_wheels_startup_file_serves_every_new_interpreter(tmp_path):
    proc = _start(tmp_path, "tensorrt_llm", installed=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["served", "adapter-first", "started"], proc.stdout + proc.stderr
    assert _start(tmp_path / "again", None, installed=True).stdout.split() == ["untouched"]
