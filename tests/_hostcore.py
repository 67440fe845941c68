"""The allocator core over the host-memory stand-in for the driver (no GPU).

The stand-in and the core are process-wide singletons, so every test runs in a
forked child (`isolated`), which starts from a clean state.
"""
import ctypes
import faulthandler
import functools
import os
import pickle
import traceback

import pytest

from torch_budget import _native
from torch_budget.config import ROUTES

try:
    import torch

    OOM = (MemoryError, torch.cuda.OutOfMemoryError)
except ImportError:
    OOM = (MemoryError,)

MiB = 1 << 20
GiB = 1 << 30
S1, S2, S3 = 0x1000, 0x2000, 0x3000  # stand-in stream handles of device 0


def _host_signatures():
    """The stand-in's own controls (csrc/testing/host_driver.cpp), beside the core's exports
    that torch_budget._native declares."""
    i, i64, vp, d, cp, u64 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_char_p, ctypes.c_uint64
    return {
        "tb_host_use": (i, [i, i64, i, i, i64]),
        "tb_host_stream": (vp, [i]),
        "tb_host_submit": (None, [vp]),
        "tb_host_complete": (None, [vp]),
        "tb_host_used": (i64, [i]),
        "tb_host_pool_chunk": (None, [i64]),
        "tb_host_counters": (None, [ctypes.c_int64 * 8]),
        "tb_host_event_calls": (None, [ctypes.c_int64 * 2]),
        "tb_host_captured_ordered_calls": (i64, []),
        "tb_host_fail": (i, [cp, i64, d, i, u64]),
        "tb_host_set_current": (i, [i]),
        "tb_host_current": (i, []),
        "tb_host_can_access": (i, [i, vp]),
        "tb_host_hold_syncs": (i, [i, i]),
        "tb_host_pass_syncs": (None, [i]),
        "tb_host_open_share": (i, [i, cp, i64]),
        "tb_host_open_kept": (i64, [i, cp, i64, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]),
        "tb_host_close_opened": (None, [i, i64]),
        "tb_host_malloc_quiet": (vp, [i64, i, vp]),
        "tb_host_import_counts": (None, [ctypes.c_int64 * 4]),
        "tb_host_remove_entry": (i, [cp]),
        "tb_host_free_at_exit": (None, [vp]),
        "tb_host_trace": (None, [i, ctypes.c_int64 * 9]),
        "tb_host_poke": (i, [vp, vp, i64]),
        "tb_host_peek": (i, [vp, vp, i64]),
        "tb_host_pinned": (i64, []),
        "tb_host_capture": (None, [vp, u64, ctypes.POINTER(u64), i]),
        "tb_host_node": (None, [u64, ctypes.POINTER(u64), i]),
        "tb_host_user_pool": (i, [i, u64, u64]),
        "tb_host_user_counts": (None, [ctypes.c_int64 * 5]),
        "tb_host_parking": (None, [i]),
        "tb_host_mark_interval": (None, [i64]),
        "tb_host_replay": (i64, [vp, vp, vp, i64, vp, i, vp, i64]),
    }


def load(library="_host_core"):
    """The core over the stand-in, every signature declared (the core's and the stand-in's)."""
    return _native.declare(_native.load(library), _host_signatures())


