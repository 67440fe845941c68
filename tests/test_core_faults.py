"""Driver failures injected into every entry point of the stand-in driver."""
import os
import subprocess
import sys
import textwrap

import pytest

from _faultfuzz import ROUTES, run
from _hostcore import OOM, GiB, MiB, S1, S2, Host, isolated, line_pressed

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


def _unreachable(h, ptr, size):
    """MiB offsets of the granules of [ptr, ptr + size) that device 0 cannot access."""
    return [off >> 20 for off in range(0, size, 2 * MiB) if not h.can_access(0, ptr + off)]


def _mapping_whose_access_and_unmap_fail(how, access_failures):
    """An allocation whose new mapping's cuMemSetAccess is refused `access_failures` times in a row
    (-1: always) while every cuMemUnmap is refused, by a new run mapping ("grow") or a packing
    move's kept handle ("move"); then, the driver healed, the same request again. Returns the
    first request's outcome and the granules of each live block its device cannot access."""
    h = Host(capacity=16 * GiB, route="vmm", packing_time=1.0 if how == "move" else 0.0)
    keep = line_pressed(h) if how == "move" else [h.malloc(1 * MiB, S1)]
    h.fail("cuMemSetAccess", nth=access_failures)
    h.fail("cuMemUnmap", nth=-1)
    try:
        first = h.malloc(96 * MiB, S2)
        outcome = "allocated"
    except OOM as e:
        first, outcome = None, "refused: " + str(e)
    h.heal()
    second = h.malloc(96 * MiB, S2)
    dead = {p: _unreachable(h, p, 96 * MiB) for p in (first, second) if p is not None}
    for p in keep + [p for p in (first, second) if p is not None]:
        h.free(p)
    h.empty_cache()
    return outcome, dead, h.reserved(), h.device_used()


@pytest.mark.parametrize("how", ["grow", "move"])
def test_a_mapping_left_in_place_by_a_refused_unmap_is_never_handed_out_unreachable(how):
    # Note [Unreachable mappings]: the access call refused once and every unmap after it left
    # the mapping where it was, counted as backed, and the allocation's retry (or the next one)
    # handed 16 MiB of it out without access.
    @isolated
    def body():
        outcome, dead, reserved, used = _mapping_whose_access_and_unmap_fail(how, access_failures=1)
        assert outcome == "allocated"
        assert all(offsets == [] for offsets in dead.values()), dead
        assert reserved == used
    body()


@pytest.mark.parametrize("how", ["grow", "move"])
def test_a_mapping_that_stays_unreachable_fails_the_allocation_until_its_access_is_set(how):
    @isolated
    def body():
        outcome, dead, reserved, used = _mapping_whose_access_and_unmap_fail(how, access_failures=-1)
        assert outcome.startswith("refused") and "cuMemSetAccess" in outcome, outcome
        assert len(dead) == 1 and list(dead.values())[0] == [], dead  # the second, after the heal
        assert reserved == used
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
