"""Builds torch_budget's compiled parts against the torch installed in this environment.

    pip install --no-build-isolation .          (a checkout: pip install --no-build-isolation -e .)

--no-build-isolation: the extension links against the torch you will run it with, and pip's
build isolation would hide that torch. No CUDA toolkit is needed: the CUDA headers come from
CUDA_HOME when it is set, else from the CUDA wheels a CUDA build of torch installs
(site-packages/nvidia/*/include, where the crt/ headers are a wheel of their own), else from
/usr/local/cuda. When none has them, the build says which wheel to install. Nothing is
compiled by nvcc.

The parts (TORCH_BUDGET_BUILD picks them, comma-separated; unset means _C, what users run):
- _C: the allocator core, the C ABI and the torch bridge (csrc/bridge); needs a CUDA build of
  torch (the driver itself is loaded at run time).
- _host_core and _host_core_asan: the same core over a host-memory stand-in for the driver, for
  the CPU tests (the second built with AddressSanitizer). Only tools/test.sh builds them
  (TORCH_BUDGET_BUILD=all); a wheel never holds them.
`tests` names the two host cores, `all` every part, `none` no part (an editable install whose
parts are built in place with `setup.py build_ext --inplace`).

Each part compiles into its own build directory, so a second build recompiles only what
changed.
"""
import glob
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py

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

# The command line, and the plugins the serving stacks load from their entry-point groups in every process.
ENTRY_POINTS = {
    "console_scripts": ["torch-budget=torch_budget.cli:main"],
    "vllm.general_plugins": ["torch_budget = torch_budget.adapters.vllm:register"],
    "sglang.srt.plugins": ["torch_budget = torch_budget.adapters.sglang:register"],
}

PARTS = ("_C", "_host_core", "_host_core_asan")
GROUPS = {"all": PARTS, "tests": ("_host_core", "_host_core_asan"), "none": ()}

# The CUDA headers torch's own headers include; crt/ is where CUDA 13 split the wheels.
CUDA_HEADERS = ("cuda.h", "cuda_runtime.h", "crt/host_defines.h")
SYSTEM_CUDA = ("/usr/local/cuda/include",)


def selected_parts(value):
    """The parts TORCH_BUDGET_BUILD names (short names or groups); unset or empty: _C."""
    names = []
    for word in (value or "_C").split(","):
        word = word.strip()
        names += GROUPS.get(word, [word] if word else [])
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        sys.exit(f"TORCH_BUDGET_BUILD names no such part: {', '.join(unknown)} "
                 f"(parts: {', '.join(PARTS)}; groups: {', '.join(GROUPS)})")
    return [p for p in PARTS if p in names]


def _holds(directory, header):
    return os.path.isfile(os.path.join(directory, header))


def wheel_include_dirs(site):
    """The include directories of the CUDA wheels installed beside torch (site-packages/nvidia/*/include)."""
    return sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))


def cuda_include_dirs(cuda_home, site, system=SYSTEM_CUDA):
    """The include directories that hold CUDA_HEADERS, or None: CUDA_HOME's; else those of torch's
    CUDA wheels, one directory (CUDA 13's nvidia/cu13) or several (headers split over wheels),
    never mixed with a toolkit's, whose version may differ from torch's; else a toolkit in `system`."""
    if cuda_home and all(_holds(os.path.join(cuda_home, "include"), h) for h in CUDA_HEADERS):
        return [os.path.join(cuda_home, "include")]
    chosen, missing = [], list(CUDA_HEADERS)
    wheels = wheel_include_dirs(site)
    while missing and wheels:
        # the directory with the most of what is still missing; ties go to name order
        best = max(wheels, key=lambda d: sum(_holds(d, h) for h in missing))
        if not any(_holds(best, h) for h in missing):
            break
        chosen.append(best)
        missing = [h for h in missing if not _holds(best, h)]
    if not missing:
        return chosen
    for path in system:
        if all(_holds(path, h) for h in CUDA_HEADERS):
            return [path]
    return None


def wheels_for(cuda_version):
    """header -> the pip requirement whose wheel installs it beside torch, for torch's CUDA version."""
    major_minor = ".".join((cuda_version or "").split(".")[:2])
    if not major_minor:
        return {}
    major = major_minor.split(".")[0]
    if int(major) >= 13:
        runtime, crt = f"nvidia-cuda-runtime=={major_minor}.*", f"nvidia-cuda-crt=={major_minor}.*"
    else:
        runtime, crt = f"nvidia-cuda-runtime-cu{major}=={major_minor}.*", f"nvidia-cuda-nvcc-cu{major}=={major_minor}.*"
    return {"cuda.h": runtime, "cuda_runtime.h": runtime, "crt/host_defines.h": crt}


