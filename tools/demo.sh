#!/usr/bin/env bash
# Sets up (first run: a virtual environment with torch) and runs the demo: a small
# built-in decoder served under torch_budget on a GPU; without one, the plan and why
# it stops there.
source "$(dirname "$0")/setup_env.sh"
exec "$PY" -m torch_budget demo "$@"
