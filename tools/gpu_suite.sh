#!/usr/bin/env bash
# One call on a GPU machine: build, run every test (GPU ones included; the two-GPU
# ones when two devices are visible), the benchmarks, compute-sanitizer over the
# allocator's GPU tests and the demo, then print a short table last. Logs go to
# $OUT when it is set.
#
# Steps can be chosen with STEPS (default: "build tests torch tms bench sanitize demo"; "probe"
# times a torch.empty + del round trip against a bookkeeping-free allocator (tools/probe_roundtrip.py,
# PROBE_ARGS its arguments); "fuzz"
# runs the GPU fuzzer, FUZZ_ARGS its arguments; "sanitize-fuzz" runs it under compute-sanitizer,
# SANITIZE_FUZZ_ARGS its arguments); TESTS, PYTEST_ARGS (split on spaces), TEST_JOBS, BENCHES,
# SANITIZE_TESTS (files), SANITIZE_MARK (a marker expression, default gpu), SANITIZE_K and
# SANITIZE_SHARD (K/N: one of N shards, so that N calls with SANITIZE_TESTS=tests cover the whole
# suite) narrow them; SANITIZE_TOOL picks the sanitizer's tool (memcheck, racecheck, synccheck,
# initcheck); TORCH_BUDGET_GRAPH_HISTORY=1 makes torch's "tensor(s) in the cudagraph pool not
# tracked as outputs" error in the tests' and the fuzzer's child processes name each block's stack.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
STEPS=${STEPS:-build tests torch tms bench sanitize demo}
has() { [[ " $STEPS " == *" $1 "* ]]; }
summary=()
# A step's summary line is printed (and written to $OUT/summary.txt) as soon as the step ends, and
# again in the table at the end: a call cut short by its time limit still tells what finished.
note() {
  summary+=("$1")
  echo "SUMMARY $1"
  echo "$1" >>"$OUT/summary.txt"
}

if has build || [ ! -e torch_budget/_C*.so ]; then
  echo "== build"
  start=$(date +%s)
  TORCH_BUDGET_BUILD=${TORCH_BUDGET_BUILD:-_C,_host_core} MAX_JOBS=${MAX_JOBS:-32} $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  note "build        $(( $(date +%s) - start )) s"
fi

if has tests; then
  # Tests that read device-wide memory run alone first; the rest run in parallel processes
  # (each GPU test starts a fresh process anyway), which keeps the suite within one call.
  echo "== tests"
  start=$(date +%s)
  # --durations: the slowest tests are in the logs, for keeping the suite within one call
  $PY -m pytest -q -p no:cacheprovider -p no:benchmark -rfEs --durations=12 -m exclusive ${TESTS:-tests} \
    ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest-exclusive.log" | tail -20
  $PY -m pytest -q -p no:cacheprovider -p no:benchmark -rfEs --durations=25 -n ${TEST_JOBS:-8} -m "not exclusive" \
    ${TESTS:-tests} ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -40
  note "tests        alone: $(grep -E "(passed|failed|error)" "$OUT/pytest-exclusive.log" | tail -1); parallel: $(grep -E "(passed|failed|error)" "$OUT/pytest.log" | tail -1) [$(( $(date +%s) - start )) s]"
fi

if has torch; then
  # torch's own allocator tests (test/test_cuda.py of the installed torch, in .torch_tests/),
  # natively and under install().
  if [ -f .torch_tests/test_cuda.py ]; then
    echo "== torch's allocator tests"
    timeout ${TORCH_TESTS_TIMEOUT:-560} $PY tools/torch_allocator_tests.py --out "$OUT/torch_tests" 2>&1 \
      | tee "$OUT/torch_tests.log" | tail -40
    note "$(grep -h "^torch_tests" "$OUT/torch_tests.log" | tail -1)"
  else
    note "torch_tests  skipped: no .torch_tests/test_cuda.py"
  fi
fi

