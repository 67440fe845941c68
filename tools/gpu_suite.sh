#!/usr/bin/env bash
# One call on a GPU machine: build, run every test (GPU ones included) and the
# benchmarks, then print a short table last. Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

echo "== build"
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"

echo "== tests"
$PY -m pytest -q -p no:cacheprovider ${TESTS:-tests} ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -40
tests_line=$(grep -E "(passed|failed|error)" "$OUT/pytest.log" | tail -1)

for bench in ${BENCHES:-bench_alloc bench_graphs bench_workspace}; do
  [ -f "tools/$bench.py" ] || continue
  echo "== $bench"
  timeout 900 $PY "tools/$bench.py" 2>&1 | tee "$OUT/$bench.log" | tail -25
done

if [ -z "${NO_DEMO:-}" ]; then
  echo "== demo"
  timeout 600 $PY -m torch_budget demo --quick --out "$OUT/ledger.png" 2>"$OUT/demo.err" | tee "$OUT/demo.log" | tail -30
  tail -5 "$OUT/demo.err"
fi

echo
echo "================ GPU suite: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1), torch $($PY -c 'import torch;print(torch.__version__)')"
echo "tests        $tests_line"
grep -h "^RESULT" "$OUT"/bench_*.log 2>/dev/null | sed 's/^RESULT //'
