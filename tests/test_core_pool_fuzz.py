"""Random programs over private pools on the host stand-in: graph pools captured untagged (the
synchronous route, torch's layout) and under a tag (a VMM arena), MemPools that never split,
record_stream, pool checkpoints restored at the same addresses (CUDA graph trees), pools released
and revived, the tag released with a copy and restored (sleep / wake), the default pool beside
them, empty_cache. After every few steps: no two live blocks
overlap, every block the program wrote still reads back its stamp, each pool's live blocks are
the model's, the ledger counts exactly the live blocks (torch's small_pool the requests of its
small size class), reserved memory is what the driver holds; at the end nothing is left.

The long run of these programs is tools/fuzz_host.py's `pools` configuration."""
import random

import pytest

from _hostcore import GiB, Host, MiB, S1, S2, S3, in_child
from test_core_vmm_fuzz import probes, stamp  # a stamp in every granule a block touches
from torch_budget.errors import InvalidArgumentError, StateError

pytestmark = pytest.mark.built("_host_core")

POOLS = [(0, 41), (0, 42), (0, 43)]
SIZES = [lambda r: r.randrange(1, 64 << 10), lambda r: r.randrange(64 << 10, 1 << 20),
         lambda r: (1 << 20) - r.randrange(512), lambda r: r.randrange(1 << 20, 12 * MiB),
         lambda r: r.randrange(12 * MiB, 40 * MiB)]


ZERO = "zero"  # a block's contents after a memset backup