if has tms; then
  # torch_memory_saver's own examples against the adapter (their checkout's test/examples in .tms_examples/).
  if [ -f .tms_examples/simple.py ]; then
    echo "== torch_memory_saver's examples"
    timeout ${TMS_TIMEOUT:-560} $PY tools/tms_examples.py .tms_examples 2>&1 | tee "$OUT/tms_examples.log" | tail -30
    note "$(grep -h "^RESULT tms_examples" "$OUT/tms_examples.log" | sed 's/^RESULT //' | tail -1)"
  else
    note "tms_examples skipped: no .tms_examples/simple.py"
  fi
fi

if has bench; then
  for bench in ${BENCHES:-bench_alloc bench_e2e bench_graphs bench_workspace bench_sleep bench_tms bench_torch_surface plan_hf}; do
    [ -f "tools/$bench.py" ] || continue
    echo "== $bench"
    timeout 900 $PY "tools/$bench.py" 2>&1 | tee "$OUT/$bench.log" | tail -25
  done
fi

if has probe; then
  # A torch.empty + del round trip natively, installed, and over an allocator with no bookkeeping
  # (tools/probe_roundtrip.py): the floor any allocator behind torch's interface sits on.
  echo "== round-trip probe"
  timeout ${PROBE_TIMEOUT:-300} $PY tools/probe_roundtrip.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe_roundtrip.log" | tail -6
  note "$(grep -h "^RESULT probe_roundtrip" "$OUT/probe_roundtrip.log" | sed 's/^RESULT //' | tail -1)"
fi

if has fuzz; then
  # Seeded random programs under install() and natively, every byte checked (tools/fuzz_gpu.py).
  echo "== GPU fuzzer"
  start=$(date +%s)
  timeout ${FUZZ_TIMEOUT:-560} $PY tools/fuzz_gpu.py ${FUZZ_ARGS:---seeds 0-7 --ops 125000 --jobs 8} 2>&1 \
    | tee "$OUT/fuzz_gpu.log" | tail -20
  note "$(grep -h "^RESULT fuzz_gpu" "$OUT/fuzz_gpu.log" | sed 's/^RESULT //' | tail -1) [$(( $(date +%s) - start )) s]"
fi

SANITIZE_TOOL=${SANITIZE_TOOL:-memcheck}

if has sanitize-fuzz; then
  # The fuzzer's reduce-overhead steps are left out: under compute-sanitizer torch's CUDA graph
  # trees refuse their own pool natively too ("Detected 1 tensor(s) in the cudagraph pool not
  # tracked as outputs"), so they say nothing of the allocator there.
  export TORCH_BUDGET_UNDER_SANITIZER=1
  echo "== compute-sanitizer $SANITIZE_TOOL over the GPU fuzzer"
  start=$(date +%s)
  timeout ${SANITIZE_TIMEOUT:-420} compute-sanitizer --tool $SANITIZE_TOOL --target-processes all --error-exitcode 99 \
    $PY tools/fuzz_gpu.py ${SANITIZE_FUZZ_ARGS:---seeds 0-3 --ops 3000 --jobs 4} --without compiled \
    >"$OUT/sanitize_fuzz.log" 2>&1
  rc=$?
  tail -5 "$OUT/sanitize_fuzz.log"
  note "sanitize-fuzz $SANITIZE_TOOL rc=$rc (99: a sanitizer finding), $(grep -h "^RESULT fuzz_gpu" "$OUT/sanitize_fuzz.log" | sed 's/^RESULT //' | tail -1) [$(( $(date +%s) - start )) s]"
fi

