"""The device lock (Note [The device lock], csrc/core/device_mutex.h): threads allocating and
freeing at once, each in the core's C loop (which runs without Python's lock), must leave a
ledger that counts every operation: a lock that let two threads in at once loses counter
updates (the ledger's counters are written with plain loads and stores under the lock) or
hands one block out twice."""
import random
import threading

import pytest

from _hostcore import GiB, MiB, Host, in_child
from torch_budget.replay.trace import Trace

pytestmark = pytest.mark.built("_host_core")

KiB = 1 << 10
THREADS = 4
ROUNDS = 6


def churn(seed, n=6000):
    """A program of round trips of one size (the parked block's path) mixed with other sizes
    and several live tensors (the pools' paths); every tensor freed by the end."""
    rng = random.Random(seed)
    t, live, next_id = Trace(f"churn{seed}"), [], 0
    for _ in range(n):
        if live and (rng.random() < 0.5 or len(live) > 24):
            t.free(live.pop(rng.randrange(len(live))))
        else:
            t.alloc(next_id, rng.choice([4 * KiB, 4 * KiB, 4 * KiB, 100 * KiB, 3 * MiB]) + rng.randrange(512), 0)
            live.append(next_id)
            next_id += 1
    for tid in live:
        t.free(tid)
    return t


def threads_replaying_at_once():
    h = Host(capacity=16 * GiB, route="vmm")
    traces = [churn(seed) for seed in range(THREADS)]
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
