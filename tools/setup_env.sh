# Sourced by tools/test.sh and tools/demo.sh (after they set PARTS, the compiled parts they
# need): makes a Python with a CUDA build of torch, installs torch_budget into it, builds
# the parts in place, then sets $PY.
#
# - The Python is .venv, a virtual environment made on the first run. It gets torch 2.14.1
#   (several GB: a few minutes, with progress shown), unless python3 already has a CUDA build
#   of torch: then .venv uses that one (--system-site-packages). PYTHON=... picks another.
# - torch_budget is installed into it editable (it runs from this checkout, with the
#   `torch-budget` command); again only when setup.py or pyproject.toml changed.
# - Build and test dependencies are installed when one is missing.
# - Without a CUDA toolkit the CUDA headers come from torch's own CUDA wheels; the one wheel
#   torch does not install (the crt/ headers) is installed when the build needs it.
# - The parts are rebuilt only when a source is newer than them, and then only the objects
#   whose source changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
say() { echo "[setup] $*" >&2; }
pip_install() { "$PY" -m pip install --disable-pip-version-check "$@" >&2; }
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' >/dev/null 2>&1; }

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  if ! [ -x .venv/bin/python ]; then
    if has_cuda_torch python3; then
      say "creating the virtual environment .venv over python3's CUDA build of torch"
      python3 -m venv --system-site-packages .venv
    else
      say "creating the virtual environment .venv"
      python3 -m venv .venv
    fi
  fi
  PY=$PWD/.venv/bin/python
fi

# One look at the environment (one torch import): what is missing, by setup.py's own rules.
DEPS=(ninja pytest pytest-xdist hypothesis numpy matplotlib "setuptools>=70.1")
look() { "$PY" -I - "$PWD" <<'PYEOF'
import importlib.metadata as md, importlib.util, json, os, runpy, sys
here = sys.argv[1]
try:
    import torch
except ImportError:
    torch = None
cuda = bool(torch and torch.version.cuda)
print("cuda_torch", int(cuda))
print("devices", torch.cuda.device_count() if cuda else 0)
print("venv", int(sys.prefix != sys.base_prefix))
modules = {"ninja": "ninja", "pytest": "pytest", "pytest-xdist": "xdist", "hypothesis": "hypothesis",
           "numpy": "numpy", "matplotlib": "matplotlib"}
missing = [req for req, mod in modules.items() if importlib.util.find_spec(mod) is None]
try:
    old_setuptools = tuple(int(x) for x in md.version("setuptools").split(".")[:2]) < (70, 1)
except md.PackageNotFoundError:
    old_setuptools = True
if old_setuptools:
    missing.append("setuptools>=70.1")
print("deps", int(not missing))
site = os.path.dirname(os.path.dirname(torch.__file__)) if torch else ""
build = {} if old_setuptools or not torch else runpy.run_path(os.path.join(here, "setup.py"), run_name="probe")  # not setup()
if build and build["cuda_include_dirs"](os.environ.get("CUDA_HOME"), site) is None:
    provides = build["wheels_for"](torch.version.cuda)
    lacking = [h for h in build["CUDA_HEADERS"]
               if not any(os.path.isfile(os.path.join(d, h)) for d in build["wheel_include_dirs"](site))]
    print("header_wheels", " ".join(sorted({provides[h] for h in lacking})) if provides else "")
# Installed: an editable install of this checkout, newer than its packaging files, with its command.
try:
    dist = md.distribution("torch_budget")
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    record = next((f for f in dist.files or [] if f.name == "RECORD"), None)
    fresh = record is not None and os.path.getmtime(record.locate()) >= max(
        os.path.getmtime(os.path.join(here, f)) for f in ("setup.py", "pyproject.toml"))
    ok = (url.get("url") == "file://" + here and url.get("dir_info", {}).get("editable") and fresh
          and os.path.isfile(os.path.join(os.path.dirname(sys.executable), "torch-budget")))
except md.PackageNotFoundError:
    ok = False
print("installed", int(bool(ok)))
PYEOF
}
declare -A ENVIRONMENT
look_around() {
  local probe key value
  mkdir -p build
  probe=$(look 2>build/look.log) || { cat build/look.log >&2; exit 1; }
  ENVIRONMENT=()
  while read -r key value; do ENVIRONMENT[$key]=$value; done <<<"$probe"
}
look_around
if [ "${ENVIRONMENT[cuda_torch]}" != 1 ] && [ "$PY" = "$PWD/.venv/bin/python" ]; then
  say "installing torch 2.14.1, a CUDA build (several GB; a few minutes the first time)"
  pip_install --progress-bar on "torch==2.14.1"
  look_around
fi
if [ "${ENVIRONMENT[deps]}" != 1 ]; then
  say "installing build and test dependencies: ${DEPS[*]}"
  pip_install -q "${DEPS[@]}"
  look_around  # setup.py's header search needs a recent setuptools
fi

# The parts the caller needs that this torch can build: _C needs a CUDA build of torch.
libs=()
for part in ${PARTS:-_C}; do
  [ "$part" != _C ] || [ "${ENVIRONMENT[cuda_torch]}" = 1 ] && libs+=("$part")
done
needs_build() {
  local part lib
  for part in "${libs[@]}"; do
    lib=$(compgen -G "torch_budget/$part.*.so") || return 0
    [ -z "$(find csrc setup.py -newer "$lib" -print -quit)" ] || return 0
  done
  return 1
}
if [ ${#libs[@]} -gt 0 ] && needs_build; then
  # header_wheels: set when the build would not find the CUDA headers; the wheels that add them.
  if [ -n "${ENVIRONMENT[header_wheels]+set}" ]; then
    if [ -z "${ENVIRONMENT[header_wheels]}" ]; then
      say "no CUDA headers here (no CUDA_HOME, no /usr/local/cuda, and torch has no CUDA wheels)"
      exit 1
    fi
    say "no CUDA toolkit here: installing the CUDA headers torch's wheels lack (${ENVIRONMENT[header_wheels]})"
    # shellcheck disable=SC2086  (one word per requirement)
    pip_install -q ${ENVIRONMENT[header_wheels]}
  fi
  say "building torch_budget's compiled parts ${libs[*]} (log: build/build.log)"
  start=$(date +%s)
  if ! TORCH_BUDGET_BUILD=$(IFS=,; echo "${libs[*]}") MAX_JOBS=${MAX_JOBS:-$(nproc)} \
       "$PY" setup.py build_ext --inplace >build/build.log 2>&1; then
    tail -40 build/build.log >&2
    say "the build failed; the whole log is build/build.log"
    exit 1
  fi
  say "built in $(( $(date +%s) - start )) s"
fi

# The parts were built in place above: the install compiles nothing (TORCH_BUDGET_BUILD=none).
if [ "${ENVIRONMENT[installed]}" != 1 ]; then
  if [ "${ENVIRONMENT[venv]}" = 1 ]; then
    say "installing torch_budget into $(dirname "$(dirname "$PY")") (editable: it runs from this checkout)"
    TORCH_BUDGET_BUILD=none pip_install -q --no-build-isolation --no-deps -e .
  else
    say "$PY is not a virtual environment: torch_budget is not installed into it" \
        "(pip install --no-build-isolation -e . does)"
  fi
fi

# How to use the install afterwards (the scripts call this last).
how_to_use() {
  local bin
  bin=$(dirname "$PY")
  [ -x "$bin/torch-budget" ] || return 0
  bin=${bin#"$PWD"/}
  say "torch_budget is installed in $(dirname "$bin"): run $bin/torch-budget doctor (or plan, demo, report," \
      "replay), or source $bin/activate first"
}
export PY
