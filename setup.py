"""Builds torch_budget's compiled parts.

- torch_budget/_C: the allocator core, the C ABI and the torch bridge (needs a CUDA
  build of torch and the CUDA headers; the driver itself is loaded at run time).
- torch_budget/_host_core: the same core over a host-memory stand-in for the driver,
  used by the CPU tests; torch_budget/_host_core_asan: the same, built with
  AddressSanitizer and UndefinedBehaviorSanitizer for the fault-injection test.

Build against the torch you will run with: pip install --no-build-isolation -e .
"""
import glob
import os

from setuptools import Extension, find_packages, setup

if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/include/cuda.h"):
    # torch guesses CUDA_HOME from the nvcc on PATH, which can miss the headers.
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension  # noqa: E402

CORE = sorted(glob.glob("csrc/core/*.cpp")) + ["csrc/tb_capi.cpp"]
# torch's extension builder picks the C++ standard its headers need; the torch-free
# core only needs C++17.
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
SANITIZE = ["-O1", "-g", "-fvisibility=hidden", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined"]


def cuda_include():
    if CUDA_HOME is None:
        raise RuntimeError("CUDA headers not found: set CUDA_HOME to the CUDA toolkit (the one holding include/cuda.h)")
    return os.path.join(CUDA_HOME, "include")


setup(
    name="torch_budget",
    version="0.1.0",
    description="An exact, enforced budget for CUDA device memory in PyTorch",
    packages=find_packages(include=["torch_budget", "torch_budget.*"]),
    python_requires=">=3.10",
    ext_modules=[
        CUDAExtension(
            name="torch_budget._C",
            sources=CORE + ["csrc/torch_bridge.cpp"],
            extra_compile_args={"cxx": CXX_FLAGS},
            libraries=["dl"],
        ),
        Extension(
            name="torch_budget._host_core",
            sources=CORE + ["csrc/testing/host_driver.cpp"],
            include_dirs=[cuda_include()],
            extra_compile_args=CXX_FLAGS + ["-std=c++17"],
            libraries=["dl"],
            language="c++",
        ),
        Extension(
            name="torch_budget._host_core_asan",
            sources=CORE + ["csrc/testing/host_driver.cpp"],
            include_dirs=[cuda_include()],
            extra_compile_args=SANITIZE + ["-std=c++17", "-Wall"],
            extra_link_args=SANITIZE,
            libraries=["dl"],
            language="c++",
        ),
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["torch-budget=torch_budget.cli:main"]},
)
