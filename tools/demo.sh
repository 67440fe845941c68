#!/usr/bin/env bash
# Sets up (first run: a virtual environment with torch and torch_budget installed into it) and
# runs the demo, `torch-budget demo`: a small built-in decoder served under torch_budget on a
# GPU; without one, the plan and why it stops there.
PARTS=_C
source "$(dirname "$0")/setup_env.sh"
cli=("$(dirname "$PY")/torch-budget")
[ -x "${cli[0]}" ] || cli=("$PY" -m torch_budget)
"${cli[@]}" demo "$@" && rc=0 || rc=$?
how_to_use
exit $rc
