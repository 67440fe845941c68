"""Builds torch_budget's compiled parts against the torch installed in this environment.

    pip install --no-build-isolation .          (a checkout: pip install --no-build-isolation -e .)

--no-build-isolation: the extension links against the torch you will run it with, and pip's
build isolation would hide that torch. No CUDA toolkit is needed: the CUDA headers come from
CUDA_HOME when it is set, else from the CUDA runtime wheel a CUDA build of torch installs
(nvidia/cu*/include), else from /usr/local/cuda. Nothing is compiled by nvcc.

- torch_budget/_C: the allocator core, the C ABI and the torch bridge (csrc/bridge) (needs a CUDA build of
  torch; the driver itself is loaded at run time).
- torch_budget/_host_core and torch_budget/_host_core_asan: the same core over a host-memory
  stand-in for the driver, for the CPU tests (the second built with AddressSanitizer).

Each extension compiles into its own build directory, so a second build recompiles only what
changed.
"""
import glob
import os
import sys

from setuptools import Extension, find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit(
        "torch_budget builds against the torch you run it with, and this build environment has no torch: pip's\n"
        "default build isolation hides the installed one. Install torch if it is not there yet, then:\n"
        "    pip install --no-build-isolation .")

HERE = os.path.dirname(os.path.abspath(__file__))
CORE = sorted(glob.glob("csrc/core/*.cpp")) + ["csrc/tb_capi.cpp"]
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
SANITIZE = ["-O1", "-g", "-fvisibility=hidden", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined"]


def cuda_include() -> str:
    """A directory with the CUDA headers torch's own headers need (cuda.h, cuda_runtime.h and
    its crt/ part): CUDA_HOME, else the CUDA runtime wheel of a CUDA build of torch, else
    /usr/local/cuda."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "include"))
    site = os.path.dirname(os.path.dirname(torch.__file__))
    wheel = sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "include")), reverse=True)
    candidates += wheel + ["/usr/local/cuda/include"]
    for path in candidates:
        if all(os.path.isfile(os.path.join(path, h)) for h in ("cuda.h", "cuda_runtime.h", "crt/host_defines.h")):
            return path
    hint = ""
    if wheel and os.path.isfile(os.path.join(wheel[0], "cuda.h")):
        version = (torch.version.cuda or "").rsplit(".", 1)[0] if torch.version.cuda else ""
        hint = (f" torch's CUDA runtime wheel has cuda.h but not the crt/ headers cuda_runtime.h includes: "
                f"pip install 'nvidia-cuda-crt=={version or '<your CUDA version>'}.*' adds them.")
    sys.exit("CUDA headers not found (cuda.h, cuda_runtime.h, crt/host_defines.h). Looked in: " +
             ", ".join(candidates) + "." + hint + " Or set CUDA_HOME to a CUDA toolkit.")


class Build(BuildExtension):
    """torch's builder (ninja), with one build directory per extension: the extensions share
    sources but not flags, so shared object files would be rebuilt by every build."""

    def build_extension(self, ext):
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


CUDA_INCLUDE = cuda_include()
extensions = [
    Extension(
        name="torch_budget._host_core",
        sources=CORE + ["csrc/testing/host_driver.cpp"],
        include_dirs=[CUDA_INCLUDE],
        extra_compile_args=CXX_FLAGS + ["-std=c++17"],
        libraries=["dl"],
        language="c++",
    ),
    Extension(
        name="torch_budget._host_core_asan",
        sources=CORE + ["csrc/testing/host_driver.cpp"],
        include_dirs=[CUDA_INCLUDE],
        extra_compile_args=SANITIZE + ["-std=c++17", "-Wall"],
        extra_link_args=SANITIZE,
        libraries=["dl"],
        language="c++",
    ),
]
if torch.version.cuda:
    extensions.insert(0, CppExtension(
        name="torch_budget._C",
        sources=CORE + sorted(glob.glob("csrc/bridge/*.cpp")),
        include_dirs=[CUDA_INCLUDE, os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": CXX_FLAGS},
        libraries=["dl", "c10_cuda", "torch_cuda"],
    ))
else:
    print(f"torch {torch.__version__} is a CPU-only build: torch_budget._C (the allocator torch uses) needs a "
          "CUDA build of torch and is skipped; the host-core test libraries are built.", file=sys.stderr)

# TORCH_BUDGET_BUILD=_C (comma-separated short names) builds only those: a GPU machine needs no test cores.
_only = {n.strip() for n in os.environ.get("TORCH_BUDGET_BUILD", "").split(",") if n.strip()}
if _only:
    extensions = [e for e in extensions if e.name.rsplit(".", 1)[-1] in _only]

setup(
    name="torch_budget",
    version="0.1.0",
    description="An exact, enforced budget for CUDA device memory in PyTorch",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_budget", "torch_budget.*"]),
    package_data={"torch_budget": ["py.typed"]},  # type annotations are part of the API (PEP 561)
    python_requires=">=3.10",
    # torch is not pinned: the extension is built against, and runs with, the torch already installed.
    install_requires=["torch"],
    extras_require={"plot": ["matplotlib"], "progress": ["tqdm"], "test": ["pytest", "hypothesis", "numpy", "matplotlib"]},
    ext_modules=extensions,
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["torch-budget=torch_budget.cli:main"]},
)
