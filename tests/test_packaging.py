"""Packaging: where setup.py finds the CUDA headers without a toolkit, which parts a build makes,
and what the wheel and the sdist hold (CI builds both and names them in TORCH_BUDGET_WHEEL and
TORCH_BUDGET_SDIST)."""
import os
import runpy
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup_py():
    """setup.py's functions (run under another name than __main__, so setup() is not called)."""
    return runpy.run_path(str(REPO / "setup.py"), run_name="setup_under_test")


def headers(root, *names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    return str(root)


def test_the_cuda_13_wheels_are_found_past_other_nvidia_wheels(tmp_path, setup_py):
    site = tmp_path / "site-packages"
    headers(site / "nvidia/cusparselt/include", "cusparseLt.h")  # sorts after cu13, has no CUDA headers
    headers(site / "nvidia/cudnn/include", "cudnn.h")
    cu13 = headers(site / "nvidia/cu13/include", "cuda.h", "cuda_runtime.h", "crt/host_defines.h")
    assert setup_py["cuda_include_dirs"](None, str(site), system=()) == [cu13]


def test_headers_split_over_two_wheels_give_both_directories(tmp_path, setup_py):
    # CUDA 12's layout: the runtime wheel, and crt/ in the nvcc wheel
    site = tmp_path / "site-packages"
    runtime = headers(site / "nvidia/cuda_runtime/include", "cuda.h", "cuda_runtime.h")
    crt = headers(site / "nvidia/cuda_nvcc/include", "crt/host_defines.h")
    assert setup_py["cuda_include_dirs"](None, str(site), system=()) == [runtime, crt]
    msg = setup_py["missing_headers_message"](None, str(tmp_path / "none"), "12.8", system=())
    assert "'nvidia-cuda-nvcc-cu12==12.8.*' 'nvidia-cuda-runtime-cu12==12.8.*'" in msg, msg


def test_cuda_home_comes_before_the_wheels(tmp_path, setup_py):
    site = tmp_path / "site-packages"
    headers(site / "nvidia/cu13/include", "cuda.h", "cuda_runtime.h", "crt/host_defines.h")
    toolkit = headers(tmp_path / "cuda/include", "cuda.h", "cuda_runtime.h", "crt/host_defines.h")
    assert setup_py["cuda_include_dirs"](str(tmp_path / "cuda"), str(site), system=()) == [toolkit]


def test_a_toolkit_is_used_whole_when_the_wheels_lack_a_header(tmp_path, setup_py):
    site = tmp_path / "site-packages"
    headers(site / "nvidia/cu13/include", "cuda.h", "cuda_runtime.h")  # torch's runtime wheel, no crt/
    system = headers(tmp_path / "usr/local/cuda/include", "cuda.h", "cuda_runtime.h", "crt/host_defines.h")
    assert setup_py["cuda_include_dirs"](None, str(site), system=(system,)) == [system]
    assert setup_py["cuda_include_dirs"](None, str(site), system=()) is None


def test_missing_crt_headers_name_the_wheel_to_install(tmp_path, setup_py):
    site = tmp_path / "site-packages"
    cu13 = headers(site / "nvidia/cu13/include", "cuda.h", "cuda_runtime.h")
    msg = setup_py["missing_headers_message"](None, str(site), "13.0", system=("/nowhere/include",))
    assert "pip install 'nvidia-cuda-crt==13.0.*'" in msg, msg
    assert "nvidia-cuda-runtime" not in msg, msg  # the runtime wheel is there
    assert cu13 in msg and "/nowhere/include" in msg and "CUDA_HOME" in msg, msg


def test_no_cuda_wheel_at_all_names_the_runtime_and_the_crt_wheels(tmp_path, setup_py):
    msg = setup_py["missing_headers_message"](None, str(tmp_path), "13.0", system=())
    assert "pip install 'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-runtime==13.0.*'" in msg, msg


def test_a_build_makes_only_what_users_run_unless_told(setup_py):
    parts = setup_py["selected_parts"]
    assert parts(None) == parts("") == ["_C"]
    assert parts("all") == ["_C", "_host_core", "_host_core_asan"]
    assert parts("_C,tests") == parts("all")
    assert parts("none") == []
    with pytest.raises(SystemExit, match="no such part: _host"):
        parts("_host")


def _buildable():
    """The parts this torch builds for the tests; of an installed wheel, only _C."""
    try:
        import torch

        cuda = bool(torch.version.cuda)
    except ImportError:
        cuda = False
    tests = [] if os.environ.get("TORCH_BUDGET_TEST_INSTALLED") == "1" else ["_host_core", "_host_core_asan"]
    return (["_C"] if cuda else []) + tests


@pytest.mark.parametrize("part", [pytest.param(p, marks=pytest.mark.built(p)) for p in _buildable()])
def test_every_part_this_torch_can_build_is_built(part):
    # conftest checks the `built` mark: a skip on a checkout that did not build the part, a failure
    # in CI, even for a part no test runs here (_C without a GPU)
    from torch_budget import _native

    assert _native.is_built(part)


def given(variable):
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"no {variable} given (CI builds one)")
    return Path(path)


def test_the_wheel_holds_the_allocator_and_no_test_core():
    wheel = zipfile.ZipFile(given("TORCH_BUDGET_WHEEL"))
    names = wheel.namelist()
    assert [n for n in names if n.startswith("torch_budget/_C.") and n.endswith(".so")], names
    assert not [n for n in names if "_host_core" in n], "the host cores are for the tests only"
    assert not [n for n in names if n.startswith(("tests/", "tools/", "csrc/"))]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "torch-budget = torch_budget.cli:main" in wheel.read(entry_points).decode()
    # The startup file (torch_budget.startup) at the top of site-packages, as in the checkout.
    assert wheel.read("torch_budget-startup.pth") == (REPO / "torch_budget" / "startup.pth").read_bytes()


def test_the_sdist_holds_every_source_and_no_build_output():
    with tarfile.open(given("TORCH_BUDGET_SDIST")) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    sources = [p.relative_to(REPO).as_posix() for folder in ("csrc", "torch_budget", "tests")
               for p in (REPO / folder).rglob("*")
               if p.is_file() and p.suffix in (".cpp", ".h", ".py") and "__pycache__" not in p.parts]
    needed = sources + ["setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "torch_budget/startup.pth",
                        "tools/setup_env.sh", "tools/test.sh"]
    assert not [n for n in needed if n not in names], "missing from the sdist"
    assert not [n for n in names if n.endswith((".so", ".o"))], "build outputs in the sdist"