if has sanitize; then
  # As in the tests step, tests that read device-wide memory run alone first (next to other
  # processes under the sanitizer they see its memory and theirs), then the rest in parallel.
  # Tests marked graph_trees and the fuzzer tests' compiled steps are left out, as in sanitize-fuzz
  # (TORCH_BUDGET_UNDER_SANITIZER): under the sanitizer torch's CUDA graph trees refuse their own
  # pool ("Detected 3 tensor(s) in the cudagraph pool not tracked as outputs",
  # test_reduce_overhead_matches_eager_over_twenty_steps, no memcheck error).
  # Under the sanitizer objects also outlive their `del`, on torch's native allocator as well:
  # tools/probe_retention.py finds a frame of torch's Tensor.__floordiv__ wrapper (_tensor.py) held
  # from C through a cell, and by its f_back the caller's locals (the demo's KV cache), so tests that
  # delete memory and then budget for the room it left (the demo, planner_hf, the vLLM graph pool's
  # last check) fail there and only there.
  export TORCH_BUDGET_UNDER_SANITIZER=1
  echo "== compute-sanitizer $SANITIZE_TOOL over the allocator's GPU tests"
  start=$(date +%s)
  rc=0 counts=""
  : >"$OUT/sanitize.log"
  for part in exclusive "not exclusive"; do
    jobs=${SANITIZE_JOBS:-6}
    [ "$part" = exclusive ] && jobs=0
    # -v: each test's outcome is a line as it ends, so a part the timeout stops still tells
    # which tests passed or failed before it (pytest's summary comes only at the end).
    timeout ${SANITIZE_TIMEOUT:-420} compute-sanitizer --tool $SANITIZE_TOOL --target-processes all --error-exitcode 99 \
      $PY -m pytest -v -p no:cacheprovider -p no:benchmark -n $jobs -m "${SANITIZE_MARK:-gpu} and $part" \
      ${SANITIZE_TESTS:-tests/test_allocator_gpu.py} -k "${SANITIZE_K:-not eight_threads}" \
      ${SANITIZE_SHARD:+--shard $SANITIZE_SHARD} >"$OUT/sanitize-part.log" 2>&1
    part_rc=$?
    # pytest's "no tests ran" (5) is not a failure of a part that selects nothing
    [ $part_rc -ne 0 ] && [ $part_rc -ne 5 ] && rc=$part_rc
    cat "$OUT/sanitize-part.log" >>"$OUT/sanitize.log"
    result=$(grep -E "^=* ?[0-9]+ (passed|failed|deselected|skipped|error)" "$OUT/sanitize-part.log" | tail -1 | sed 's/^=* //; s/ in [0-9.]*s.*//')
    if [ -z "$result" ]; then
      result="no summary (rc $part_rc), before it: $(grep -c " PASSED" "$OUT/sanitize-part.log") passed, $(grep -c " FAILED" "$OUT/sanitize-part.log") failed"
    fi
    counts+="${counts:+; }$([ "$part" = exclusive ] && echo alone || echo parallel): $result"
    grep -E "FAILED|ERROR SUMMARY: [1-9]" "$OUT/sanitize-part.log" | head -8
    tail -4 "$OUT/sanitize-part.log"
  done
  rm -f "$OUT/sanitize-part.log"
  errors=$(grep -E "ERROR SUMMARY: [1-9]" -c "$OUT/sanitize.log")
  note "sanitizer    $SANITIZE_TOOL${SANITIZE_SHARD:+ shard $SANITIZE_SHARD} rc=$rc, processes with errors: $errors, $(grep -c "ERROR SUMMARY: 0 errors" "$OUT/sanitize.log") clean; $counts [$(( $(date +%s) - start )) s]"
fi

if has demo; then
  echo "== demo"
  timeout 600 $PY -m torch_budget demo --quick --sleep --out "$OUT/ledger.png" 2>"$OUT/demo.err" | tee "$OUT/demo.log" | tail -30
  tail -5 "$OUT/demo.err"
fi

echo
echo "================ GPU suite: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sort | uniq -c | sed 's/^ *//'), torch $($PY -c 'import torch;print(torch.__version__)')"
for line in "${summary[@]}"; do echo "$line"; done
grep -h "^RESULT" "$OUT"/bench_*.log "$OUT"/plan_hf.log 2>/dev/null | sed 's/^RESULT //'
exit 0
