"""Loads the compiled libraries and declares every signature of their C ABI in one place.

The libraries export a plain C ABI (csrc/tb_capi.h): calls return 0 or an error
code and never throw; `check()` turns a code into a Python exception carrying the
message the library kept for this thread (the classes of torch_budget.errors).

Declared here: the core's exports, which every library has, and the torch bridge's,
which only `_C` has. The host stand-in's own controls are the tests' business
(tests/_hostcore.py declares them).
"""
from __future__ import annotations

import ctypes
import glob
import os

from .errors import BackupFileError, DriverError, InvalidArgumentError, NotBuiltError, StateError, TorchBudgetError

_HERE = os.path.dirname(os.path.abspath(__file__))

# csrc/core/error.h
OK, INVALID_ARGUMENT, OUT_OF_MEMORY, DRIVER_ERROR, NOT_AVAILABLE, STATE, FILE_ERROR = range(7)

_c_i64_4 = ctypes.c_int64 * 4
_c_i64_8 = ctypes.c_int64 * 8


def declare(lib, sigs):
    """Sets restype and argtypes of each `name: (restype, argtypes)` of `sigs` on `lib`."""
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


def _core_signatures():
    i, i64, vp, d, cp = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_char_p
    u64, ssz = ctypes.c_uint64, ctypes.c_ssize_t
    sigs = {
        "tb_last_error": (cp, []),
        "tb_last_error_code": (i, []),
        "tb_configure": (i, [i64, d, i, i, i64]),
        "tb_device_count": (i, []),
        "tb_capabilities": (i, [i, _c_i64_4]),
        "tb_route_for": (i, [i, i]),
        "tb_malloc": (vp, [ssz, i, vp]),
        "tb_free": (None, [vp, ssz, i, vp]),
        "tb_free_checked": (i, [vp]),
        "tb_record_stream": (i, [vp, vp, i]),
        "tb_push_scope": (i, [i, i]),
        "tb_set_default_tag": (i, [i]),
        "tb_pop_scope": (i, []),
        "tb_tag_id": (i, [cp]),
        "tb_set_budget": (i, [i, i64, d]),
        "tb_set_tag_budget": (i, [i, i, i64, d]),
        "tb_configure_tag_budget": (i, [i, i64, d]),
        "tb_set_later_budget": (i, [i, i64, d, ctypes.POINTER(i64), ctypes.POINTER(d)]),
        "tb_configure_packing_time": (i, [d]),
        "tb_packing_idle": (i, [i]),
        "tb_packing_refill": (i, [i]),
        "tb_empty_cache": (i, [i]),
        "tb_empty_pool_cache": (i, [i, u64, u64]),
        "tb_reset_peak_stats": (i, [i]),
        "tb_cache_info": (i, [i, ctypes.POINTER(i64)]),
        "tb_inactive_split": (i, [i, ctypes.POINTER(i64), ctypes.POINTER(i64)]),
        "tb_share": (i64, [vp, ctypes.c_char_p, i64, ctypes.POINTER(i64)]),
        "tb_end_sharing": (ctypes.c_int, [vp]),
        "tb_inject_driver_faults": (i64, [d, u64]),
        "tb_grant_peer": (i, [i, i]),
        "tb_tag_find": (i, [cp]),
        "tb_device_ready": (i, [i]),
        "tb_release_tag": (i, [i, i, i]),
        "tb_release_tag_discarding": (i, [i, i, i, ctypes.POINTER(u64), i64]),
        "tb_restore_tag": (i, [i, i]),
        "tb_set_disk_backup_dir": (i, [cp]),
        "tb_drop_tag_backup": (i, [i, i]),
        "tb_retain_tag_backup": (i, [i, i, i]),
        "tb_tag_info": (i, [i, i, _c_i64_8]),
        "tb_pool_tag": (i, [i, u64, u64]),
        "tb_ptr_tag": (i, [vp]),
        "tb_ptr_device": (i, [vp]),
        "tb_backup_read": (i, [vp, i64, i64, vp, ctypes.POINTER(i)]),
        "tb_backup_view": (i, [vp, i64, i64, ctypes.POINTER(vp), ctypes.POINTER(vp)]),
        "tb_backup_view_end": (None, [vp]),
        "tb_trim_tag": (i, [i, i, ctypes.POINTER(i64)]),
        "tb_host_pool_reserve": (i, [i64]),
        "tb_host_pool_free": (i, []),
        "tb_host_pool_set_keep": (i, [i, ctypes.POINTER(i)]),
        "tb_host_pool_stats": (i, [_c_i64_8]),
        "tb_begin_pool": (i, [i, u64, u64, vp]),
        "tb_end_pool": (i, [i, u64, u64]),
        "tb_release_pool": (i, [i, u64, u64]),
        "tb_capture_reuse": (None, [i]),
        "tb_pool_checkpoint": (i, [i, u64, u64]),
        "tb_pool_restore": (i, [i, i, ctypes.POINTER(u64), ctypes.POINTER(i64), ctypes.POINTER(u64),
                                ctypes.POINTER(i64), i64]),
        "tb_pool_checkpoint_drop": (i, [i]),
        "tb_pool_live_matches": (i, [i, u64, u64, ctypes.POINTER(u64), i64]),
        "tb_pool_options": (i, [i, u64, u64, i, i]),
        "tb_stats_json": (i64, [i, ctypes.c_char_p, i64]),
        "tb_segments_json": (i64, [i, ctypes.c_char_p, i64]),
    }
    return sigs


