"""TensorRT-LLM's virtual memory over torch_budget (torch_budget.adapters.tensorrt_llm).

The CPU tests run the adapter over the host stand-in in a forked child (_hostcore.python_api_over);
the GPU tests run TensorRT-LLM-style programs in fresh processes. Nothing here imports the adapter at
the top level: importing it installs torch_budget when a CUDA device is free to take.
"""
import enum
import inspect
import os

import pytest
import torch

import torch_budget
from _hostcore import OOM, MiB, Host, isolated, python_api_over, sees_cuda
from torch_budget import sleep
from torch_budget.errors import InstallError, InvalidArgumentError, StateError

built = pytest.mark.built("_host_core")
gpu = pytest.mark.gpu

NO_DEFAULT = inspect.Parameter.empty
# tensorrt_llm/_torch/virtual_memory.py's public functions: (name, kind, default) of each parameter.
POSITIONAL, VAR = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_POSITIONAL


def _parameters(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _trt(vmm=True):
    """The adapter over a fresh host core, imported while torch sees no CUDA device (so the import
    installs nothing, on any machine)."""
    sees_cuda(False)
    host = Host(configure=False, vmm=vmm)
    python_api_over(host)
    from torch_budget.adapters import tensorrt_llm as module

    return host, module


def _alloc(host, nbytes, fill):
    p = host.malloc(nbytes, stream=host.stream(0))
    assert host.poke(p, fill * 4096)
    return p


def _states():
    return {tag: (s["state"], s["backup"]) for tag, s in sleep.tag_states().items() if tag != "untagged"}


def _allocated(tag):
    return torch_budget.stats()["by_tag"][tag]["allocated"]


@built
def test_the_surface_is_tensorrt_llms():
    @isolated
    def body():
        _, module = _trt()
        none = module.RestoreMode.NONE
        assert _parameters(module.scope) == [("tag", POSITIONAL, NO_DEFAULT), ("mode", POSITIONAL, none)]
        assert _parameters(module.maybe_scope) == [("enable", POSITIONAL, NO_DEFAULT),
                                                   ("tag", POSITIONAL, NO_DEFAULT), ("mode", POSITIONAL, none)]
        assert _parameters(module.preserve_contents) == []
        for fn in (module.release_with_tag, module.materialize_with_tag):
            assert _parameters(fn) == [("tags", VAR, NO_DEFAULT)], fn
        assert [(m.name, int(m)) for m in module.RestoreMode] == [("NONE", 0), ("MEMSET", 1), ("CPU", 2),
                                                                  ("PINNED", 3)]
        assert {"RestoreMode", "maybe_scope", "scope", "release_with_tag", "materialize_with_tag"} <= set(
            module.__all__)

    body()


@built
@isolated
def test_each_restore_mode_brings_back_what_it_says():
    host, module = _trt()
    mode = module.RestoreMode
    blocks = {}
    for m in mode:
        with module.scope("model", m) as entered:
            assert entered == ("model", m) and (entered.tag, entered.mode) == ("model", m)
            blocks[m] = _alloc(host, 2 * MiB, m.name[:1].encode())
    with module.scope("kv_cache"):
        kv = _alloc(host, 4 * MiB, b"k")
    assert module.release_with_tag("model", "kv_cache") == 5
    assert _states() == {"model": ("released", "none"), "model+memset": ("released", "memset"),
                         "model+cpu": ("released", "cpu"), "model+pinned": ("released", "pinned"),
                         "kv_cache": ("released", "none")}
    assert torch_budget.stats()["reserved"] == 0
    assert module.materialize_with_tag("model", "kv_cache") == 5
    assert host.peek(blocks[mode.PINNED], 4096) == b"P" * 4096
    assert host.peek(blocks[mode.CPU], 4096) == b"C" * 4096
    assert host.peek(blocks[mode.MEMSET], 4096) == bytes(4096)
    assert host.peek(blocks[mode.NONE], 4096) != b"N" * 4096 and host.peek(kv, 4096) != b"k" * 4096


@built
@isolated
def test_a_scope_the_core_refuses_leaves_no_tag_for_release_to_look_for():
    host, module = _trt()
    name = "m" * 58                             # fits alone; with its restore mode's suffix it does not
    with pytest.raises(InvalidArgumentError, match=f"tag '{name}' with restore mode 'pinned'.*longer than 63"):
        with module.scope(name, module.RestoreMode.PINNED):
            pass
    with module.scope(name):
        _alloc(host, MiB, b"m")
    assert module.release_with_tag(name) == 1
    assert module.materialize_with_tag(name) == 1


@built
@isolated
def test_release_and_materialize_skip_what_is_already_done():
    host, module = _trt()
    assert module.release_with_tag() == module.materialize_with_tag() == 0
    assert not torch_budget.installed()  # nothing to do is done without installing
    with module.scope("kv_cache"):
        _alloc(host, MiB, b"k")
    with module.scope("model", module.RestoreMode.PINNED):
        model = _alloc(host, MiB, b"m")
    assert module.materialize_with_tag("kv_cache") == 0  # mapped already
    assert module.release_with_tag("kv_cache", "kv_cache") == 1  # a tag named twice acts once
    assert module.release_with_tag("kv_cache", "never_used") == 0
    assert _states() == {"kv_cache": ("released", "none"), "model+pinned": ("live", None)}
    assert module.release_with_tag("kv_cache", "model") == 1
    assert module.materialize_with_tag("model") == 1
    assert _states()["kv_cache"] == ("released", "none") and host.peek(model, 4096) == b"m" * 4096
    assert module.materialize_with_tag("kv_cache", "model") == 1


@built
@isolated
def test_the_counts_are_tensorrt_llms_one_blob_per_live_allocation():
    host, module = _trt()
    with module.scope("model", module.RestoreMode.PINNED):
        weights = [_alloc(host, n * MiB, bytes([65 + n])) for n in (1, 2, 3, 24)]
    with module.scope("kv_cache"):
        kv = [_alloc(host, 8 * MiB, b"k") for _ in range(3)]
    host.free(weights.pop(1))  # freed: its memory stays cached under the tag, and is no blob
    assert torch_budget.stats()["by_tag"]["model+pinned"]["allocations"] == 3
    assert module.release_with_tag("model") == 3
    assert module.release_with_tag("kv_cache") == 3
    assert torch_budget.stats()["reserved"] == 0  # the cached memory went back too
    host.free(kv.pop())  # freed while released
    assert module.materialize_with_tag("model", "kv_cache") == 5
    for p, n in zip(weights, (1, 3, 24)):
        assert host.peek(p, 4096) == bytes([65 + n]) * 4096


@built
@isolated
def test_scopes_nest_and_the_innermost_decides():
    host, module = _trt()
    with module.scope("model", module.RestoreMode.PINNED):
        _alloc(host, 2 * MiB, b"a")
        with module.scope("spec_resource_manager"):
            _alloc(host, MiB, b"b")
        _alloc(host, 2 * MiB, b"c")
    _alloc(host, MiB, b"u")
    assert _allocated("model+pinned") == 4 * MiB and _allocated("spec_resource_manager") == MiB
    assert _allocated("untagged") == MiB


@built
@isolated
def test_preserve_contents_keeps_metadata_of_a_dropped_scope_under_its_tag():
    host, module = _trt()
    with module.scope("kv_cache"):
        kv = _alloc(host, 4 * MiB, b"k")
        with module.preserve_contents():
            meta = _alloc(host, MiB, b"m")
    with module.preserve_contents():  # outside a scope: nothing
        untagged = _alloc(host, MiB, b"u")
    with module.scope("model", module.RestoreMode.PINNED), module.preserve_contents():  # kept anyway: nothing
        _alloc(host, MiB, b"w")
    assert _allocated("kv_cache+cpu") == MiB and _allocated("untagged") == MiB and _allocated("model+pinned") == MiB
    assert module.release_with_tag("kv_cache") == 2
    assert module.materialize_with_tag("kv_cache") == 2
    assert host.peek(meta, 4096) == b"m" * 4096 and host.peek(kv, 4096) != b"k" * 4096
    assert host.peek(untagged, 4096) == b"u" * 4096


@built
@isolated
def test_a_stray_end_of_a_scope_raises_and_registers_nothing():
    # contextlib ran the body of a scope ended without being entered: it registered the (tag, mode) pair
    # (so "model+pinned" became taken, a scope of that name refused) and took a core tag for it, then raised
    # RuntimeError("generator didn't stop"). A second end passed silently.
    host, module = _trt()
    pinned = module.RestoreMode.PINNED
    with pytest.raises(StateError, match=r"scope\('model'\) was never entered"):
        module.scope("model", pinned).__exit__(None, None, None)
    with pytest.raises(StateError, match=r"maybe_scope\(True, 'model'\) was never entered"):
        module.maybe_scope(True, "model", pinned).__exit__(None, None, None)
    with module.scope("kv_cache"):
        with pytest.raises(StateError, match=r"preserve_contents\(\) was never entered"):
            module.preserve_contents().__exit__(None, None, None)
    assert "model+pinned" not in torch_budget.stats()["by_tag"] and "kv_cache+cpu" not in torch_budget.stats()["by_tag"]
    entered = module.scope("model+pinned")  # free: no pair took the name
    with entered:
        with pytest.raises(StateError, match=r"scope\('model\+pinned'\) is open already"):
            entered.__enter__()
        _alloc(host, MiB, b"m")
    with pytest.raises(StateError, match=r"scope\('model\+pinned'\) has ended already"):
        entered.__exit__(None, None, None)
    _alloc(host, MiB, b"u")
    assert _allocated("model+pinned") == MiB and _allocated("untagged") == MiB


@built
@isolated
def test_a_scope_ended_out_of_order_leaves_the_inner_scope_in_force_for_preserve_contents():
    # The scope's end popped the innermost entry of the thread's stack, which was the inner scope's:
    # preserve_contents inside "b" (PINNED: nothing to do) then read "a" (NONE) and charged "a+cpu".
    host, module = _trt()
    outer, inner = module.scope("a"), module.scope("b", module.RestoreMode.PINNED)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(StateError, match=r"region\('a'\) is ended while region\('b\+pinned'\)"):
        outer.__exit__(None, None, None)
    with module.preserve_contents():
        _alloc(host, MiB, b"b")
    inner.__exit__(None, None, None)
    _alloc(host, MiB, b"u")
    by_tag = torch_budget.stats()["by_tag"]
    assert "a+cpu" not in by_tag and _allocated("b+pinned") == MiB and _allocated("untagged") == MiB
    with module.preserve_contents():  # no scope left open
        _alloc(host, MiB, b"u")
    assert _allocated("untagged") == 2 * MiB


@built
@isolated
def test_maybe_scope_scopes_only_when_enabled():
    host, module = _trt()
    with module.maybe_scope(True, "model", module.RestoreMode.PINNED) as entered:
        assert entered.tag == "model"
        _alloc(host, 2 * MiB, b"m")
    with module.maybe_scope(False, "model", module.RestoreMode.PINNED) as entered:
        assert entered is None
        _alloc(host, MiB, b"u")
    assert _allocated("untagged") == MiB and _allocated("model+pinned") == 2 * MiB
    with pytest.raises(TypeError, match="enable must be a bool"):
        with module.maybe_scope(1, "model"):
            pass


@built
@isolated
def test_tensorrt_llms_own_tags_and_modes_are_taken():
    class ExecutorMemoryType(str, enum.Enum):  # TensorRT-LLM's tags are such str enums
        KV_CACHE = "kv_cache"
        MODEL_ENGINE_MAIN = "model"

    # TensorRT-LLM's binding enum: the same member names
    BindingMode = enum.Enum("CudaVirtualMemoryAllocatorRestoreMode", "NONE MEMSET CPU PINNED")
    host, module = _trt()
    with module.scope(ExecutorMemoryType.MODEL_ENGINE_MAIN, BindingMode.PINNED):
        model = _alloc(host, MiB, b"m")
    with module.scope(ExecutorMemoryType.KV_CACHE, BindingMode.NONE):
        _alloc(host, MiB, b"k")
    assert set(_states()) == {"model+pinned", "kv_cache"}
    assert module.release_with_tag(*ExecutorMemoryType) == 2
    assert module.materialize_with_tag(ExecutorMemoryType.MODEL_ENGINE_MAIN, "kv_cache") == 2
    assert host.peek(model, 4096) == b"m" * 4096


@built
@isolated
def test_bad_arguments_raise_before_anything_is_done():
    host, module = _trt()
    for tag, error, says in [(5, TypeError, "tag must be a str"), ("", InvalidArgumentError, "non-empty")]:
        with pytest.raises(error, match=says):
            with module.scope(tag):
                pass
    with pytest.raises(TypeError, match="mode must be a RestoreMode"):
        with module.scope("model", 3):
            pass
    with pytest.raises(InvalidArgumentError, match="unknown restore mode 'DISK'"):
        with module.scope("model", enum.Enum("Mode", "DISK").DISK):
            pass
    with pytest.raises(TypeError, match="a tag must be a str"):
        module.release_with_tag("model", None)
    assert not torch_budget.installed()
    with module.scope("a", module.RestoreMode.PINNED):
        _alloc(host, MiB, b"a")
    with pytest.raises(InvalidArgumentError, match="already uses"):
        with module.scope("a+pinned"):  # would be the torch_budget tag of ("a", PINNED)
            pass


@built
@isolated
def test_a_release_that_fails_releases_nothing():
    host, module = _trt()
    with module.scope("kv_cache"):
        kv = _alloc(host, 4 * MiB, b"k")
    with module.scope("model", module.RestoreMode.PINNED):
        model = _alloc(host, 4 * MiB, b"m")
    host.fail("cuMemcpyDtoHAsync", nth=-1)  # the model's copy to the host fails
    with pytest.raises(Exception, match="cuMemcpyDtoHAsync"):
        module.release_with_tag("kv_cache", "model")
    host.heal()
    assert {s for s, _ in _states().values()} == {"live"}, _states()
    # Scopes whose modes keep contents go first: kv_cache (no copy) went before, and its undo
    # mapped it back with its contents lost.
    assert host.peek(model, 4096) == b"m" * 4096 and host.peek(kv, 4096) == b"k" * 4096
    assert module.release_with_tag("kv_cache", "model") == 2


@built
@isolated
def test_a_materialize_short_of_memory_keeps_earlier_tags_and_the_failing_one_whole_released():
    host, module = _trt()
    with module.scope("a", module.RestoreMode.PINNED):
        a = _alloc(host, 64 * MiB, b"a")
    with module.scope("b"):
        _alloc(host, 64 * MiB, b"b")
    with module.scope("b", module.RestoreMode.PINNED):
        b = _alloc(host, 64 * MiB, b"c")
    assert module.release_with_tag("a", "b") == 3
    torch_budget.set_budget(160 * MiB)  # a and b's first part fit, b's second does not
    with pytest.raises(OOM):
        module.materialize_with_tag("a", "b")
    assert _states() == {"a+pinned": ("live", "pinned"), "b": ("released", "none"),
                         "b+pinned": ("released", "pinned")}, _states()
    torch_budget.set_budget(1 << 30)
    assert module.materialize_with_tag("a", "b") == 2
    assert host.peek(a, 4096) == b"a" * 4096 and host.peek(b, 4096) == b"c" * 4096


@built
@isolated
def test_an_undo_that_runs_out_of_memory_does_not_stop_the_others_or_hide_the_failure(monkeypatch):
    from torch_budget.errors import DriverError

    host, module = _trt()
    for tag, mode in (("a", module.RestoreMode.PINNED), ("b", module.RestoreMode.CPU),
                      ("c", module.RestoreMode.PINNED)):
        with module.scope(tag, mode):
            _alloc(host, 4 * MiB, tag.encode())
    real_release, real_restore = torch_budget.release, torch_budget.restore
    refusals = iter([True])  # the first restore of the undo runs out of memory (a torch error)

    def release(name, **kw):
        if name == "c+pinned":
            raise DriverError("c refused")
        return real_release(name, **kw)

    def restore(name, **kw):
        if next(refusals, False):
            raise torch.cuda.OutOfMemoryError(f"no room to restore {name}")
        return real_restore(name, **kw)

    monkeypatch.setattr(torch_budget, "release", release)
    monkeypatch.setattr(torch_budget, "restore", restore)
    with pytest.raises(DriverError, match="c refused") as raised:
        module.release_with_tag("a", "b", "c")
    notes = "".join(raised.value.__notes__)
    assert "restoring 'b+cpu' again to undo it failed too (OutOfMemoryError" in notes
    # b stays released (its undo failed), a was still put back
    assert _states() == {"a+pinned": ("live", "pinned"), "b+cpu": ("released", "cpu"),
                         "c+pinned": ("live", None)}, _states()


@built
@isolated
def test_a_plan_applied_with_plan_tags_bounds_tensorrt_llms_memory_in_every_mode():
    from torch_budget import planner
    from torch_budget.errors import PlanDoesNotFitError
    from torch_budget.planner import CacheCost, Profile

    host, module = _trt()
    prof = Profile.from_measurements(torch_peak=28 * MiB, torch_used=28 * MiB, total_used=31 * MiB, total=4 << 30,
                                     model_bytes=16 * MiB)
    p = planner.plan(prof, CacheCost(slope=4096), max_kv_bytes=32 * MiB)
    weights = module.ExecutorMemoryType.MODEL_WEIGHTS_MAIN
    with module.scope(weights, module.RestoreMode.PINNED):
        _alloc(host, 16 * MiB, b"w")  # the weights line, all of it
    with p.apply(tags=module.PLAN_TAGS):
        with pytest.raises(OOM, match=r"tag 'model_weights' \(this allocation is under 'model_weights\+pinned'"):
            with module.scope(weights, module.RestoreMode.PINNED):
                _alloc(host, 4 * MiB, b"x")
        with module.scope("kv_cache"):
            _alloc(host, 24 * MiB, b"k")
            with module.preserve_contents():  # kv_cache+cpu: the same line
                _alloc(host, 8 * MiB, b"m")
                with pytest.raises(OOM, match="tag 'kv_cache'"):
                    _alloc(host, 4096, b"n")
        assert torch_budget.stats()["by_tag"]["kv_cache"]["headroom"] == 0  # the whole family's 32 MiB
    # a plan whose KV line is below what the family holds already does not fit
    small = planner.plan(prof, CacheCost(slope=4096), max_kv_bytes=16 * MiB)
    with pytest.raises(PlanDoesNotFitError, match="'kv_cache' has 32.0 MiB allocated"):
        small.apply(tags=module.PLAN_TAGS)
    assert module.verify_sleep_wakeup_tags(["kv_cache", weights]) == [module.ExecutorMemoryType.KV_CACHE, weights]
    with pytest.raises(ValueError, match="Unknown memory tag 'weights'"):
        module.verify_sleep_wakeup_tags(["weights"])


@built
@isolated
def test_a_device_without_vmm_is_refused():
    _, module = _trt(vmm=False)
    with pytest.raises(module.UnsupportedError, match="virtual memory management"):
        with module.scope("model"):
            pass


@built
@isolated
def test_the_first_scope_after_cuda_started_natively_raises_install_error_saying_so():
    from torch_budget import _runtime

    _, module = _trt()

    def started():
        raise InstallError("torch's CUDA allocator is already initialised")

    _runtime.check_can_install = started
    with pytest.raises(InstallError, match="before the first CUDA tensor") as raised:
        with module.scope("model"):
            pass
    assert "already initialised" in str(raised.value)


# -- on a device: TensorRT-LLM's sleep and wake-up, written against the adapter

@pytest.mark.exclusive  # reads device-wide free memory
@gpu
def test_release_gives_the_memory_back_and_materialize_restores_by_mode(fresh):
    fresh(release_gives_the_memory_back_and_materialize_restores_by_mode)


def release_gives_the_memory_back_and_materialize_restores_by_mode():
    import torch

    from torch_budget.adapters import tensorrt_llm as virtual_memory  # installs torch_budget

    mode = virtual_memory.RestoreMode
    assert torch_budget.installed()
    with virtual_memory.scope("model", mode.PINNED):
        model = torch.randn(64 << 20, device="cuda")  # 256 MiB
    with virtual_memory.scope("kv_cache"):
        kv = torch.full((128 << 20,), 7.0, device="cuda")  # 512 MiB
    with virtual_memory.scope("executor_extra", mode.MEMSET):
        extra = torch.full((16 << 20,), 1.0, device="cuda")  # 64 MiB
    expected, address = model.cpu(), model.data_ptr()
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    assert virtual_memory.release_with_tag("model", "kv_cache", "executor_extra") == 3
    released = torch.cuda.mem_get_info()[0]
    assert released - before > 0.95 * (832 << 20), (before, released)
    assert virtual_memory.materialize_with_tag("model", "kv_cache", "executor_extra") == 3
    assert released - torch.cuda.mem_get_info()[0] > 0.95 * (832 << 20)
    assert model.data_ptr() == address and torch.equal(model.cpu(), expected)
    assert int(torch.count_nonzero(extra)) == 0, "MEMSET brings zeros back"
    kv.fill_(2.0)
    assert bool((kv == 2.0).all())


@pytest.mark.exclusive  # reads device-wide free memory
@gpu
def test_preserve_contents_on_a_device(fresh):
    fresh(preserve_contents_on_a_device)


def preserve_contents_on_a_device():
    import torch

    from torch_budget.adapters import tensorrt_llm as virtual_memory

    with virtual_memory.scope("kv_cache"):
        pool = torch.empty(64 << 20, device="cuda")
        with virtual_memory.preserve_contents():
            table = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    assert virtual_memory.release_with_tag("kv_cache") == 2
    assert torch.cuda.mem_get_info()[0] - before > 0.95 * (260 << 20)
    assert torch_budget.stats()["by_tag"]["kv_cache+cpu"]["backup_bytes"] >= 4 << 20
    virtual_memory.materialize_with_tag("kv_cache")
    assert torch.equal(table.cpu(), torch.arange(1 << 20, dtype=torch.int32))
    pool.fill_(1.0)
    assert bool((pool == 1.0).all())


@gpu
def test_a_scope_after_cuda_started_natively_raises(fresh):
    fresh(a_scope_after_cuda_started_natively_raises)


def a_scope_after_cuda_started_natively_raises():
    import torch

    torch.zeros(1, device="cuda")
    from torch_budget.adapters import tensorrt_llm as virtual_memory

    with pytest.raises(InstallError, match="before the first CUDA tensor"):
        with virtual_memory.scope("model"):
            pass


def _fake_tensorrt_llm():
    """Stand-ins of the TensorRT-LLM modules serve_tensorrt_llm rebinds: its virtual_memory (with
    its binding's RestoreMode and its ExecutorMemoryType), py_executor_creator, which binds
    `scope` at import, and an LLM whose sleep / wakeup import their functions when they run."""
    import sys
    import types

    def native(name):
        def call(*args, **kwargs):
            raise AssertionError(f"TensorRT-LLM's own {name} was called")
        return call

    vm = types.ModuleType("tensorrt_llm._torch.virtual_memory")
    vm.RestoreMode = enum.Enum("CudaVirtualMemoryAllocatorRestoreMode", "NONE MEMSET CPU PINNED")
    vm.ExecutorMemoryType = enum.Enum("ExecutorMemoryType", {"MODEL_ENGINE_MAIN": "model", "KV_CACHE": "kv_cache"},
                                      type=str)
    for name in ("scope", "maybe_scope", "preserve_contents", "release_with_tag", "materialize_with_tag"):
        setattr(vm, name, native(name))
    creator = types.ModuleType("tensorrt_llm._torch.pyexecutor.py_executor_creator")
    creator.virtual_memory_scope, creator.RestoreMode = vm.scope, vm.RestoreMode  # bound at its import
    llm = types.ModuleType("tensorrt_llm.llmapi.llm")

    def sleep(*tags):
        from tensorrt_llm._torch.virtual_memory import release_with_tag
        return release_with_tag(*tags)

    def wakeup(*tags):
        from tensorrt_llm._torch.virtual_memory import materialize_with_tag
        return materialize_with_tag(*tags)

    llm.sleep, llm.wakeup = sleep, wakeup
    modules = {m.__name__: m for m in (vm, creator, llm)}
    for name in ("tensorrt_llm", "tensorrt_llm._torch", "tensorrt_llm._torch.pyexecutor", "tensorrt_llm.llmapi"):
        modules[name] = types.ModuleType(name)
    for name, module in modules.items():  # an import binds each submodule on its parent
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, module)
    sys.modules.update(modules)
    return vm, creator, llm


