"""Random programs over the VMM route and the host stand-in: packing moves (Note [Moving handles],
Note [Packing time]), tag release / restore, sharing, budgets and injected driver failures, with
the ledger and every live byte checked as they run (the GPU fuzzer, tools/fuzz_gpu.py, does this
on a device; this one reaches the error paths the driver seldom takes)."""
import ctypes
import os
import random
import shutil
import struct
import tempfile

import pytest

from _hostcore import OOM, GiB, Host, MiB, S1, S2, in_child
from torch_budget.errors import StateError

pytestmark = pytest.mark.built("_host_core")

GRANULE = 2 * MiB
FAULTS = ["cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease", "cuMemCreate"]


def probes(size):
    """Offsets of an 8-byte stamp in every granule a block of `size` bytes touches."""
    offsets = list(range(0, max(size - 8, 0) + 1, GRANULE))
    if size >= 16 and size - 8 > offsets[-1]:
        offsets.append(size - 8)
    return offsets


def stamp(sig, offset):
    return struct.pack("<Q", (sig ^ offset) & (2**64 - 1))


class Program:
    def __init__(self, seed, budget=-1, fault_rate=0.0, tags=False, share=False, dirty=False, packing_time=1.0,
                 library="_host_core"):
        self.rng = random.Random(seed)
        self.budget, self.tags, self.share, self.dirty = budget, tags, share, dirty
        self.h = Host(capacity=4 * GiB, route="vmm", budget=budget, packing_time=packing_time, library=library)
        self.h.free(self.h.malloc(1 * MiB, S1))  # the device exists before any fault
        if tags:
            self.h.tag("t")
            self.disk = tempfile.mkdtemp(prefix="tb-fuzz-")  # Note [Disk backups]
            self.h.set_disk_dir(self.disk)
        for i, entry in enumerate(FAULTS if fault_rate else []):
            self.h.fail(entry, rate=fault_rate, seed=seed * 7 + i + 1)
        self.live = {}  # ptr -> (size, signature)
        self.shared = {}  # live ptr -> the descriptors its share handle names
        self.untagged = set()  # live pointers allocated outside the tag
        self.released = False
        self.partial = False  # the last release failed and stayed half done

    def check(self, step):
        h = self.h
        where = f"step {step}"
        assert h.reserved() == h.device_used(), f"{where}: the ledger's reserved bytes are not what the driver holds"
        st = h.stats()
        reserved = st["reserved_bytes"]
        if self.tags:
            assert st["tags"]["t"]["allocations"]["current"] == len(self.live) - len(self.untagged), \
                f"{where}: the tag's live allocations are not its live blocks"
        assert reserved["small_pool"]["current"] + reserved["large_pool"]["current"] == reserved["all"]["current"], where
        # torch's small_pool counts requests of its small size class, wherever they lie (Note
        # [Half-granule requests]: 1 MiB ones live in the large arena).
        small = sum(1 for size, _ in self.live.values() if size <= 1 * MiB)
        assert st["allocation"]["small_pool"]["current"] == small, f"{where}: small_pool counts the wrong blocks"
        assert self.budget < 0 or h.reserved() <= self.budget, f"{where}: reserved past the budget"
        mapped = sum(s["mapped_size"] for s in h.segments())
        assert mapped == h.counters()["mappings"] * GRANULE, f"{where}: segments and driver disagree on mappings"
        for ptr, fds in self.shared.items():
            for fd in fds:
                try:
                    os.fstat(fd)
                except OSError:
                    raise AssertionError(f"{where}: descriptor {fd} of shared block {ptr:#x} was closed") from None
        if not self.released:
            for ptr, (size, sig) in self.live.items():
                for off in probes(size):
                    assert h.peek(ptr + off, 8) == stamp(sig, off), f"{where}: live block {ptr:#x}+{off:#x} changed"

    def allocate(self):
        rng, h = self.rng, self.h
        size = rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 40 * MiB),
                           rng.randrange(1 * MiB, 200 * MiB), GRANULE * rng.randrange(1, 20),
                           1 * MiB - rng.randrange(512)])  # requests that round to exactly 1 MiB
        stream = S1 if rng.random() < 0.6 else S2
        tagged = self.tags and not self.released and rng.random() < 0.3
        if tagged:
            h.push("vmm", "t")
        try:
            ptr = h.malloc(size, stream)
        except (MemoryError, ValueError, RuntimeError):  # injected failures and the budget's refusals
            return
        finally:
            if tagged:
                h.pop()
        sig = rng.getrandbits(64)
        for off in probes(size):
            assert h.poke(ptr + off, stamp(sig, off)), f"a fresh block {ptr:#x} is not writable"
        self.live[ptr] = (size, sig)
        if not tagged:
            self.untagged.add(ptr)
        if self.share and rng.random() < 0.05:
            try:
                handle, _ = h.share(ptr)
            except (ValueError, RuntimeError):
                return
            count = struct.unpack_from("=Q", handle, 2 + 16)[0]  # torch's ShareHeader, then one int each
            self.shared[ptr] = struct.unpack_from(f"={count}i", handle, 2 + 24)

    def read_backups(self):
        """Note [Reading backups]: a few of the tag's blocks read back their stamps from the backup,
        copied and in place, while the tag is released and right after a restore that retained
        it (every tagged block is then one the release took; after a release that stayed half
        done, only the pieces it dropped are in the backup, and reading the others is refused)."""
        tagged = [p for p in self.live if p not in self.untagged]
        for ptr in self.rng.sample(tagged, min(3, len(tagged))):
            size, sig = self.live[ptr]
            off = self.rng.choice(probes(size))
            if self.backup == "disk":  # in files, not host memory: nothing to read in place
                assert self.h.backup_read(ptr, 8, offset=off) is None
                continue
            try:
                got = self.h.backup_read(ptr, 8, offset=off)
            except StateError:
                if self.partial:
                    continue
                raise
            assert got == stamp(sig, off), f"backup of {ptr:#x}+{off:#x}"
            host, view = self.h.backup_view(ptr, 8, offset=off)
            assert ctypes.string_at(host, 8) == stamp(sig, off)
            self.h.backup_view_end(view)

    def step(self):
        rng, h = self.rng, self.h
        if self.dirty and rng.random() < 0.05:
            (h.submit if rng.random() < 0.6 else h.complete)(S1 if rng.random() < 0.5 else S2)
        x = rng.random()
        if (x < 0.5 and len(self.live) < 40) or not self.live:
            self.allocate()
        elif x < 0.93:
            ptr = rng.choice(list(self.live))
            del self.live[ptr]
            self.untagged.discard(ptr)
            self.shared.pop(ptr, None)
            h.free(ptr)
        elif x < 0.95:
            h.reset_peaks()
        elif x < 0.97 and self.tags:
            releasing = not self.released
            try:
                if self.released:
                    h.restore("t")
                else:
                    self.backup = "disk" if rng.random() < 0.25 else "cpu"
                    h.release("t", backup=self.backup, retain=self.backup == "cpu" and rng.random() < 0.5)
                failed = False
            except (MemoryError, ValueError, RuntimeError):
                failed = True
            info = h.tag_info("t")
            self.released = info["life"] != 0  # a failed release can stay half done
            if releasing:
                self.partial = failed and self.released
            # A live tag's retained backup holds what its last restore brought back: read it right
            # after that restore, while every tagged block is one the release took.
            if self.released or (not releasing and not failed and info["retained"]):
                self.read_backups()
        else:
            try:
                h.empty_cache()
            except (ValueError, RuntimeError):
                pass

    def finish(self):
        h = self.h
        h.heal()
        if self.released:
            try:
                h.restore("t")
            except OOM:  # what was allocated while it slept fills the budget: free that first
                for ptr in self.untagged:
                    del self.live[ptr]
                    self.shared.pop(ptr, None)
                    h.free(ptr)
                self.untagged.clear()
                h.restore("t")
            self.released = False
        self.check("end")
        for s in (S1, S2):
            h.complete(s)
        for ptr in self.live:
            h.free(ptr)
        h.empty_cache()
        h.empty_cache()
        if self.tags:
            assert not os.listdir(self.disk), "a disk backup's files outlived its restore"
            shutil.rmtree(self.disk)
        counters = h.counters()
        assert counters["handles"] == 0 and counters["mappings"] == 0 and h.reserved() == 0 == h.device_used(), counters
        return h.stats()["num_moves"]


def run(seed, ops, **config):
    program = Program(seed, **config)
    for step in range(ops):
        program.step()
        if step % 50 == 0:
            program.check(step)
    return program.finish()


# The configurations both this test and the long run (tools/fuzz_host.py) cover.
CONFIGS = {
    "moves": {},
    "budget": {"budget": 1 * GiB},
    "faults": {"fault_rate": 0.02, "dirty": True},
    "tags-share-budget-faults": {"tags": True, "share": True, "budget": 1536 * MiB, "fault_rate": 0.01},
}


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_random_programs_keep_the_ledger_and_every_live_byte(config):
    for seed in (11, 12):
        moves = in_child(run, seed, 1500, **config)
        assert isinstance(moves, int)
    if not config:
        assert moves > 0, "the program never moved memory: it tests nothing of Note [Moving handles]"
