"""What the driver's virtual-memory calls cost on this GPU, measured through libcuda directly.

The allocation path is designed around these figures (how many calls a granule move takes,
which of them can be batched, which wait for queued work), so they are measured, not assumed:
  - cuMemCreate / cuMemRelease of one granule;
  - cuMemMap of granule handles side by side, cuMemSetAccess per granule and over a run;
  - cuMemUnmap per granule, and over a run of several granule mappings in one call;
  - mapping a handle that is still mapped elsewhere (a second mapping of the same memory);
  - mapping part of a larger handle at an offset;
  - whether cuMemUnmap / cuMemMap / cuMemSetAccess wait for a kernel queued on another stream;
  - cuEventRecord + cuEventQuery;
  - whether an allocation from a stream-ordered pool made with POSIX-descriptor handles gives a
    VMM handle (cuMemRetainAllocationHandle) that exports to a descriptor, and what range
    cuMemGetAddressRange reports for it (what sharing the pool route in torch's
    expandable-segment format would need).
Prints one line per figure (µs, median of repeats) and a RESULT line.
"""
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench import cuda_torch  # noqa: E402

MiB = 1 << 20


class Driver:
    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name, *args):
        return getattr(self.lib, name)(*args)

    def ok(self, name, *args):
        r = self(name, *args)
        if r != 0:
            raise RuntimeError(f"{name} failed: {r}")


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Access(ctypes.Structure):
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


