# Sourced by tools/test.sh and tools/demo.sh: makes a Python with a CUDA build of torch and
# builds torch_budget's compiled parts in place, then sets $PY.
#
# - A Python that already has a CUDA build of torch (a GPU machine) is used as it is;
#   otherwise a virtual environment .venv is created with torch 2.14.1 (the first run
#   downloads several GB: a few minutes, with progress shown).
# - Python dependencies are installed once (again only when the list below changes).
# - Without a CUDA toolkit, the CUDA headers come from torch's own CUDA wheels.
# - The compiled parts are rebuilt only when a source is newer than them, and then only
#   the objects whose source changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
say() { echo "[setup] $*" >&2; }
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' >/dev/null 2>&1; }

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif has_cuda_torch python3 && ! [ -d .venv ]; then
  PY=python3
else
  if ! [ -x .venv/bin/python ]; then
    say "creating the virtual environment .venv"
    python3 -m venv .venv
  fi
  PY=$PWD/.venv/bin/python
  if ! has_cuda_torch "$PY"; then
    say "installing torch 2.14.1, a CUDA build (several GB; a few minutes the first time)"
    "$PY" -m pip install --disable-pip-version-check --progress-bar on "torch==2.14.1" >&2
  fi
fi

DEPS=(ninja pytest hypothesis numpy matplotlib "setuptools>=64" wheel)
mkdir -p build
stamp="build/.deps-$(echo "$PY ${DEPS[*]}" | cksum | cut -d' ' -f1)"
if ! [ -f "$stamp" ]; then
  if "$PY" -c 'import ninja, pytest, hypothesis, numpy, matplotlib, setuptools, wheel' >/dev/null 2>&1; then
    :
  else
    say "installing build and test dependencies: ${DEPS[*]}"
    "$PY" -m pip install --disable-pip-version-check -q "${DEPS[@]}" >&2
  fi
  touch "$stamp"
fi

# Without a toolkit (no CUDA_HOME, no /usr/local/cuda), torch's CUDA runtime wheel provides
# cuda.h; the crt/ headers its cuda_runtime.h includes come in a wheel of their own.
if [ -z "${CUDA_HOME:-}" ] && ! [ -f /usr/local/cuda/include/cuda.h ]; then
  if ! "$PY" - <<'PYEOF'
import glob, os, sys, torch
site = os.path.dirname(os.path.dirname(torch.__file__))
sys.exit(0 if glob.glob(os.path.join(site, "nvidia", "cu*", "include", "crt", "host_defines.h")) else 1)
PYEOF
  then
    crt="nvidia-cuda-crt==$("$PY" -c 'import torch; print(torch.version.cuda)').*"
    say "no CUDA toolkit here: installing the CUDA headers torch's wheels lack ($crt)"
    "$PY" -m pip install --disable-pip-version-check -q "$crt" >&2
  fi
fi

needs_build() {
  local libs=(torch_budget/_host_core.*.so torch_budget/_host_core_asan.*.so)
  has_cuda_torch "$PY" && libs+=(torch_budget/_C.*.so)
  local lib
  for lib in "${libs[@]}"; do
    [ -f "$lib" ] || return 0
    [ -z "$(find csrc setup.py -newer "$lib" -print -quit)" ] || return 0
  done
  return 1
}
if needs_build; then
  say "building torch_budget's compiled parts (log: build/build.log)"
  start=$(date +%s)
  if ! MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" setup.py build_ext --inplace >build/build.log 2>&1; then
    tail -40 build/build.log >&2
    say "the build failed; the whole log is build/build.log"
    exit 1
  fi
  say "built in $(( $(date +%s) - start )) s"
fi
export PY