def isolated(fn, timeout=300):
    """Runs the test in a forked child; a child stuck for `timeout` s dumps its stacks and dies."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            faulthandler.dump_traceback_later(timeout, exit=True)
            try:
                fn(*args, **kwargs)
                msg = b""
            except BaseException:  # report everything, including assertion errors, to the parent
                msg = traceback.format_exc().encode()
            with os.fdopen(w, "wb") as f:
                f.write(msg)
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            msg = f.read()
        _, status = os.waitpid(pid, 0)
        if msg:
            pytest.fail(msg.decode(), pytrace=False)
        if status != 0:
            pytest.fail(f"child process died with status {status}", pytrace=False)

    return wrapper


COUNTERS = ["maps", "unmaps", "syncs", "handles", "mappings", "reservations", "injected", "allocs"]


class Host:
    def __init__(self, capacity=4 * GiB, vmm=True, pools=True, budget=-1, route="sync", reuse_before_grow=True,
                 devices=1, pool_chunk=0, library="_host_core", configure=True, missing=(), map_run=0,
                 packing_time=None):
        self.lib = lib = load(library)
        assert lib.tb_host_use(devices, capacity, int(vmm), int(pools), pool_chunk) == 0
        for name in missing:
            assert lib.tb_host_remove_entry(name.encode()) == 0, name
        if configure:
            self.configure(budget, route, reuse_before_grow, map_run)
            if packing_time is not None:
                _native.check(lib, lib.tb_configure_packing_time(packing_time))

    def configure(self, budget=-1, route="sync", reuse_before_grow=True, map_run=0):
        _native.check(self.lib, self.lib.tb_configure(budget, -1.0, ROUTES[route], int(reuse_before_grow), map_run))

    def malloc(self, size, stream=S1, device=0):
        p = self.lib.tb_malloc(size, device, stream)
        if not p:
            raise _native.error(self.lib)
        return p

    def malloc_quiet(self, size, stream=S1, device=0):
        """malloc as the bridge asks first (Note [A quiet first attempt]): an error, with nothing
        counted, traced or reclaimed, where a full malloc would reclaim or fail."""
        p = self.lib.tb_host_malloc_quiet(size, device, stream)
        if not p:
            raise _native.error(self.lib)
        return p

    def free(self, ptr):
        _native.check(self.lib, self.lib.tb_free_checked(ptr))

    def replayer(self, trace, streams):
        """A function that replays `trace` (torch_budget.replay.trace) once more over the core,
        in C, on the given stream handles (one per trace stream), and returns the seconds it
        took; tensors live at the end of a pass stay live into the next (free_all() frees them)."""
        n = len(trace)
        ids, sizes, stream_of = (a.buffer_info()[0] for a in (trace.ids, trace.sizes, trace.streams))
        handles = (ctypes.c_void_p * max(len(streams), 1))(*streams)
        slots = (ctypes.c_void_p * max(trace.num_tensors, 1))()
        keep = (trace, handles, slots)  # the buffers outlive every call

        def replay():
            ns = self.lib.tb_host_replay(ids, sizes, stream_of, n, handles, len(streams), slots, len(slots))
            if ns < 0:
                raise _native.error(self.lib) if self.lib.tb_last_error_code() else ValueError(
                    f"{trace.name}: an operation names a tensor or stream out of range, or allocates a live one")
            return ns / 1e9

        def free_all():
            for k, ptr in enumerate(slots):
                if ptr:
                    self.free(ptr)
                    slots[k] = None

        replay.keep, replay.free_all = keep, free_all
        return replay

    def record_stream(self, ptr, stream, device=0):
        _native.check(self.lib, self.lib.tb_record_stream(ptr, stream, device))

    def stream(self, device=0):
        return self.lib.tb_host_stream(device)

    def submit(self, stream):
        self.lib.tb_host_submit(stream)

    def complete(self, stream):
        self.lib.tb_host_complete(stream)

    def stats(self, device=0):
        return _native.read_json(self.lib, self.lib.tb_stats_json, device)

    def allocated(self, device=0):
        return self.stats(device)["allocated_bytes"]["all"]["current"]

    def reserved(self, device=0):
        return self.stats(device)["reserved_bytes"]["all"]["current"]

    def segments(self, device=0):
        return _native.read_json(self.lib, self.lib.tb_segments_json, device)

    def device_used(self, device=0):
        return self.lib.tb_host_used(device)

    def counters(self):
        out = (ctypes.c_int64 * 8)()
        self.lib.tb_host_counters(out)
        return dict(zip(COUNTERS, out))

    def event_calls(self):
        """cuEventRecord and cuEventQuery calls so far."""
        out = (ctypes.c_int64 * 2)()
        self.lib.tb_host_event_calls(out)
        return {"records": out[0], "queries": out[1]}

    def captured_ordered_calls(self):
        """Stream-ordered allocations and frees so far on a capturing stream (graph nodes on a GPU)."""
        return self.lib.tb_host_captured_ordered_calls()

    def empty_cache(self, device=0):
        _native.check(self.lib, self.lib.tb_empty_cache(device))

    def reset_peaks(self, device=0):
        _native.check(self.lib, self.lib.tb_reset_peak_stats(device))

    def share(self, ptr):
        buf = ctypes.create_string_buffer(4096)
        off = ctypes.c_int64()
        n = self.lib.tb_share(ptr, buf, len(buf), ctypes.byref(off))
        if n < 0:
            raise _native.error(self.lib)
        return buf.raw[:n], off.value

    def cache_info(self, device=0):
        out = ctypes.c_int64()
        _native.check(self.lib, self.lib.tb_cache_info(device, ctypes.byref(out)))
        return out.value

    def inactive_split(self, device=0):
        """torch's inactive_split and inactive_split_bytes: ([all, small, large], [all, small, large])."""
        count, nbytes = (ctypes.c_int64 * 3)(), (ctypes.c_int64 * 3)()
        _native.check(self.lib, self.lib.tb_inactive_split(device, count, nbytes))
        return list(count), list(nbytes)

    def set_budget(self, n, device=0):
        _native.check(self.lib, self.lib.tb_set_budget(device, n, -1.0))

    def grant_peer(self, device, peer):
        _native.check(self.lib, self.lib.tb_grant_peer(device, peer))

    def set_current(self, device):
        assert self.lib.tb_host_set_current(device) == 0

    def current(self):
        return self.lib.tb_host_current()

    def can_access(self, device, ptr):
        return bool(self.lib.tb_host_can_access(device, ptr))

    def fail(self, entry_point, nth=0, rate=0.0, result=0, seed=0):
        """Makes the stand-in fail `entry_point` ("*" for all) on its nth call or at a rate."""
        assert self.lib.tb_host_fail(entry_point.encode(), nth, rate, result, seed) == 0, entry_point

    def hold_syncs(self, hold, wait_for=0):
        return self.lib.tb_host_hold_syncs(int(hold), wait_for)

    def pass_syncs(self, n):
        """While synchronisations are held, the next `n` go through anyway."""
        self.lib.tb_host_pass_syncs(n)

    def open_share(self, handle, device=0):
        """Opens share handle bytes on `device` and closes them again: 0 or the error code."""
        return self.lib.tb_host_open_share(device, handle, len(handle))

    def open_kept(self, handle, device=0):
        """Opens share handle bytes on `device` and keeps them open, as a consumer does: (id, ptr,
        bytes) of the mapping, for close_opened."""
        ptr, size = ctypes.c_uint64(), ctypes.c_uint64()
        opened = self.lib.tb_host_open_kept(device, handle, len(handle), ctypes.byref(ptr), ctypes.byref(size))
        if opened < 0:
            raise _native.error(self.lib, -opened)
        return opened, ptr.value, size.value

    def close_opened(self, opened, device=0):
        self.lib.tb_host_close_opened(device, opened)

    def import_counts(self):
        """{imports, ipc_open, handles, reservations} of the stand-in's driver."""
        out = (ctypes.c_int64 * 4)()
        self.lib.tb_host_import_counts(out)
        return dict(zip(("imports", "ipc_open", "handles", "reservations"), out))

    def heal(self):
        assert self.lib.tb_host_fail(None, 0, 0.0, 0, 0) == 0

    def tag(self, name):
        t = self.lib.tb_tag_id(name.encode())
        if t < 0:
            raise _native.error(self.lib, -t)
        return t

    def set_tag_budget(self, name, nbytes, device=0):
        _native.check(self.lib, self.lib.tb_set_tag_budget(device, self.tag(name), nbytes, -1.0))

    def push(self, route=None, tag=None):
        r = -1 if route is None else ROUTES[route]
        _native.check(self.lib, self.lib.tb_push_scope(r, -1 if tag is None else self.tag(tag)))

    def pop(self):
        _native.check(self.lib, self.lib.tb_pop_scope())

    def begin_pool(self, pool_id, stream, device=0):
        _native.check(self.lib, self.lib.tb_begin_pool(device, pool_id[0], pool_id[1], stream))

    def end_pool(self, pool_id, device=0):
        _native.check(self.lib, self.lib.tb_end_pool(device, pool_id[0], pool_id[1]))

    def release_pool(self, pool_id, device=0):
        _native.check(self.lib, self.lib.tb_release_pool(device, pool_id[0], pool_id[1]))

    # -- the graph a stream captures (Note [Reuse during capture])
    def capture_reuse(self, on):
        self.lib.tb_capture_reuse(int(on))

    def capture(self, stream, sequence, tails=()):
        """`stream` captures `sequence` (0: not capturing) and now ends in graph nodes `tails`."""
        self.lib.tb_host_capture(stream, sequence, (ctypes.c_uint64 * max(len(tails), 1))(*tails), len(tails))

    def node(self, node, parents=()):
        self.lib.tb_host_node(node, (ctypes.c_uint64 * max(len(parents), 1))(*parents), len(parents))

    # -- pool checkpoints (csrc/core/pool_checkpoint.h) and MemPool options
    def checkpoint(self, pool_id, device=0):
        cp = self.lib.tb_pool_checkpoint(device, pool_id[0], pool_id[1])
        if cp < 0:
            raise _native.error(self.lib, -cp)
        return cp

    def restore_checkpoint(self, cp, device=0, capacity=256, errors=None):
        """(freed, created); a failure raises, or with `errors` (a list) is appended to it."""
        freed, created = (ctypes.c_uint64 * capacity)(), (ctypes.c_uint64 * capacity)()
        nf, nc = ctypes.c_int64(), ctypes.c_int64()
        rc = self.lib.tb_pool_restore(device, cp, freed, ctypes.byref(nf), created, ctypes.byref(nc), capacity)
        if rc != 0:
            if errors is None:
                raise _native.error(self.lib, rc)
            errors.append(_native.error(self.lib, rc))
        return list(freed[:nf.value]), list(created[:nc.value])

    def live_matches(self, pool_id, ptrs, device=0):
        arr = (ctypes.c_uint64 * max(len(ptrs), 1))(*ptrs)
        r = self.lib.tb_pool_live_matches(device, pool_id[0], pool_id[1], arr, len(ptrs))
        if r < 0:
            raise _native.error(self.lib, -r)
        return r == 1

    def pool_options(self, pool_id, use_on_oom=-1, no_split=False, device=0):
        _native.check(self.lib, self.lib.tb_pool_options(device, pool_id[0], pool_id[1], use_on_oom, int(no_split)))

    def trace(self, on=True):
        """Starts counting trace events (on) or stops; returns the counts so far by action."""
        out = (ctypes.c_int64 * 9)()
        self.lib.tb_host_trace(1 if on else 0, out)
        names = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
                 "segment_unmap", "snapshot", "oom"]
        return dict(zip(names, out))

    # -- sleep / wake (csrc/core/tag_sleep.h)
    BACKUPS = {"none": 0, "memset": 1, "cpu": 2, "pinned": 3, "disk": 4}

    def set_disk_dir(self, path):
        _native.check(self.lib, self.lib.tb_set_disk_backup_dir(None if path is None else str(path).encode()))

    def release(self, tag, backup="none", device=0, retain=False, discard=None):
        mode = self.BACKUPS[backup] | (0x100 if retain else 0)
        if discard is None:
            _native.check(self.lib, self.lib.tb_release_tag(device, self.tag(tag), mode))
        else:
            ptrs = (ctypes.c_uint64 * max(len(discard), 1))(*discard)
            _native.check(self.lib, self.lib.tb_release_tag_discarding(device, self.tag(tag), mode, ptrs, len(discard)))

    def retain(self, tag, on, device=0):
        _native.check(self.lib, self.lib.tb_retain_tag_backup(device, self.tag(tag), int(on)))

    def drop_backup(self, tag, device=0):
        _native.check(self.lib, self.lib.tb_drop_tag_backup(device, self.tag(tag)))

    def restore(self, tag, device=0):
        _native.check(self.lib, self.lib.tb_restore_tag(device, self.tag(tag)))

    def tag_info(self, tag, device=0):
        out = (ctypes.c_int64 * 8)()
        _native.check(self.lib, self.lib.tb_tag_info(device, self.tag(tag), out))
        keys = ["life", "backup", "resident", "released", "last_device", "last_backup", "backup_bytes", "retained"]
        return dict(zip(keys, out))

    def backup_read(self, ptr, nbytes, offset=0):
        """The backup of bytes [offset, offset + nbytes) of the live block at `ptr` (Note [Reading
        backups]); None when its tag has none with contents."""
        buf = ctypes.create_string_buffer(max(nbytes, 1))
        found = ctypes.c_int(0)
        _native.check(self.lib, self.lib.tb_backup_read(ptr, offset, nbytes, buf, ctypes.byref(found)))
        return buf.raw[:nbytes] if found.value else None

    def backup_view(self, ptr, nbytes, offset=0):
        """(host address, handle) of the backup of those bytes in place, or None; end the handle
        with backup_view_end."""
        host, view = ctypes.c_void_p(), ctypes.c_void_p()
        _native.check(self.lib, self.lib.tb_backup_view(ptr, offset, nbytes, ctypes.byref(host), ctypes.byref(view)))
        return (host.value, view.value) if view.value else None

    def backup_view_end(self, view):
        self.lib.tb_backup_view_end(view)

    def trim(self, tag, device=0):
        out = ctypes.c_int64()
        _native.check(self.lib, self.lib.tb_trim_tag(device, self.tag(tag), ctypes.byref(out)))
        return out.value

    def poke(self, ptr, data: bytes):
        buf = ctypes.create_string_buffer(data, len(data))
        return self.lib.tb_host_poke(ptr, buf, len(data)) == 0

    def peek(self, ptr, n):
        buf = ctypes.create_string_buffer(n)
        return buf.raw if self.lib.tb_host_peek(ptr, buf, n) == 0 else None

    def host_pool(self):
        out = (ctypes.c_int64 * 8)()
        _native.check(self.lib, self.lib.tb_host_pool_stats(out))
        return {"bytes": out[0], "used": out[1], "chunks": out[2], "pinned_at_release": out[3], "registered": out[5],
                "keep": bool(out[6])}