@built
@isolated
def test_serve_tensorrt_llm_points_its_own_executor_and_sleep_at_the_adapter():
    host, module = _trt()
    vm, creator, llm = _fake_tensorrt_llm()
    os.environ.pop("TORCH_BUDGET_SERVE", None)
    assert module.serve_tensorrt_llm() == 6  # five functions, and the creator's bound `scope`
    assert os.environ["TORCH_BUDGET_SERVE"] == "tensorrt_llm", "the workers it starts inherit the variable"
    assert module.serve_tensorrt_llm() == 0, "idempotent"
    assert os.environ["TORCH_BUDGET_SERVE"] == "tensorrt_llm"
    memory_type = vm.ExecutorMemoryType
    with creator.virtual_memory_scope(memory_type.MODEL_ENGINE_MAIN.value, creator.RestoreMode.PINNED):
        weights = _alloc(host, 2 * MiB, b"w")
    with vm.maybe_scope(True, memory_type.KV_CACHE, vm.RestoreMode.NONE):
        _alloc(host, 4 * MiB, b"k")
    assert llm.sleep(*memory_type) == 2
    assert _states() == {"model+pinned": ("released", "pinned"), "kv_cache": ("released", "none")}
    assert llm.wakeup(*memory_type) == 2
    assert host.peek(weights, 4096) == b"w" * 4096


@built
@isolated
def test_serve_tensorrt_llm_without_tensorrt_llm_raises_import_error():
    _, module = _trt()
    with pytest.raises(ImportError):
        module.serve_tensorrt_llm()


@built
@isolated
def test_release_and_materialize_before_any_allocation_do_nothing():
    # TensorRT-LLM's own allocator has nothing to walk then; the core said "live on no device".
    _, trt = _trt()
    with trt.scope("kv_cache"):
        pass
    assert trt.release_with_tag("kv_cache") == 0 and trt.materialize_with_tag("kv_cache") == 0


@built
@isolated
def test_a_tag_named_untagged_is_released_like_any_other():
    host, trt = _trt()
    with trt.scope("untagged"):
        _alloc(host, 2 * MiB, b"A")
    with trt.scope("untagged", trt.RestoreMode.PINNED):
        b = _alloc(host, 2 * MiB, b"B")
    assert trt.release_with_tag("untagged") == 2  # under torch_budget's own "untagged", nothing could go
    assert trt.materialize_with_tag("untagged") == 2 and host.peek(b, 4096) == b"B" * 4096
