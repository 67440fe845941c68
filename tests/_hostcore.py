"""The allocator core over the host-memory stand-in for the driver (no GPU).

The stand-in and the core are process-wide singletons, so every test runs in a
forked child (`isolated`), which starts from a clean state.
"""
import ctypes
import functools
import json
import os
import traceback

import pytest

from torch_budget import _native

try:
    import torch

    OOM = (MemoryError, torch.cuda.OutOfMemoryError)
except ImportError:
    OOM = (MemoryError,)

MiB = 1 << 20
GiB = 1 << 30
S1, S2, S3 = 0x1000, 0x2000, 0x3000  # stand-in stream handles


def isolated(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
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


class Host:
    def __init__(self, capacity=4 * GiB, vmm=True, pools=True, budget=-1, route="sync", reuse_before_grow=True):
        self.lib = lib = _native.load("_host_core")
        assert lib.tb_host_use(capacity, int(vmm), int(pools)) == 0
        _native.check(lib, lib.tb_configure(budget, -1.0, _native.ROUTES[route], int(reuse_before_grow)))

    def malloc(self, size, stream=S1):
        p = self.lib.tb_malloc(size, 0, stream)
        if not p:
            raise _native.error(self.lib)
        return p

    def free(self, ptr):
        _native.check(self.lib, self.lib.tb_free_checked(ptr))

    def record_stream(self, ptr, stream):
        _native.check(self.lib, self.lib.tb_record_stream(ptr, stream))

    def submit(self, stream):
        self.lib.tb_host_submit(stream)

    def complete(self, stream):
        self.lib.tb_host_complete(stream)

    def stats(self):
        text = self.lib.tb_stats_json(0)
        if text is None:
            raise _native.error(self.lib)
        return json.loads(text)

    def allocated(self):
        return self.stats()["allocated_bytes"]["all"]["current"]

    def reserved(self):
        return self.stats()["reserved_bytes"]["all"]["current"]

    def segments(self):
        return json.loads(self.lib.tb_segments_json(0))

    def device_used(self):
        return self.lib.tb_host_used()

    def counters(self):
        out = (ctypes.c_int64 * 6)()
        self.lib.tb_host_counters(out)
        return dict(zip(["maps", "unmaps", "syncs", "handles", "mappings", "reservations"], out))

    def empty_cache(self):
        _native.check(self.lib, self.lib.tb_empty_cache(0))

    def set_budget(self, n):
        _native.check(self.lib, self.lib.tb_set_budget(0, n))

    def tag(self, name):
        t = self.lib.tb_tag_id(name.encode())
        if t < 0:
            raise _native.error(self.lib, -t)
        return t

    def push(self, route=None, tag=None):
        r = -1 if route is None else _native.ROUTES[route]
        _native.check(self.lib, self.lib.tb_push_scope(r, -1 if tag is None else self.tag(tag)))

    def pop(self):
        _native.check(self.lib, self.lib.tb_pop_scope())
