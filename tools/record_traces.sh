#!/usr/bin/env bash
# Records the three real workloads' allocation traces (tools/workloads.py) with torch's own
# memory history, natively, into a folder (default tools/traces): what tools/bench_alloc.py
# and `torch-budget replay` replay. Needs a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-tools/traces}
mkdir -p "$dest"
for w in llama_generate resnet_amp decode_graphs; do
  echo "== $w"
  timeout ${RECORD_TIMEOUT:-300} ${PYTHON:-python3} tools/workloads.py "$w" --repeats 1 --record "$dest/$w.tbtrace.gz" | tail -1
done
