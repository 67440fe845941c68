# Sourced by tools/test.sh and tools/demo.sh: makes a Python with a CUDA build of
# torch and builds torch_budget's compiled parts in place. Sets $PY.
# A Python that already has a CUDA build of torch (a GPU machine) is used as it is;
# otherwise a virtual environment .venv is created with torch 2.14.1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' >/dev/null 2>&1; }

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif has_cuda_torch python3 && ! [ -d .venv ]; then
  PY=python3
else
  if ! [ -x .venv/bin/python ]; then
    echo "setting up .venv (torch 2.14.1, CUDA build: a few minutes the first time)" >&2
    python3 -m venv .venv
  fi
  PY=$PWD/.venv/bin/python
  if ! has_cuda_torch "$PY"; then
    "$PY" -m pip install -q --upgrade pip >&2
    "$PY" -m pip install -q "torch==2.14.1" >&2
  fi
  "$PY" -m pip install -q numpy ninja pytest hypothesis matplotlib "setuptools>=64" wheel >&2
fi
echo "building torch_budget's compiled parts" >&2
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -q --no-build-isolation --no-deps -e . >&2
export PY
