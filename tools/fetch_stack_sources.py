"""Fetches the source files of released serving stacks that the adapters speak to, so tests can
check the adapters against the stacks' own interface classes on a machine that cannot run the
stacks (no GPU, another torch): each wheel is downloaded from the package index without its
dependencies and only the named files are kept, under .stack_src/<package>-<version>/.

    python tools/fetch_stack_sources.py            # every release in RELEASES
    python tools/fetch_stack_sources.py vllm==0.34.0

tests/test_adapter_*_real.py load them (CI runs this first; without them those tests skip).
"""
import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

REPO = pathlib.Path(__file__).resolve().parent.parent
DEST = REPO / ".stack_src"
# vLLM 0.33 added pluggable sleep-mode backends with suspend(level); 0.34 changed it to
# suspend(discardable) and CuMemAllocator.sleep(offload_tags, discardable).
# SGLang 0.5.23 keeps its memory-saver adapter in sglang.srt.utils and loads sglang.srt.plugins.
# torch_memory_saver 0.0.10: the singleton's API that SGLang and verl call.
RELEASES = ["vllm==0.33.0", "vllm==0.34.0", "sglang==0.5.23", "torch_memory_saver==0.0.10"]
FILES = {"vllm": ["vllm/device_allocator/__init__.py", "vllm/device_allocator/sleep_mode_backend.py",
                  "vllm/device_allocator/cumem.py"],
         "sglang": ["sglang/srt/utils/torch_memory_saver_adapter.py", "sglang/srt/constants.py",
                    "sglang/srt/plugins/__init__.py"],
         "torch_memory_saver": ["torch_memory_saver/__init__.py", "torch_memory_saver/entrypoint.py"]}


def fetch(spec: str) -> pathlib.Path:
    name, _, version = spec.partition("==")
    if name not in FILES or not version:
        raise SystemExit(f"fetch_stack_sources: give PACKAGE==VERSION with PACKAGE one of {sorted(FILES)}, got {spec!r}")
    out = DEST / f"{name}-{version}"
    if all((out / f).is_file() for f in FILES[name]):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-q", "-d", tmp, spec], check=True)
        wheels = list(pathlib.Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"fetch_stack_sources: expected one wheel for {spec}, found {[w.name for w in wheels]}")
        staging = pathlib.Path(tmp) / "files"
        with zipfile.ZipFile(wheels[0]) as z:
            missing = [f for f in FILES[name] if f not in z.namelist()]
            if missing:
                raise SystemExit(f"fetch_stack_sources: {wheels[0].name} has no {', '.join(missing)}")
            for f in FILES[name]:
                z.extract(f, staging)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/fetch_stack_sources.py")
    ap.add_argument("releases", nargs="*", default=RELEASES, help="PACKAGE==VERSION (default: %(default)s)")
    args = ap.parse_args(argv)
    for spec in args.releases:
        print(f"fetch_stack_sources: {spec} -> {fetch(spec).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
