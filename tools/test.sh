#!/usr/bin/env bash
# Sets up (the first run: a virtual environment with torch; every run: torch_budget installed
# into it, every compiled part built) and runs every test, or the pytest arguments given. GPU
# tests skip cleanly on a machine without a CUDA device; there the whole suite runs on every
# core (pytest-xdist), while on a GPU tests run one at a time: some read device-wide memory.
PARTS="_C _host_core _host_core_asan"
source "$(dirname "$0")/setup_env.sh"
jobs=()
# whole files per worker: on 2 cores this measured faster than handing out single tests
[ $# -gt 0 ] || [ "${ENVIRONMENT[devices]}" != 0 ] || jobs=(-n auto --dist loadfile)
"$PY" -m pytest -q -p no:cacheprovider "${jobs[@]}" "$@" && rc=0 || rc=$?
how_to_use
exit $rc