class _AsTorchLibrary:
    """The host core in the place of `_C`: every export of the core, and the torch bridge's
    own, which the stand-in has no torch for (handing the allocator to torch succeeds)."""

    def __init__(self, lib):
        self._lib = lib
        self._served = False

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def tb_torch_install(self):
        self._served = True
        return 0

    def tb_torch_install_deferred(self):
        return self.tb_torch_install()

    def tb_torch_installed(self):
        return int(self._served)


def sees_cuda(yes: bool) -> None:
    """Whether torch (and torch_budget, which counts devices without starting the driver) sees a
    CUDA device from here on, whatever the machine has: module state changes for good, so call
    it only inside an `isolated` test."""
    import torch

    from torch_budget import _runtime

    torch.cuda.is_available = lambda: yes
    _runtime.cuda_devices = lambda: int(yes)


def python_api_over(host):
    """Points torch_budget's Python layer (install, region, stats, release, ...) at `host`
    instead of a GPU: `_runtime`'s library is the host core, the current device is the
    stand-in's, and install() finds torch's allocator replaceable. Module state changes for
    good, so call it only inside an `isolated` test."""
    from torch_budget import _runtime

    lib = _AsTorchLibrary(host.lib)
    if host.current() < 0:  # no context yet: device 0 is current, as in a fresh CUDA process
        host.set_current(0)
    _runtime.library = lambda: lib
    _runtime.current_device = host.current
    _runtime.check_can_install = lambda: None
    return lib