def missing_headers_message(cuda_home, site, cuda_version, system=SYSTEM_CUDA):
    wheels = wheel_include_dirs(site)
    looked = ([os.path.join(cuda_home, "include")] if cuda_home else []) + wheels + list(system)
    lacking = [h for h in CUDA_HEADERS if not any(_holds(d, h) for d in wheels)]
    msg = (f"CUDA headers not found: torch's own headers need {', '.join(CUDA_HEADERS)}. "
           f"Looked in: {', '.join(looked) or '(nowhere)'}.")
    provides = wheels_for(cuda_version)
    requirements = sorted({provides[h] for h in lacking}) if provides else []
    if requirements:
        quoted = " ".join(f"'{r}'" for r in requirements)
        msg += (f"\nWithout a CUDA toolkit, torch's CUDA wheels provide them; {', '.join(lacking)} "
                f"{'comes' if len(lacking) == 1 else 'come'} with:\n    pip install {quoted}\n"
                "Or set CUDA_HOME to a CUDA toolkit.")
    else:
        msg += " Set CUDA_HOME to a CUDA toolkit."
    return msg


class Build(BuildExtension):
    """torch's builder (ninja), with the CUDA headers found when there is something to build (an
    sdist needs none) and one build directory per part: the parts share sources but not flags, so
    shared object files would be rebuilt by every build."""

    def build_extensions(self):
        cuda_home, site = os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(torch.__file__))
        dirs = cuda_include_dirs(cuda_home, site)
        if dirs is None:
            sys.exit(missing_headers_message(cuda_home, site, torch.version.cuda))
        print(f"CUDA headers from {', '.join(dirs)}", file=sys.stderr)
        for ext in self.extensions:
            ext.include_dirs = dirs + ext.include_dirs
        super().build_extensions()

    def build_extension(self, ext):
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


STARTUP_FILE = "torch_budget-startup.pth"


class BuildPy(build_py):
    """The pure-Python part; also drops from the build directory the compiled parts this build does
    not make: a wheel packs the whole build directory, which a build for the tests shares."""

    def run(self):
        wanted = {e.name.rsplit(".", 1)[-1] for e in self.distribution.ext_modules or []}
        for part in set(PARTS) - wanted:
            for stale in glob.glob(os.path.join(self.build_lib, "torch_budget", part + ".*")):
                os.remove(stale)
        super().run()
        # The startup file goes to the top of site-packages, where Python's site module reads it at
        # every start (torch_budget.startup: TORCH_BUDGET_SERVE); an editable install has none.
        if not getattr(self, "editable_mode", False):
            self.copy_file(os.path.join(HERE, "torch_budget", "startup.pth"),
                           os.path.join(self.build_lib, STARTUP_FILE))


def extensions(parts):
    made = []
    if "_C" in parts:
        if torch.version.cuda:
            made.append(CppExtension(
                name="torch_budget._C",
                sources=CORE + sorted(glob.glob("csrc/bridge/*.cpp")),
                include_dirs=[os.path.join(HERE, "csrc")],
                extra_compile_args={"cxx": CXX_FLAGS},
                libraries=["dl", "c10_cuda", "torch_cuda"],
            ))
        else:
            print(f"torch {torch.__version__} is a CPU-only build: torch_budget._C (the allocator torch uses) needs a "
                  "CUDA build of torch and is not built.", file=sys.stderr)
    if "_host_core" in parts:
        made.append(Extension(
            name="torch_budget._host_core",
            sources=CORE + ["csrc/testing/host_driver.cpp"],
            extra_compile_args=CXX_FLAGS + ["-std=c++17"],
            libraries=["dl"],
            language="c++",
        ))
    if "_host_core_asan" in parts:
        made.append(Extension(
            name="torch_budget._host_core_asan",
            sources=CORE + ["csrc/testing/host_driver.cpp"],
            extra_compile_args=SANITIZE + ["-std=c++17", "-Wall"],
            extra_link_args=SANITIZE,
            libraries=["dl"],
            language="c++",
        ))
    return made


def main():
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
        extras_require={"plot": ["matplotlib"], "progress": ["tqdm"],
                        "test": ["pytest", "hypothesis", "numpy", "matplotlib"]},
        ext_modules=extensions(selected_parts(os.environ.get("TORCH_BUDGET_BUILD"))),
        cmdclass={"build_ext": Build.with_options(use_ninja=True), "build_py": BuildPy},
        entry_points=ENTRY_POINTS,
    )


if __name__ == "__main__":  # pip and setuptools run this file as __main__; the tests import its functions
    main()