class Program:
    def __init__(self, seed, library="_host_core"):
        self.rng = random.Random(seed)
        self.h = Host(capacity=4 * GiB, route="vmm", library=library)
        self.live = {}  # ptr -> (size, signature (None: undefined, ZERO: zeros), pool or None, tag or None)
        self.pending = set()  # freed blocks waiting on S3's work (record_stream)
        self.capturing = None  # the pool S2 allocates into while open
        self.uses = {p: 0 for p in POOLS}  # uses taken by captures, not yet released
        self.tagged = {}  # pool -> the tag it was created under (None: untagged), while it exists
        self.checkpoints = []  # (pool, checkpoint id, {ptr: size} live in the pool then)
        self.asleep = False  # tag "g" released (with a copy): its pools wait for the restore

    # -- model
    def pool_live(self, pool):
        return {p: v[0] for p, v in self.live.items() if v[2] == pool}

    def allocate(self, size, stream, pool, tag=None):
        if tag:
            self.h.push(tag=tag)
        try:
            ptr = self.h.malloc(size, stream)
        finally:
            if tag:
                self.h.pop()
        assert ptr not in self.live, f"{ptr:#x} handed out twice"
        sig = self.rng.getrandbits(64)
        for off in probes(size):
            self.h.poke(ptr + off, stamp(sig, off))
        self.live[ptr] = (size, sig, pool, self.tagged[pool] if pool else tag)

    def free(self, ptr):
        self.h.free(ptr)
        del self.live[ptr]

    # -- steps
    def sleeping(self, pool):
        return self.asleep and self.tagged.get(pool) == "g"

    def open_pool(self):
        pool = self.rng.choice(POOLS)
        if self.sleeping(pool) or (self.asleep and pool not in self.tagged):
            return  # a capture into a pool of a released tag is refused (test_core_sleep)
        if pool not in self.tagged:
            tag = self.rng.choice([None, "g"])
            self.tagged[pool] = tag
        tag = self.tagged[pool]
        if tag:
            self.h.push(tag=tag)
        try:
            self.h.begin_pool(pool, S2)
        finally:
            if tag:
                self.h.pop()
        self.uses[pool] += 1
        self.capturing = pool
        if self.rng.random() < 0.2:
            self.h.pool_options(pool, no_split=True)

    def close_pool(self):
        self.h.end_pool(self.capturing)
        self.capturing = None

    def release_pool(self):
        held = [p for p in POOLS if self.uses[p] > 0 and p != self.capturing]
        if not held:
            return
        pool = self.rng.choice(held)
        self.h.release_pool(pool)
        self.uses[pool] -= 1
        if self.uses[pool] == 0 and not self.pool_live(pool):
            self.forget(pool)

    def forget(self, pool):
        """A pool without uses or live blocks is gone, and its checkpoints with it (the core may
        keep it until its memory goes, and revive it: it keeps the tag it was created under)."""
        for _, cp, _ in [c for c in self.checkpoints if c[0] == pool]:
            self.h.lib.tb_pool_checkpoint_drop(cp)
        self.checkpoints = [c for c in self.checkpoints if c[0] != pool]

    def sleep_or_wake(self):
        """Releases tag "g" (its pools' blocks and its allocations in the default pool), or
        restores it: at the same addresses, with what the backup keeps (a copy, zeros, nothing),
        and nothing of the blocks named discardable."""
        if self.asleep:
            self.h.restore("g")
            self.asleep = False
            return
        self.h.tag("g")
        backup = self.rng.choice(["cpu", "cpu", "memset", "none"])
        mine = [p for p, v in self.live.items() if v[3] == "g"]
        # Only the tag's own allocations can be dropped without a copy, not a graph pool's blocks.
        own = [p for p in mine if self.live[p][2] is None]
        discard = self.rng.sample(own, self.rng.randrange(len(own) + 1)) if backup == "cpu" else []
        self.h.release("g", backup=backup, discard=discard or None)
        self.asleep = True
        after = {"cpu": lambda sig: sig, "memset": lambda sig: ZERO, "none": lambda sig: None}[backup]
        for p in mine:
            size, sig, pool, tag = self.live[p]
            self.live[p] = (size, None if p in discard else after(sig), pool, tag)

    def checkpoint(self):
        pools = [p for p in POOLS if (self.uses[p] or self.pool_live(p)) and p != self.capturing
                 and not self.sleeping(p)]
        if not pools:
            return
        pool = self.rng.choice(pools)
        self.checkpoints.append((pool, self.h.checkpoint(pool), self.pool_live(pool)))
        if len(self.checkpoints) > 6:
            self.h.lib.tb_pool_checkpoint_drop(self.checkpoints.pop(0)[1])

    def restore(self):
        usable = [c for c in self.checkpoints
                  if c[0] != self.capturing and self.uses[c[0]] > 0 and not self.sleeping(c[0])]
        if not usable:
            return
        pool, cp, then = self.rng.choice(usable)
        now = self.pool_live(pool)
        errors = []
        freed, created = self.h.restore_checkpoint(cp, errors=errors)
        assert set(freed) <= set(now), "a restore freed a block that was not the pool's"
        for p in freed:
            del self.live[p]
            self.pending.discard(p)
        if errors:
            assert not created, "a failed restore re-created blocks"
            return
        assert set(freed) == set(now), "a restore left blocks of the pool live"
        assert set(created) == set(then), "a restore did not bring back the checkpoint's blocks"
        for p in created:
            self.live[p] = (then[p], None, pool, self.tagged[pool])  # same address and size, contents undefined

    def step(self):
        rng, h = self.rng, self.h
        x = rng.random()
        if x < 0.40 and len(self.live) < 48:
            size = rng.choice(SIZES)(rng)
            if self.capturing and rng.random() < 0.7:
                self.allocate(size, S2, self.capturing)
            else:  # the default pool, some under the tag (its arena of the default route)
                self.allocate(size, S1, None, "g" if not self.asleep and rng.random() < 0.3 else None)
        elif x < 0.70 and self.live:
            ptr = rng.choice(list(self.live))
            pool = self.live[ptr][2]
            if rng.random() < 0.2:
                h.submit(S3)
                h.record_stream(ptr, S3)
                self.pending.add(ptr)
            self.free(ptr)
            if pool and self.uses[pool] == 0 and not self.pool_live(pool):
                self.forget(pool)
        elif x < 0.76:
            if self.capturing:
                self.close_pool()
            else:
                self.open_pool()
        elif x < 0.80:
            self.release_pool()
        elif x < 0.85:
            self.checkpoint()
        elif x < 0.90:
            self.restore()
        elif x < 0.93:
            h.complete(S3)
            self.pending.clear()
        elif x < 0.95:
            if not self.capturing:
                self.sleep_or_wake()
        elif self.capturing:
            with pytest.raises(StateError, match="during CUDA graph capture"):
                h.empty_cache()  # torch refuses it too
        else:
            h.empty_cache()

    def check(self, where):
        h = self.h
        spans = sorted((p, v[0]) for p, v in self.live.items())
        for (a, n), (b, _) in zip(spans, spans[1:]):
            assert a + n <= b, f"{where}: live blocks {a:#x}+{n} and {b:#x} overlap"
        for ptr, (size, sig, _, tag) in self.live.items():
            if sig is not None and not (self.asleep and tag == "g"):
                for off in probes(size):
                    want = bytes(8) if sig is ZERO else stamp(sig, off)
                    assert h.peek(ptr + off, 8) == want, f"{where}: live block {ptr:#x}+{off:#x} changed"
        for pool in POOLS:
            mine = list(self.pool_live(pool))
            try:
                assert h.live_matches(pool, mine), f"{where}: pool {pool} holds other blocks"
            except InvalidArgumentError:  # destroyed: nothing may be live in it
                assert not mine and self.uses[pool] == 0, f"{where}: pool {pool} is gone under live blocks"
        st = h.stats()
        assert st["allocation"]["all"]["current"] == len(self.live), f"{where}: the ledger counts other blocks"
        small = sum(1 for size, *_ in self.live.values() if size <= 1 * MiB)
        assert st["allocation"]["small_pool"]["current"] == small, f"{where}: small_pool counts the wrong blocks"
        allocated = waiting = 0  # bytes of allocated blocks, and of freed ones waiting on S3's work
        for seg in h.segments():
            for size, _requested, state in seg["blocks"]:
                allocated += size if state == 1 else 0
                waiting += size if state == 2 else 0
        assert st["allocated_bytes"]["all"]["current"] == allocated, f"{where}: allocated bytes are not the blocks'"
        assert st["active_bytes"]["all"]["current"] == allocated + waiting, f"{where}: active bytes are not the blocks'"
        assert h.reserved() == h.device_used(), f"{where}: reserved is not what the driver holds"

    def finish(self):
        h = self.h
        if self.capturing:
            self.close_pool()
        if self.asleep:
            self.sleep_or_wake()
        h.complete(S3)
        self.check("end")
        for ptr in list(self.live):
            self.free(ptr)
        for pool in POOLS:
            for _ in range(self.uses[pool]):
                h.release_pool(pool)
        for _, cp, _ in self.checkpoints:
            h.lib.tb_pool_checkpoint_drop(cp)
        h.empty_cache()
        assert h.reserved() == 0 == h.device_used(), h.stats()["reserved_bytes"]
        assert h.allocated() == 0
        return h.stats()["num_moves"]


def run(seed, ops):
    program = Program(seed)
    for step in range(ops):
        program.step()
        if step % 25 == 0:
            program.check(f"seed {seed} step {step}")
    program.finish()
    return ops


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_random_programs_over_private_pools_keep_every_block_and_the_ledger(seed):
    assert in_child(run, seed, 2000) == 2000