# The torch bridge's exports (csrc/bridge), only in _C.
_BRIDGE = {"tb_torch_install": (ctypes.c_int, []), "tb_torch_install_deferred": (ctypes.c_int, []),
           "tb_torch_installed": (ctypes.c_int, [])}


def library_path(name):
    # name + "." only: "_host_core*" would also find "_host_core_asan", which kills a
    # Python not started under AddressSanitizer.
    found = sorted(glob.glob(os.path.join(_HERE, name + ".*so")))
    if not found:
        how = ("`pip install --no-build-isolation -e .` in the repository (it needs a CUDA build of torch)"
               if name == "_C" else
               "`bash tools/test.sh`, or TORCH_BUDGET_BUILD=tests python setup.py build_ext --inplace")
        raise NotBuiltError(f"torch_budget.{name} is not built: {how}")
    return found[0]


_libs = {}


def load(name="_C"):
    """The library `name` ("_C" serves torch; "_host_core" is the core over the CPU tests' stand-in)."""
    lib = _libs.get(name)
    if lib is None:
        if name == "_C":
            import torch  # noqa: F401  (its libraries must be loaded first)
        # RTLD_LOCAL: the library's C++ runtime symbols must not interpose on other
        # libraries' (cuDNN resolved its iostreams into ours under RTLD_GLOBAL).
        lib = declare(ctypes.CDLL(library_path(name), mode=ctypes.RTLD_LOCAL), _core_signatures())
        if name == "_C":
            declare(lib, _BRIDGE)
        _libs[name] = lib
    return lib


def is_built(name="_C"):
    try:
        library_path(name)
    except NotBuiltError:
        return False
    return True


def error(lib, code=None, state=StateError) -> Exception:
    """The exception for the library's last error on this thread; `state` is the class for a
    call refused in the current state (TagStateError where the call acts on tags)."""
    code = lib.tb_last_error_code() if code is None else code
    msg = (lib.tb_last_error() or b"").decode(errors="replace") or f"error code {code}"
    if code == INVALID_ARGUMENT:
        return InvalidArgumentError(msg)
    if code == OUT_OF_MEMORY:
        try:
            import torch

            return torch.cuda.OutOfMemoryError(msg)
        except (ImportError, AttributeError):
            return MemoryError(msg)
    if code in (DRIVER_ERROR, NOT_AVAILABLE):
        return DriverError(msg)
    if code == STATE:
        return state(msg)
    if code == FILE_ERROR:
        return BackupFileError(msg)
    return TorchBudgetError(msg)


def read_json(lib, fn, device):
    """Calls a tb_*_json export, growing the buffer until the text fits; parsed."""
    import json

    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(int(device), buf, size)
        if n < 0:
            raise error(lib, -n)
        if n < size:
            return json.loads(buf.value)
        size = n + 1


def check(lib, rc, state=StateError):
    """Raises the library's error for a non-zero return code `rc` (see error())."""
    if rc != 0:
        raise error(lib, rc, state)
    return rc


def known_tag(lib, name: str) -> int:
    """The core's id of tag `name`, which must be registered already (InvalidArgumentError otherwise)."""
    tag = lib.tb_tag_find(name.encode())
    if tag < 0:
        raise InvalidArgumentError(f"unknown tag {name!r}: no memory was ever allocated or scoped under it")
    return tag
