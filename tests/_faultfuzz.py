"""Random operations on the core while the stand-in driver fails at random.

Shared by the fault-injection tests (plain build in a forked child; sanitizer build
in a subprocess). Every step checks the invariants that must survive any driver
failure; `run` raises AssertionError on the first violation and returns counts.
"""
import random
import threading

from _hostcore import OOM, S1, S2, S3, MiB, Host
from torch_budget.errors import TorchBudgetError

ROUTES = ("vmm", "pool", "sync")


def run(route, ops, seed, rate=0.01, library="_host_core", budget=256 * MiB, capacity=1024 * MiB,
        pool_chunk=32 * MiB):
    rng = random.Random(seed)
    h = Host(route=route, budget=budget, capacity=capacity, pool_chunk=pool_chunk, library=library)
    streams = [h.stream(0) for _ in range(3)]
    capture_stream = h.stream(0)
    h.free(h.malloc(1 * MiB, streams[0]))  # creates the device before any fault
    h.set_current(0)
    h.capture_reuse(True)  # Note [Reuse during capture]: exercised by the capture step
    h.fail("*", rate=rate, seed=seed + 1)

    live = {}            # ptr -> requested bytes
    held_pools = []      # graph pools still to release
    counts = {"alloc": 0, "oom": 0, "free": 0, "record": 0, "empty_cache": 0, "capture": 0, "release": 0,
              "restore": 0, "sleep_failed": 0, "discarding": 0, "checkpoint": 0, "checkpoint_failed": 0, "capture_reuse": 0}
    next_pool = 1
    # Sleep and wake (VMM only): blocks under tag "t" carry a pattern that a restore with a
    # cpu or pinned backup must bring back, whatever failed before.
    sleepy = route == "vmm"
    tagged = {}          # ptr -> pattern bytes (None: contents undefined)
    backup = None        # the tag's last release mode while it is released
    discarded = []       # blocks its last release was told to discard (Note [Discardable blocks])

    def released():
        return h.tag_info("t")["life"] != 0 if sleepy and "t" in tag_names else False

    tag_names = set()

    def pattern(p):
        data = bytes(rng.randrange(256) for _ in range(64))
        if h.poke(p, data):
            tagged[p] = data

    def check(step, what):
        st = h.stats()
        reserved = st["reserved_bytes"]["all"]["current"]
        assert reserved <= budget, f"step {step} ({what}): reserved {reserved} over the budget {budget}"
        assert st["requested_bytes"]["all"]["current"] == sum(live.values()), \
            f"step {step} ({what}): ledger {st['requested_bytes']['all']['current']} != live {sum(live.values())}"
        assert st["allocation"]["all"]["current"] == len(live), f"step {step} ({what}): allocation count"
        assert h.device_used() == reserved, \
            f"step {step} ({what}): the driver holds {h.device_used()}, the ledger says {reserved}"
        assert h.current() == 0, f"step {step} ({what}): current device moved to {h.current()}"

    def allocate(stream, tag=False):
        size = max(64, min(int(rng.lognormvariate(13, 3)), 64 * MiB))
        if tag:
            h.push("vmm", "t")
            tag_names.add("t")
        try:
            p = h.malloc(size, stream)
            live[p] = size
            counts["alloc"] += 1
            if tag:
                pattern(p)
        except OOM:
            counts["oom"] += 1
        finally:
            if tag:
                h.pop()

    def verify(what):
        for p, data in tagged.items():
            if data is not None:
                assert h.peek(p, len(data)) == data, f"{what}: a block of tag 't' lost its contents"

    for step in range(ops):
        r = rng.random()
        if r < 0.45 and len(live) < 48:
            what = "malloc"
            allocate(rng.choice(streams), tag=sleepy and rng.random() < 0.3 and not released())
        elif r < 0.85 and live:
            what = "free"
            p = rng.choice(list(live))
            del live[p]
            tagged.pop(p, None)
            h.free(p)
            counts["free"] += 1
        elif sleepy and r < 0.87 and "t" in tag_names:
            if not released():
                what = "release"
                mode = rng.choice(["none", "memset", "cpu", "pinned"])
                discard = [p for p in tagged if rng.random() < 0.5] if rng.random() < 0.3 else None
                try:
                    h.release("t", mode, discard=discard)
                    counts["release"] += 1
                    counts["discarding"] += discard is not None
                except (TorchBudgetError, *OOM):
                    counts["sleep_failed"] += 1
                if released():
                    backup, discarded = mode, discard or []
                else:
                    verify("a failed release")  # put back whole, discardable blocks included
            else:
                what = "restore"
                try:
                    h.restore("t")
                    counts["restore"] += 1
                except (TorchBudgetError, *OOM):
                    counts["sleep_failed"] += 1
                if not released():
                    for p in list(tagged) if backup in ("none", "memset") else discarded:
                        if p in tagged:  # contents undefined: the caller writes them again
                            pattern(p)
                    verify("a restore")
        elif r < 0.91 and live:
            what = "record_stream"
            h.record_stream(rng.choice(list(live)), rng.choice(streams))
            counts["record"] += 1
        elif r < 0.97:
            what = "stream work"
            s = rng.choice(streams)
            (h.submit if rng.random() < 0.5 else h.complete)(s)
        elif r < 0.985:
            what = "empty_cache"
            h.empty_cache()
            counts["empty_cache"] += 1
        else:
            what = "capture"
            pool = (0, next_pool)
            next_pool += 1
            before = set(live)
            other = rng.choice(streams)
            for s in (capture_stream, other):  # both in one capture (sequence = pool number)
                h.capture(s, pool[1])
            h.begin_pool(pool, capture_stream)
            for _ in range(rng.randrange(1, 4)):
                allocate(capture_stream)
            if set(live) - before and rng.random() < 0.5:
                # A block read on the other stream, freed, and (once the capture stream
                # waited for that read) taken again in the same capture.
                p = rng.choice(sorted(set(live) - before))
                read, join = 2 * pool[1] + 1, 2 * pool[1] + 2
                h.node(read)
                h.capture(other, pool[1], [read])
                h.record_stream(p, other)
                del live[p]
                h.free(p)
                h.node(join, [read])
                h.capture(capture_stream, pool[1], [join])
                allocate(capture_stream)
                counts["capture_reuse"] += 1
            h.end_pool(pool)
            for s in (capture_stream, other):
                h.capture(s, 0)
            held_pools.append(pool)
            mine = {p: live[p] for p in set(live) - before}
            if mine and rng.random() < 0.5:
                # A graph tree's checkpoint: the layout comes back at the same addresses
                # after the pool's blocks changed (Note [Pool checkpoints]).
                what = "checkpoint"
                cp = h.checkpoint(pool)
                gone = rng.choice(list(mine))
                del live[gone]
                h.free(gone)
                errors = []
                freed, created = h.restore_checkpoint(cp, errors=errors)
                for p in freed:
                    live.pop(p, None)
                if errors:
                    counts["checkpoint_failed"] += 1
                else:
                    assert sorted(created) == sorted(mine), (created, mine)
                    live.update(mine)
                    counts["checkpoint"] += 1
            if len(held_pools) > 2:
                h.release_pool(held_pools.pop(0))
            counts["capture"] += 1
        check(step, what)

    h.heal()
    # Room for the final restore: everything but tag "t"'s blocks goes first.
    for p in [p for p in live if p not in tagged]:
        h.free(p)
        del live[p]
    for pool in held_pools:
        h.release_pool(pool)
    h.empty_cache()
    if released():
        h.restore("t")
        if backup in ("cpu", "pinned"):
            for p in discarded:
                tagged.pop(p, None)  # contents undefined
            verify("the final restore")
    for p in list(live):
        h.free(p)
    live.clear()
    for s in streams + [capture_stream]:
        h.complete(s)
    h.empty_cache()
    st = h.stats()
    for key in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "allocation", "active",
                "segment"):
        assert st[key]["all"]["current"] == 0, (key, st[key])
    assert st["graph_pool_reserved"]["current"] == 0
    c = h.counters()
    assert h.device_used() == 0 and c["handles"] == c["mappings"] == c["reservations"] == c["allocs"] == 0, c
    counts["injected"] = c["injected"]
    counts["retries"] = st["num_alloc_retries"]
    return counts


def race(h, threads=4, ops=3000):
    """Threads allocating, freeing and recording streams on one another's blocks at once; a
    block may be freed by one thread while another records a stream on it. Returns the blocks
    still live and the errors the threads met (out-of-memory refusals are not errors)."""
    shared, errors, lock = [], [], threading.Lock()

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(ops):
                r = rng.random()
                if r < 0.4:
                    try:
                        p = h.malloc(rng.choice([512, 70_000, 3 * MiB]), rng.choice([S1, S2]))
                    except OOM:
                        continue
                    with lock:
                        shared.append(p)
                elif r < 0.7:
                    with lock:
                        p = shared.pop(rng.randrange(len(shared))) if shared else None
                    if p:
                        h.free(p)
                else:
                    with lock:
                        p = rng.choice(shared) if shared else None
                    if p:
                        try:
                            h.record_stream(p, S3)
                        except ValueError:
                            pass  # freed by another thread meanwhile
        except BaseException as e:  # collected for the caller
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return shared, errors
