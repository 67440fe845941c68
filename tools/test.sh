#!/usr/bin/env bash
# Sets up (the first run: a virtual environment with torch) and runs every test.
# GPU tests skip cleanly on a machine without a CUDA device.
source "$(dirname "$0")/setup_env.sh"
exec "$PY" -m pytest -q -p no:cacheprovider tests "$@"
