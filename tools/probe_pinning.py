"""How fast host memory can be pinned and unpinned, and copied into and out of, for each way of
pinning it (Note [Pinning fast] in csrc/core/host_pool.cpp): cuMemHostAlloc; memory mapped here,
with or without transparent huge pages, faulted in by 0, 1 or 16 threads, then cuMemHostRegister;
and VMM host allocations (cuMemCreate on the host). Needs a GPU and torch.

    python tools/probe_pinning.py [GIB]     # default 8
"""
import ctypes, ctypes.util, mmap, os, sys, threading, time
import torch

GiB = 1 << 30
N = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 8 * GiB
cuda = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
for f in ("enabled", "defrag"):
    try: print(f, open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip())
    except OSError as e: print(f, e)
print("hugepages", open("/proc/meminfo").read().split("HugePages_Total:")[1].split("\n")[0].strip())
torch.zeros(1, device="cuda")
dev = torch.empty(N, dtype=torch.uint8, device="cuda"); dev.fill_(7)
def ck(r, what):
    if r != 0: raise RuntimeError(f"{what}: CUresult {r}")
def gbps(t): return N / t / 1e9
def copy_rate(p):
    h = torch.frombuffer((ctypes.c_uint8 * N).from_address(p), dtype=torch.uint8)
    torch.cuda.synchronize(); t = time.perf_counter(); h.copy_(dev, non_blocking=True); torch.cuda.synchronize(); d2h = time.perf_counter() - t
    t = time.perf_counter(); dev.copy_(h, non_blocking=True); torch.cuda.synchronize(); h2d = time.perf_counter() - t
    return f"d2h {gbps(d2h):5.1f} GB/s h2d {gbps(h2d):5.1f} GB/s"
def touch(p, threads):
    step = N // threads
    ts = [threading.Thread(target=libc.memset, args=(p + i * step, 0, step)) for i in range(threads)]
    [t.start() for t in ts]; [t.join() for t in ts]
def row(name, pin, copy, unpin):
    print(f"{name:44s} pin {pin*1e3:8.1f} ms ({gbps(pin):6.1f} GB/s)  {copy}  unpin {unpin*1e3:8.1f} ms ({gbps(unpin):6.1f} GB/s)", flush=True)
# A: cuMemHostAlloc
for rep in range(2):
    p = ctypes.c_void_p(); t = time.perf_counter(); ck(cuda.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(N), 1), "cuMemHostAlloc"); a = time.perf_counter() - t
    c = copy_rate(p.value); t = time.perf_counter(); ck(cuda.cuMemFreeHost(p), "free"); b = time.perf_counter() - t
    row(f"cuMemHostAlloc PORTABLE #{rep}", a, c, b)
# B/C: mmap (+THP) (+touch) + cuMemHostRegister
cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
for thp in (False, True):
    for threads in (0, 1, 16):
        t0 = time.perf_counter()
        p = libc.mmap(None, N + (2 << 20), 3, 0x22, -1, 0)  # RW, PRIVATE|ANON
        base = (p + (2 << 20) - 1) & ~((2 << 20) - 1)
        if thp: libc.madvise(base, N, 14)
        if threads: touch(base, threads)
        t1 = time.perf_counter()
        ck(cuda.cuMemHostRegister_v2(base, N, 1), "register")
        t2 = time.perf_counter()
        c = copy_rate(base)
        t = time.perf_counter(); ck(cuda.cuMemHostUnregister(base), "unreg"); libc.munmap(p, N + (2 << 20)); u = time.perf_counter() - t
        row(f"mmap{'+THP' if thp else ''} touch{threads} +register (touch {1e3*(t1-t0):.0f} ms)", t2 - t0, c, u)
# D: VMM host memory (cuMemCreate, location HOST_NUMA / HOST)
class Loc(ctypes.Structure): _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Flags(ctypes.Structure): _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]
class Prop(ctypes.Structure): _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Loc), ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", Flags)]
class Access(ctypes.Structure): _fields_ = [("location", Loc), ("flags", ctypes.c_int)]
for ltype, lid, name in ((3, 0, "HOST_NUMA 0"), (2, 0, "HOST")):
    for chunk in (N, 512 << 20):
        try:
            prop = Prop(); prop.type = 1; prop.location = Loc(ltype, lid)
            gran = ctypes.c_size_t(); ck(cuda.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "gran")
            t = time.perf_counter()
            va = ctypes.c_ulonglong(); ck(cuda.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(N), ctypes.c_size_t(0), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "reserve")
            hs = []
            for off in range(0, N, chunk):
                h = ctypes.c_ulonglong(); ck(cuda.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(chunk), ctypes.byref(prop), ctypes.c_ulonglong(0)), "create")
                ck(cuda.cuMemMap(ctypes.c_ulonglong(va.value + off), ctypes.c_size_t(chunk), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "map"); hs.append(h)
            acc = (Access * 1)(Access(Loc(1, 0), 3))
            ck(cuda.cuMemSetAccess(va, ctypes.c_size_t(N), acc, ctypes.c_size_t(1)), "access")
            a = time.perf_counter() - t
            # copy via driver memcpy (addresses are UVA)
            torch.cuda.synchronize(); t = time.perf_counter(); ck(cuda.cuMemcpy(ctypes.c_ulonglong(va.value), ctypes.c_ulonglong(dev.data_ptr()), ctypes.c_size_t(N)), "cp"); d2h = time.perf_counter() - t
            t = time.perf_counter(); ck(cuda.cuMemcpy(ctypes.c_ulonglong(dev.data_ptr()), ctypes.c_ulonglong(va.value), ctypes.c_size_t(N)), "cp2"); h2d = time.perf_counter() - t
            t = time.perf_counter(); ck(cuda.cuMemUnmap(va, ctypes.c_size_t(N)), "unmap")
            for h in hs: ck(cuda.cuMemRelease(h), "rel")
            ck(cuda.cuMemAddressFree(va, ctypes.c_size_t(N)), "afree"); u = time.perf_counter() - t
            row(f"cuMemCreate {name} chunk {chunk>>20} MiB (gran {gran.value>>10} KiB)", a, f"d2h {gbps(d2h):5.1f} GB/s h2d {gbps(h2d):5.1f} GB/s", u)
        except Exception as e:
            print(f"cuMemCreate {name} chunk {chunk>>20}: {e}", flush=True)
