"""Driver failures injected into every entry point of the stand-in driver."""
import os
import subprocess
import sys
import textwrap

import pytest

from _faultfuzz import ROUTES, run
from _hostcore import OOM, MiB, S1, Host, isolated

pytestmark = pytest.mark.built("_host_core")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("route", ROUTES)
def test_one_percent_driver_failures_over_100k_operations_keep_every_invariant(route):
    @isolated
    def body():
        counts = run(route, ops=100_000, seed=11 + ROUTES.index(route))
        print(route, counts)
        assert counts["injected"] > 1000, counts   # the driver really failed, often
        assert counts["alloc"] > 10_000 and counts["oom"] > 0, counts
        assert counts["retries"] > 0, counts
        assert counts["checkpoint"] > 100, counts  # graph-tree checkpoints restored under faults
        assert counts["capture_reuse"] > 100, counts  # record_stream frees inside a capture
        if route == "vmm":  # tag "t" was released and restored, and some of it failed
            assert counts["release"] > 100 and counts["restore"] > 100 and counts["sleep_failed"] > 0, counts
            assert counts["discarding"] > 20, counts  # releases told to discard some blocks
    body()


@pytest.mark.parametrize("entry", ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemAddressReserve",
                                   "cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemAllocFromPoolAsync",
                                   "cuMemPoolGetAttribute", "cuMemAlloc"])
def test_a_single_failure_of_any_allocating_entry_point_is_retried(entry):
    @isolated
    def body():
        route = "pool" if "Pool" in entry else "sync" if entry == "cuMemAlloc" else "vmm"
        h = Host(route=route)
        h.free(h.malloc(1 * MiB))
        h.empty_cache()
        h.fail(entry, nth=1)
        p = h.malloc(8 * MiB)          # fails once inside; retried (the call itself, or the allocation)
        assert h.counters()["injected"] == 1
        assert h.stats()["num_alloc_retries"] <= 1
        h.free(p)
        h.empty_cache()
        assert h.device_used() == 0
    body()


def test_a_failure_that_persists_surfaces_as_out_of_memory_naming_the_call():
    @isolated
    def body():
        h = Host(route="vmm")
        h.fail("cuMemMap", rate=1.0)
        with pytest.raises(OOM, match=r"cuMemMap.*failed with CUDA_ERROR_UNKNOWN"):
            h.malloc(8 * MiB, S1)
        h.heal()
        assert h.reserved() == h.device_used()
        h.free(h.malloc(8 * MiB, S1))
    body()


def _asan_runtime():
    try:
        out = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    path = out.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


SANITIZED = """
import sys
sys.path.insert(0, {here!r})
from _faultfuzz import race, run
from _hostcore import MiB, Host
if {route!r} != "threads":
    print(run({route!r}, ops={ops}, seed=5, library="_host_core_asan"))
    sys.exit(0)
# Threads racing frees, record_stream and allocations under injected failures, then a
# free that arrives during process exit, after thread-local objects are destroyed.
h = Host(route="vmm", budget=512 * MiB, library="_host_core_asan")
h.free(h.malloc(1 * MiB))                # creates the device before any fault
h.fail("*", rate=0.01, seed=3)
shared, errors = race(h, ops=2000)
assert not errors, errors
h.heal()
for p in shared:
    h.free(p)
try:
    h.free(12345)                        # leaves a long error message on this thread
except ValueError:
    pass
last = h.malloc(5 * MiB)
h.lib.tb_host_free_at_exit(last)
print("threads ok")
"""


@pytest.mark.parametrize("route", list(ROUTES) + ["threads"])
@pytest.mark.built("_host_core_asan")
def test_no_sanitizer_finding_under_fault_injection(route):
    runtime = _asan_runtime()
    if runtime is None:
        pytest.skip("no AddressSanitizer runtime (g++ -print-file-name=libasan.so)")
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87")
    code = textwrap.dedent(SANITIZED).format(here=HERE, route=route, ops=20_000)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-6000:]
    assert "ERROR: AddressSanitizer" not in report and "runtime error" not in report, report[-6000:]