class PoolProps(ctypes.Structure):  # CUmemPoolProps (cuda.h): 88 bytes
    _fields_ = [("allocType", ctypes.c_int), ("handleTypes", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32SecurityAttributes", ctypes.c_void_p), ("maxSize", ctypes.c_size_t),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 54)]


def main():
    torch = cuda_torch("probe_vmm", "the driver's VMM call costs")
    if torch is None:
        return 0
    torch.zeros(1, device="cuda")
    d = Driver()
    u64 = ctypes.c_uint64
    prop = Prop(type=1, requestedHandleTypes=0, loc_type=1, loc_id=0)
    gran = ctypes.c_size_t()
    d.ok("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
    G = gran.value
    acc = Access(loc_type=1, loc_id=0, flags=3)
    out = {}

    def timed(fn, n=1):
        t0 = time.perf_counter()
        r = fn()
        return (time.perf_counter() - t0) / n * 1e6, r

    def reserve(nbytes):
        va = u64()
        d.ok("cuMemAddressReserve", ctypes.byref(va), ctypes.c_size_t(nbytes), ctypes.c_size_t(G), u64(0), u64(0))
        return va.value

    def create(nbytes=G):
        h = u64()
        d.ok("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(nbytes), ctypes.byref(prop), u64(0))
        return h.value

    def cmap(va, nbytes, h, off=0):
        return d("cuMemMap", u64(va), ctypes.c_size_t(nbytes), ctypes.c_size_t(off), u64(h), u64(0))

    def access(va, nbytes):
        return d("cuMemSetAccess", u64(va), ctypes.c_size_t(nbytes), ctypes.byref(acc), ctypes.c_size_t(1))

    def unmap(va, nbytes):
        return d("cuMemUnmap", u64(va), ctypes.c_size_t(nbytes))

    N = 128
    rows = {k: [] for k in ("create", "map", "access_each", "access_run", "unmap_each", "unmap_run", "release",
                            "remap_move", "alias_map", "event_rec_query")}
    run_unmap_ok = alias_ok = offset_ok = None
    for rep in range(5):
        base = reserve(2 * N * G)
        t, hs = timed(lambda: [create() for _ in range(N)], N)
        rows["create"].append(t)
        t, rs = timed(lambda: [cmap(base + i * G, G, hs[i]) for i in range(N)], N)
        assert not any(rs), rs
        rows["map"].append(t)
        half = N // 2
        t, rs = timed(lambda: [access(base + i * G, G) for i in range(half)], half)
        rows["access_each"].append(t)
        t, r = timed(lambda: access(base + half * G, half * G), half)
        rows["access_run"].append(t)
        # a move: unmap one granule, map its handle elsewhere, grant access there
        other = base + N * G

        def move():
            for i in range(16):
                assert unmap(base + i * G, G) == 0
                assert cmap(other + i * G, G, hs[i]) == 0
                assert access(other + i * G, G) == 0
        t, _ = timed(move, 16)
        rows["remap_move"].append(t)
        # a second mapping of memory still mapped (granules 16..31 mapped at base)

        def alias():
            res = []
            for i in range(16, 32):
                res.append(cmap(other + i * G, G, hs[i]))
                if res[-1] == 0:
                    access(other + i * G, G)
            return res
        t, res = timed(alias, 16)
        alias_ok = all(x == 0 for x in res)
        rows["alias_map"].append(t)
        for i in range(16, 32):
            if res[i - 16] == 0:
                unmap(other + i * G, G)
        for i in range(16):
            unmap(other + i * G, G)
        t, rs = timed(lambda: [unmap(base + i * G, G) for i in range(32, 64)], 32)
        rows["unmap_each"].append(t)
        t, r = timed(lambda: unmap(base + 64 * G, (N - 64) * G), N - 64)
        run_unmap_ok = r == 0
        if r != 0:
            for i in range(64, N):
                unmap(base + i * G, G)
        rows["unmap_run"].append(t)
        for i in range(16, 32):
            unmap(base + i * G, G)
        t, _ = timed(lambda: [d("cuMemRelease", u64(h)) for h in hs], N)
        rows["release"].append(t)
        d.ok("cuMemAddressFree", u64(base), ctypes.c_size_t(2 * N * G))
        # one event record + query
        ev = ctypes.c_void_p()
        d.ok("cuEventCreate", ctypes.byref(ev), 2)
        stream = torch.cuda.current_stream().cuda_stream

        def rq():
            for _ in range(100):
                d("cuEventRecord", ev, ctypes.c_void_p(stream))
                d("cuEventQuery", ev)
        t, _ = timed(rq, 100)
        rows["event_rec_query"].append(t)
        d("cuEventDestroy_v2", ev)

    # a mapping of part of a larger handle
    big = create(16 * G)
    base = reserve(16 * G)
    offset_ok = cmap(base, 4 * G, big, 4 * G) == 0
    if offset_ok:
        unmap(base, 4 * G)
    d("cuMemRelease", u64(big))
    d.ok("cuMemAddressFree", u64(base), ctypes.c_size_t(16 * G))

    # whether the calls wait for a kernel queued on another stream
    side = torch.cuda.Stream()
    base = reserve(8 * G)
    hs = [create() for _ in range(8)]
    for i in range(8):
        assert cmap(base + i * G, G, hs[i]) == 0
    access(base, 8 * G)
    waits = {}
    for name, fn in (("unmap", lambda: unmap(base, G)), ("map", lambda: cmap(base, G, hs[0])),
                     ("access", lambda: access(base, G)), ("release_after_unmap", None)):
        if fn is None:
            continue
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning
        t, r = timed(fn)
        waits[name] = (t, r)
        torch.cuda.synchronize()
    for i in range(8):
        unmap(base + i * G, G)
        d("cuMemRelease", u64(hs[i]))
    d("cuMemAddressFree", u64(base), ctypes.c_size_t(8 * G))

    pool_facts = probe_pool_handles(d, u64)

    for k, v in rows.items():
        out[k] = statistics.median(v)
        print(f"{k:18} {out[k]:8.2f} us per granule (or per call)")
    print(f"granularity {G >> 20} MiB; unmap of a run of mappings in one call: {run_unmap_ok}; "
          f"second mapping of mapped memory: {alias_ok}; mapping at a handle offset: {offset_ok}")
    for k, (t, r) in waits.items():
        print(f"with a 0.1 s kernel on another stream: {k} took {t:.0f} us (result {r})")
    print("stream-ordered pool with POSIX-descriptor handles: " + ", ".join(f"{k} {v}" for k, v in pool_facts.items()))
    print("RESULT probe_vmm " + " ".join(f"{k}={v:.1f}" for k, v in out.items()) +
          f" run_unmap={int(bool(run_unmap_ok))} alias={int(bool(alias_ok))} "
          + " ".join(f"wait_{k}={t:.0f}" for k, (t, _) in waits.items()))
    return 0


def probe_pool_handles(d, u64):
    props = PoolProps(allocType=1, handleTypes=1, loc_type=1, loc_id=0)  # pinned, POSIX descriptor, device 0
    pool = ctypes.c_void_p()
    facts = {"create": d("cuMemPoolCreate", ctypes.byref(pool), ctypes.byref(props))}
    if facts["create"] != 0:
        return facts
    ptr = u64()
    facts["alloc"] = d("cuMemAllocFromPoolAsync", ctypes.byref(ptr), ctypes.c_size_t(64 * MiB), pool, None)
    d("cuStreamSynchronize", None)
    if facts["alloc"] == 0:
        for name, at in (("start", ptr.value), ("inside", ptr.value + 5 * MiB + 4096)):
            h = u64()
            r = d("cuMemRetainAllocationHandle", ctypes.byref(h), u64(at))
            facts[f"retain_{name}"] = r
            base, size = u64(), ctypes.c_size_t()
            facts[f"range_{name}"] = (d("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), u64(at)),
                                      hex(base.value - ptr.value) if base.value else None, size.value >> 20)
            if r == 0:
                fd = ctypes.c_int(-1)
                facts[f"export_{name}"] = d("cuMemExportToShareableHandle", ctypes.byref(fd), u64(h), 1, u64(0))
                if fd.value >= 0:
                    os.close(fd.value)
                d("cuMemRelease", u64(h))
        d("cuMemFreeAsync", u64(ptr.value), None)
        d("cuStreamSynchronize", None)
    d("cuMemPoolDestroy", pool)
    return facts


if __name__ == "__main__":
    sys.exit(main())
