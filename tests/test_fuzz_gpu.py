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


def test_under_the_sanitizer_the_differential_leaves_the_compiled_steps_out(monkeypatch):
    # There torch's CUDA graph trees refuse their own pool on the native allocator too.
    seen = []

    def one(seed, ops, installed, faults=0.0, skip=(), share=False, timeout=900, without=(), conf=""):
        seen.append(set(without))
        return {"error": "stopped here"}

    monkeypatch.setattr(fuzz, "one", one)
    monkeypatch.delenv("TORCH_BUDGET_UNDER_SANITIZER", raising=False)
    assert not fuzz.differential(0, 10)["ok"] and seen == [set()]
    monkeypatch.setenv("TORCH_BUDGET_UNDER_SANITIZER", "1")
    assert not fuzz.differential(0, 10, without=("sleep",))["ok"] and seen[1] == {"compiled", "sleep"}


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
