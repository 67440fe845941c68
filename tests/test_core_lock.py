"""The device lock (Note [The device lock], csrc/core/device_mutex.h): threads allocating and
freeing at once, each in the core's C loop (which runs without Python's lock), must leave a
ledger that counts every operation: a lock that let two threads in at once loses counter
updates (the ledger's counters are written with plain loads and stores under the lock) or
hands one block out twice."""
import threading

import pytest

from _hostcore import OOM, GiB, MiB, Host, in_child, isolated, while_a_sync_waits
from torch_budget.replay import mixes

pytestmark = pytest.mark.built("_host_core")

ROUNDS = 6


def programs():
    """Two threads churn the benchmark's small-only mix (the pools' paths, hundreds of live
    tensors), two a 4 KiB round trip (the parked block's path); every tensor freed by the end."""
    return [mixes.small(6000, seed=0), mixes.small(6000, seed=1), mixes.one_size(4096, 6000),
            mixes.one_size(4096, 6000)]


def threads_replaying_at_once():
    h = Host(capacity=16 * GiB, route="vmm")
    traces = programs()
    replays = [h.replayer(t, [h.stream()]) for t in traces]
    errors = []

    def run(replay):
        try:
            for _ in range(ROUNDS):
                replay()
        except Exception as e:  # noqa: BLE001 - collected, raised in the main thread
            errors.append(repr(e))

    workers = [threading.Thread(target=run, args=(r,)) for r in replays]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    s = h.stats()
    return (errors, any(w.is_alive() for w in workers), sum(t.allocations() for t in traces) * ROUNDS,
            s["allocation"]["all"], s["allocated_bytes"]["all"]["current"], s["active"]["all"]["current"])


def test_threads_in_the_core_at_once_leave_every_operation_counted():
    errors, stuck, expected, allocation, allocated_bytes, active = in_child(threads_replaying_at_once)
    assert not errors and not stuck
    # Every allocation counted once and freed once: nothing lost between two threads.
    assert allocation["allocated"] == expected and allocation["freed"] == expected
    assert allocation["current"] == 0 and allocated_bytes == 0 and active == 0


@isolated
def test_an_out_of_memory_message_names_its_own_refusal_while_another_thread_allocates():
    # The refusal was read from the device's Budget when the message was written, after the
    # failed allocation had let the lock go to trim a pool past the budget: an allocation of
    # another thread meanwhile had reset it, and a budget's refusal read as the driver's.
    h = Host(route="pool", vmm=False, pool_chunk=32 * MiB, budget=24 * MiB)
    h.fail("cuMemPoolTrimTo", nth=-1)  # the driver keeps what its pool grew by: 32 MiB, past the budget
    h.malloc(16 * MiB)
    assert h.reserved() == 32 * MiB
    # The first synchronisation is the retry's; the second the trim's, before the message.
    finished, refused, other = while_a_sync_waits(h, lambda: h.malloc(40 * MiB), lambda: h.malloc(4 * MiB),
                                                  passed=1)
    assert finished and not isinstance(other, Exception), other
    assert isinstance(refused, OOM), refused
    assert "it would exceed the budget of 24.00 MiB" in str(refused) and "raise the budget" in str(refused), refused