def while_a_sync_waits(h, call, action, passed=0, wait=5.0):
    """Runs `call` in a thread while the stand-in holds synchronisations (the first `passed` go
    through) and, once `call` waits inside one (the allocator's lock released), runs `action` in
    another thread. Returns whether `action` finished while `call` waited, then what each
    returned or raised."""
    import threading

    out = {}

    def run(key, fn):
        try:
            out[key] = fn()
        except Exception as e:  # handed to the test, which checks what was raised
            out[key] = e

    h.hold_syncs(True)
    h.pass_syncs(passed)
    caller = threading.Thread(target=run, args=("call", call))
    caller.start()
    h.hold_syncs(True, wait_for=1)  # `call` is inside a synchronisation
    actor = threading.Thread(target=run, args=("action", action))
    actor.start()
    actor.join(timeout=wait)
    finished = not actor.is_alive()
    h.hold_syncs(False)
    caller.join(timeout=60)
    actor.join(timeout=60)
    assert not caller.is_alive() and not actor.is_alive()
    return finished, out["call"], out["action"]


def line_pressed(h, stream=S1):
    """A device whose reserved memory sits at its packing line, with 512 MiB of clean free
    blocks (eight of 64 MiB, wholly mapped) between live blocks; returns the live blocks. Each
    free block is too small for a 96 MiB request, so another stream cannot simply adopt one
    (Note [Adopting clean blocks]): what it needs moves."""
    keep = [h.malloc(256 * MiB, stream), h.malloc(256 * MiB, stream)]
    holes = []
    for _ in range(8):
        holes.append(h.malloc(64 * MiB, stream))
        keep.append(h.malloc(2 * MiB, stream))
    keep.append(h.malloc(256 * MiB, stream))
    for p in holes:
        h.free(p)
    return keep


def in_child(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a forked child (the host core is one per process); its result. An
    exception in the child is raised here, with the child's traceback in its message; the child
    never returns into the caller's code (a forked pytest worker would run on)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            os.close(r)
            try:
                outcome = ("ok", fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
                outcome = ("raised", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            with os.fdopen(w, "wb") as f:
                pickle.dump(outcome, f)
        except BaseException:  # noqa: BLE001
            status = 1
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} died in its child process without a result")
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise AssertionError(f"in a child process: {value}")
    return value
