"""The GPU differential fuzzer, short: seeded programs of allocation, cross-stream use, graphs,
compiled steps, MemPool, sleep and budget changes read the same bytes installed as natively,
the ledger equal to the live blocks; and with the driver refusing 1 % of its memory calls,
every refusal is an out-of-memory error or a retry that succeeded (tools/fuzz_gpu.py has the
long run)."""
import pathlib
import sys

import pytest

pytestmark = pytest.mark.timeout(900)

# Imported by name from tools/ on sys.path: the consumer a program shares with is spawned, and
# the spawned process finds the module through the same path.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))
import fuzz_gpu as fuzz  # noqa: E402


def test_the_program_is_the_same_for_a_seed_and_covers_every_operation():
    ops = fuzz.program(3, 4000)
    assert ops == fuzz.program(3, 4000)
    kinds = {op[0] for op in ops}
    assert kinds >= {"alloc", "free", "check", "cross", "graph", "compiled", "mempool", "empty_cache", "sleep",
                     "budget"}


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_installed_reads_the_same_bytes_as_native(seed):
    r = fuzz.differential(seed, 3000)
    assert r["ok"], r


# torch's reductions open a shared CUDA tensor in torch's own formats: VMM memory goes as torch's
# expandable-segment handle, so a consumer on torch's native allocator opens it.
@pytest.mark.gpu
def test_a_tensor_shared_after_the_program_opens_in_a_native_consumer():
    r = fuzz.differential(2, 1000, share=True)
    assert r["ok"], r


@pytest.mark.gpu
def test_injected_driver_failures_are_out_of_memory_errors_or_retries():
    r = fuzz.differential(5, 3000, faults=0.01)
    assert r["ok"], r
    assert r["injected"] > 0
