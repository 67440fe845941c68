"""vLLM's sleep mode over torch_budget (torch_budget.adapters.vllm).

The CPU tests run the adapter over the host stand-in in a forked child (_hostcore.python_api_over),
with small stand-ins of vLLM's modules where the plugin looks vLLM up; the GPU tests run vLLM-style
programs in fresh processes. Nothing here imports the adapter at the top level: importing it installs
torch_budget when a CUDA device is free to take.
"""
import inspect
import logging
import runpy
import sys
import types

import pytest

import torch_budget
from _harness import REPO
from _hostcore import OOM, GiB, MiB, Host, isolated, python_api_over, sees_cuda
from torch_budget import sleep
from torch_budget.errors import InstallError, InvalidArgumentError, StateError

built = pytest.mark.built("_host_core")
gpu = pytest.mark.gpu

NO_DEFAULT = inspect.Parameter.empty
# CuMemAllocator's public methods in vLLM (vllm/device_allocator/cumem.py, the MemAllocator protocol of
# vllm/device_allocator/__init__.py): the parameters in order, with their defaults.
SIGNATURES = {
    "get_instance": [],
    "use_memory_pool": [("self", NO_DEFAULT), ("tag", None)],
    "sleep": [("self", NO_DEFAULT), ("offload_tags", None), ("discardable", ())],
    "discard": [("self", NO_DEFAULT), ("tags", NO_DEFAULT)],
    "wake_up": [("self", NO_DEFAULT), ("tags", None)],
    "get_current_usage": [("self", NO_DEFAULT)],
    "release_pools": [("self", NO_DEFAULT)],
    "close": [("self", NO_DEFAULT)],
    # vLLM's V2 model runner captures graphs through one of these two, by version
    "use_cudagraph_pool": [("self", NO_DEFAULT), ("pool", None)],
    "cudagraph_pool": [("self", NO_DEFAULT), ("pool", None)],
    "release_cudagraph_pool": [("self", NO_DEFAULT), ("pool", None)],
}
BACKEND = {"suspend": [("self", NO_DEFAULT), ("discardable", ()), ("level", None)], "resume": [("self", NO_DEFAULT), ("tags", None)],
           "discard": [("self", NO_DEFAULT), ("tags", NO_DEFAULT)], "state": [("self", NO_DEFAULT)]}
CAPABILITIES = {"is_supported": None, "preserves_communicators": True, "preserves_compiled_artifacts": False,
                "preserves_graphs_with_communicators": False, "supports_durable_storage": False,
                "supports_selective_offload": False}


def _parameters(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _vllm(devices=1, vmm=True, cuda=False, capacity=4 * GiB):
    """The adapter over a fresh host core (`capacity` bytes a device), imported while torch sees no CUDA
    device (so the import installs nothing, on any machine); afterwards torch sees one when `cuda` (the
    plugin acts only then)."""
    sees_cuda(False)
    host = Host(configure=False, devices=devices, vmm=vmm, capacity=capacity)
    python_api_over(host)
    from torch_budget.adapters import vllm as module

    sees_cuda(cuda)

    return host, module


def _alloc(host, nbytes, fill, device=0):
    p = host.malloc(nbytes, stream=host.stream(device), device=device)
    assert host.poke(p, fill * 4096)
    return p


def _states():
    return {tag: (s["state"], s["backup"]) for tag, s in sleep.tag_states().items() if tag != "untagged"}


class _Factory:
    """vLLM's SleepModeBackendFactory, as far as the plugin uses it."""
    _registry = {}

    @classmethod
    def register_backend(cls, name, module_path, class_name):
        if name in cls._registry:
            raise ValueError(f"Sleep-mode backend '{name}' is already registered.")
        cls._registry[name] = lambda: getattr(__import__(module_path, fromlist=[class_name]), class_name)

    @classmethod
    def get_backend_class(cls, name):
        return cls._registry[name]()


def _fake_vllm(tag_hooks=None, backends=True):
    """Stand-ins of the vLLM modules the adapter looks up: device_allocator (with its tag hooks when
    `tag_hooks` is a list to record calls in), device_allocator.cumem's CuMemAllocator slot, and
    the sleep-mode backend factory (`backends`)."""
    vllm = types.ModuleType("vllm")
    allocator = types.ModuleType("vllm.device_allocator")
    if tag_hooks is not None:
        allocator.run_before_unmap_hooks = lambda allocs, tags=None: tag_hooks.append(
            ("before", sorted((a.tag, a.is_asleep) for a in allocs), sorted(tags)))
        allocator.run_after_map_hooks = lambda allocs: tag_hooks.append(
            ("after", sorted((a.tag, a.is_asleep) for a in allocs)))
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    cumem.CuMemAllocator = type("CuMemAllocator", (), {"instance": None})
    modules = {"vllm": vllm, "vllm.device_allocator": allocator, "vllm.device_allocator.cumem": cumem}
    if backends:
        sleep_mode_backend = types.ModuleType("vllm.device_allocator.sleep_mode_backend")
        sleep_mode_backend.SleepModeBackendFactory = _Factory
        modules[sleep_mode_backend.__name__] = sleep_mode_backend
    sys.modules.update(modules)
    return cumem


@built
def test_the_surface_is_vllms():
    @isolated
    def body():
        _, module = _vllm()

        cls = module.CuMemAllocator
        assert isinstance(inspect.getattr_static(cls, "get_instance"), staticmethod)
        for name, expected in SIGNATURES.items():
            assert _parameters(getattr(cls, name)) == expected, name
        assert cls.default_tag == "default" and module.DEFERRABLE_TAGS == ("weights", "kv_cache")
        assert cls.get_instance() is cls.get_instance() is cls.instance
        backend = module.TorchBudgetBackend
        for name, expected in BACKEND.items():
            assert _parameters(getattr(backend, name)) == expected, name
        for name, answer in CAPABILITIES.items():
            assert isinstance(inspect.getattr_static(backend, name), classmethod), name
            if answer is not None:
                assert getattr(backend, name)() is answer, name
        assert backend().state() == "RUNNING"
        assert module.BACKEND_NAME == "torch_budget"

    body()


@built
@isolated
def test_setup_declares_the_plugin_entry_point():
    setup_py = runpy.run_path(str(REPO / "setup.py"), run_name="setup_under_test")
    declared = setup_py["ENTRY_POINTS"]["vllm.general_plugins"]
    assert declared == ["torch_budget = torch_budget.adapters.vllm:register"]
    _, module = _vllm()
    assert declared[0].split(" = ")[1] == f"{module.__name__}:{module.register.__name__}"


@built
@isolated
def test_current_usage_counts_a_pools_allocations_on_every_device():
    host, module = _vllm(devices=2)
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):  # entered with device 0 current
        _alloc(host, 4 * MiB, b"a", device=0)
        _alloc(host, 6 * MiB, b"b", device=1)  # a worker's tensor on another card, same pool
    assert allocator.get_current_usage() >= 10 * MiB, allocator.get_current_usage()


@built
@isolated
def test_sleep_keeps_the_offload_tags_and_discards_the_rest():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    assert allocator.get_current_usage() == 0
    with allocator.use_memory_pool(tag="weights"):
        assert allocator.current_tag == "weights"
        weights = _alloc(host, 4 * MiB, b"w")
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = _alloc(host, 2 * MiB, b"k")
    with allocator.use_memory_pool():  # the default tag
        other = _alloc(host, 2 * MiB, b"d")
    assert allocator.current_tag == "default"
    untagged = _alloc(host, MiB, b"u")
    usage = allocator.get_current_usage()
    assert usage >= 8 * MiB
    allocator.sleep(offload_tags=("weights",))
    assert _states() == {"weights": ("released", "pinned"), "kv_cache": ("released", "none"),
                         "default": ("released", "none")}
    assert allocator.get_current_usage() == usage, "vLLM counts sleeping allocations too"
    assert torch_budget.stats()["by_tag"]["weights"]["resident"] == 0
    assert host.peek(untagged, 4096) == b"u" * 4096
    allocator.wake_up()
    assert {s for s, _ in _states().values()} == {"live"}
    assert host.peek(weights, 4096) == b"w" * 4096
    assert host.peek(kv, 4096) != b"k" * 4096 and host.peek(other, 4096) != b"d" * 4096


@built
@isolated
def test_sleep_without_offload_tags_keeps_the_default_tag():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool():
        kept = _alloc(host, 2 * MiB, b"d")
    with allocator.use_memory_pool("weights"):
        lost = _alloc(host, 2 * MiB, b"w")
    allocator.sleep()
    assert _states() == {"default": ("released", "pinned"), "weights": ("released", "none")}
    allocator.wake_up()
    assert host.peek(kept, 4096) == b"d" * 4096 and host.peek(lost, 4096) != b"w" * 4096
    allocator.sleep("weights")  # a str is one tag, as in vLLM
    assert _states() == {"default": ("released", "none"), "weights": ("released", "pinned")}


@built
@isolated
def test_a_selective_wake_defers_only_weights_and_kv_cache():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    for tag in ("weights", "kv_cache", "default"):
        with allocator.use_memory_pool(tag):
            _alloc(host, MiB, tag[:1].encode())
    allocator.sleep(offload_tags=("weights",))
    allocator.wake_up(tags=["weights"])
    assert {t: s for t, (s, _) in _states().items()} == {"weights": "live", "kv_cache": "released",
                                                         "default": "live"}
    allocator.wake_up(tags=["weights"])  # nothing left to wake among these: no error, as in vLLM
    allocator.wake_up(tags=["kv_cache"])
    assert {s for s, _ in _states().values()} == {"live"}
    allocator.wake_up()  # nothing asleep


@built
@isolated
def test_discard_drops_contents_and_a_sleep_keeps_what_is_asleep():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        weights = _alloc(host, 2 * MiB, b"w")
    with allocator.use_memory_pool("kv_cache"):
        _alloc(host, 2 * MiB, b"k")
    allocator.discard("kv_cache")
    assert _states() == {"weights": ("live", None), "kv_cache": ("released", "none")}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(module.__name__).addHandler(handler)
    allocator.sleep(offload_tags=("weights", "kv_cache"))  # kv_cache asleep without a copy: it stays so
    assert _states() == {"weights": ("released", "pinned"), "kv_cache": ("released", "none")}
    assert any("kv_cache" in r.getMessage() and "already asleep" in r.getMessage() for r in records), records
    allocator.discard(("weights",))  # asleep with a copy: kept
    assert _states()["weights"] == ("released", "pinned")
    allocator.wake_up()
    assert host.peek(weights, 4096) == b"w" * 4096
    allocator.discard(("never_used",))  # a tag without memory: nothing to do


@built
@isolated
def test_a_wake_that_fails_puts_back_to_sleep_what_it_woke():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        weights = _alloc(host, 64 * MiB, b"w")
    with allocator.use_memory_pool("kv_cache"):
        _alloc(host, 64 * MiB, b"k")
    allocator.sleep(offload_tags=("weights",))
    torch_budget.set_budget(96 * MiB)  # room for the weights, not for the KV cache too
    with pytest.raises(OOM):
        allocator.wake_up()
    assert {s for s, _ in _states().values()} == {"released"}, _states()
    assert torch_budget.stats()["reserved"] == 0
    torch_budget.set_budget(1 << 30)
    allocator.wake_up()
    assert host.peek(weights, 4096) == b"w" * 4096


@built
@isolated
def test_a_wake_takes_back_the_memory_torch_budget_holds_cached_as_vllms_empties_the_cache_first():
    # vLLM's wake_up starts with gc.collect() and empty_cache(): memory freed while asleep and held in
    # the cache would otherwise leave the driver too little to map the tags back
    host, module = _vllm(capacity=128 * MiB)
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        weights = _alloc(host, 64 * MiB, b"w")
    allocator.sleep(offload_tags=("weights",))
    host.free(_alloc(host, 80 * MiB, b"t"))  # a transient while asleep: its 80 MiB stay cached
    assert torch_budget.stats()["reserved"] >= 80 * MiB
    allocator.wake_up()
    assert _states() == {"weights": ("live", "pinned")}
    assert host.peek(weights, 4096) == b"w" * 4096


def mapped_usage(allocator) -> int:
    """vLLM's, as tests/basic_correctness/test_cumem.py writes it: bytes the allocator has mapped."""
    return sum(
        data.handle[1]
        for data in allocator.pointer_to_data.values()
        if not data.is_asleep
    )


@built
@isolated
def test_pointer_to_data_lists_the_tags_allocations_as_vllms_allocation_data():
    # vLLM's tests (mapped_usage) and TRL read pointer_to_data; it had no such attribute
    host, module = _vllm(devices=2)
    allocator = module.CuMemAllocator.get_instance()
    assert allocator.pointer_to_data == {}
    with allocator.use_memory_pool("weights"):
        weights = _alloc(host, 4 * MiB, b"w")
        other = _alloc(host, 6 * MiB, b"o", device=1)
    with allocator.use_memory_pool("kv_cache"):
        kv = _alloc(host, 2 * MiB, b"k")
    _alloc(host, MiB, b"u")  # untagged: not the allocator's
    data = allocator.pointer_to_data
    assert sorted(data) == sorted([weights, other, kv])
    assert [(d.handle[:3], d.tag, d.is_asleep, d.cpu_backup_tensor) for d in (data[weights], data[other], data[kv])] \
        == [((0, 4 * MiB, weights), "weights", False, None), ((1, 6 * MiB, other), "weights", False, None),
            ((0, 2 * MiB, kv), "kv_cache", False, None)]
    mapped = mapped_usage(allocator)
    assert mapped == 12 * MiB
    allocator.sleep(offload_tags=("weights",))
    assert mapped_usage(allocator) == 0
    data = allocator.pointer_to_data
    assert all(d.is_asleep for d in data.values()) and data[kv].cpu_backup_tensor is None
    backup = data[weights].cpu_backup_tensor  # a copy of what the restore puts back
    assert backup.nbytes == 4 * MiB and bytes(backup[:4096].numpy()) == b"w" * 4096
    allocator.wake_up(tags=["weights"])
    assert mapped_usage(allocator) == 10 * MiB
    allocator.wake_up()
    assert mapped_usage(allocator) == mapped
    allocator.sleep(("weights",), [weights])  # rewritten after the wake: no copy of it, as in vLLM
    data = allocator.pointer_to_data
    assert data[weights].cpu_backup_tensor is None and data[other].cpu_backup_tensor is not None
    allocator.wake_up()
    assert allocator.pointer_to_data[weights].cpu_backup_tensor is None  # awake: no backup
    with pytest.raises(AttributeError):
        allocator.pointer_to_data = {}


@built
@isolated
def test_allocator_and_pools_holds_an_entry_for_each_use_of_a_tags_pool():
    # vLLM's workspace test: a resize re-enters the tag, len(allocator_and_pools["workspace"]) == 2
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("workspace"):
        small = _alloc(host, 32 * MiB, b"s")
    with allocator.use_memory_pool("workspace"):
        big = _alloc(host, 64 * MiB, b"b")
    with allocator.use_memory_pool("weights"):
        w = _alloc(host, 2 * MiB, b"w")
    pools = allocator.allocator_and_pools
    assert {t: len(e) for t, e in pools.items()} == {"workspace": 2, "weights": 1}
    # vLLM's discardable_allocations reads the weights pools' snapshots
    (pool, _), = pools["weights"]
    assert [(s["address"], [(b["address"], b["state"]) for b in s["blocks"]]) for s in pool.snapshot()] \
        == [(w, [(w, "active_allocated")])]
    assert {s["address"] for p, _ in pools["workspace"] for s in p.snapshot()} == {small, big}
    allocator.release_pools()  # as vLLM's: drops the entries, not the memory
    assert allocator.allocator_and_pools == {} and host.peek(w, 4096) == b"w" * 4096


@built
@pytest.mark.parametrize("release_host_memory", [False, True])
def test_a_wake_frees_the_pinned_host_pool_when_vllm_asks_for_it(release_host_memory):
    # vLLM's default backend calls CuMemAllocator.wake_up itself: VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY
    # had been honoured only by TorchBudgetBackend.resume
    @isolated
    def body():
        sys.modules["vllm.envs"] = types.SimpleNamespace(VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY=release_host_memory)
        host, module = _vllm()
        allocator = module.CuMemAllocator.get_instance()
        with allocator.use_memory_pool("weights"):
            weights = _alloc(host, 8 * MiB, b"w")
        with allocator.use_memory_pool("runtime"):
            _alloc(host, 2 * MiB, b"r")
        allocator.sleep(offload_tags=("weights", "runtime"))
        assert sleep.host_pool_stats()["bytes"] >= 10 * MiB
        allocator.wake_up(tags=["kv_cache"])  # the weights sleep on: their backup stays either way
        assert sleep.host_pool_stats()["used"] >= 8 * MiB
        allocator.wake_up()
        assert host.peek(weights, 4096) == b"w" * 4096
        pinned = sleep.host_pool_stats()["bytes"]
        assert pinned < 8 * MiB if release_host_memory else pinned >= 10 * MiB, pinned

    body()


@built
@isolated
def test_a_pool_opened_for_a_tag_asleep_is_refused_naming_the_tag_and_the_wake_it_needs():
    # vLLM maps a fresh allocation there; torch_budget maps a tag back only whole
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("kv_cache"):
        kv = _alloc(host, 2 * MiB, b"k")
    allocator.sleep(offload_tags=())
    with pytest.raises(StateError, match=r"tag 'kv_cache' is asleep.*wake_up\(\['kv_cache'\]\) first"):
        with allocator.use_memory_pool("kv_cache"):
            pytest.fail("entered a pool of a tag asleep")
    assert allocator.current_tag == "default" and _states() == {"kv_cache": ("released", "none")}
    allocator.wake_up(["kv_cache"])
    with allocator.use_memory_pool("kv_cache"):
        assert host.poke(_alloc(host, MiB, b"x"), b"x" * 4096) and host.poke(kv, b"k" * 4096)


def _allocator_with_tag_hooks():
    """(the tag hooks' calls, as _fake_vllm records them; host; the adapter's CuMemAllocator)
    with vLLM's device_allocator module and its tag hooks faked."""
    calls = []
    _fake_vllm(tag_hooks=calls)
    host, module = _vllm()
    module._vllm_tag_hooks.cache_clear()
    return calls, host, module.CuMemAllocator.get_instance()


@built
@isolated
def test_vllms_tag_hooks_run_around_the_unmap_and_after_the_wake():
    calls, host, allocator = _allocator_with_tag_hooks()
    for tag in ("weights", "kv_cache"):
        with allocator.use_memory_pool(tag):
            _alloc(host, MiB, b"x")
    allocator.discard("kv_cache")
    allocator.sleep(offload_tags=("weights",))
    allocator.wake_up(["weights"])
    allocator.wake_up()
    allocator.wake_up()  # nothing to wake: the hooks run anyway, so one that failed before is retried
    assert calls == [
        ("before", [("kv_cache", False), ("weights", False)], ["kv_cache"]),
        ("before", [("kv_cache", True), ("weights", False)], ["weights"]),
        ("after", [("kv_cache", True), ("weights", False)]),
        ("after", [("kv_cache", False), ("weights", False)]),
        ("after", [("kv_cache", False), ("weights", False)]),
    ], calls


@built
@isolated
def test_a_sleep_that_fails_after_the_before_unmap_hooks_runs_the_after_map_ones():
    # The memory is mapped again by the undo: vLLM's hook state must not stay "unmapped".
    calls, host, allocator = _allocator_with_tag_hooks()
    with allocator.use_memory_pool("weights"):
        _alloc(host, MiB, b"w")
    host.fail("cuMemcpyDtoHAsync", nth=1)
    with pytest.raises(Exception):
        allocator.sleep(offload_tags=("weights",))
    host.heal()
    assert calls == [("before", [("weights", False)], ["weights"]), ("after", [("weights", False)])], calls


@built
@isolated
def test_use_memory_pool_gives_the_tags_unused_cache_back_on_exit():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        kept = _alloc(host, 4 * MiB, b"w")
        host.free(_alloc(host, 64 * MiB, b"t"))  # a transient, as online quantisation makes
        assert torch_budget.stats()["by_tag"]["weights"]["resident"] >= 68 * MiB
    assert torch_budget.stats()["by_tag"]["weights"]["resident"] < 64 * MiB
    assert host.peek(kept, 4096) == b"w" * 4096


@built
@isolated
def test_tags_come_as_a_list_as_vllms_engine_core_hands_tuples_over():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        w = _alloc(host, MiB, b"w")
    with allocator.use_memory_pool("kv_cache"):
        _alloc(host, MiB, b"k")
    allocator.discard(["kv_cache"])
    assert _states()["kv_cache"] == ("released", "none") and _states()["weights"][0] == "live"
    allocator.wake_up()
    allocator.sleep(offload_tags=["weights"])
    assert _states()["weights"] == ("released", "pinned")
    allocator.wake_up(["weights"])
    assert host.peek(w, 4096) == b"w" * 4096


@built
@isolated
def test_a_pool_the_core_refuses_leaves_no_tag_for_sleep_to_look_for():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        _alloc(host, MiB, b"w")
    with pytest.raises(InvalidArgumentError, match="longer than 63 bytes"):
        with allocator.use_memory_pool("t" * 64):
            pass
    allocator.sleep(offload_tags=("weights",))
    assert _states()["weights"] == ("released", "pinned")
    allocator.wake_up()


@built
@isolated
def test_bad_arguments_raise_before_anything_is_done():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with pytest.raises(TypeError, match="tag must be a str"):
        with allocator.use_memory_pool(tag=5):
            pass
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        with allocator.use_memory_pool(tag=""):
            pass
    assert not torch_budget.installed()  # nothing above got as far as installing
    with allocator.use_memory_pool("weights"):
        _alloc(host, MiB, b"w")
    with pytest.raises(TypeError, match="offload_tags must be a str or a tuple or list"):
        allocator.sleep(offload_tags=5)
    with pytest.raises(TypeError, match="a tag of offload_tags must be a str"):
        allocator.sleep(offload_tags=("weights", None))
    with pytest.raises(TypeError, match="tags must be None or a list"):
        allocator.wake_up("weights")
    with pytest.raises(TypeError, match="tags must be a str or a tuple"):
        allocator.discard(None)
    assert _states() == {"weights": ("live", None)}
    backend = module.TorchBudgetBackend()
    with pytest.raises(InvalidArgumentError, match="level must be 1 or 2"):
        backend.suspend(3)
    with pytest.raises(TypeError, match="discardable must be a collection of addresses"):
        backend.suspend(True)
    with pytest.raises(TypeError, match="discardable must hold device addresses"):
        backend.suspend({"weights"})
    with pytest.raises(InvalidArgumentError, match="discardable must hold device addresses"):
        allocator.sleep(("weights",), [-1])
    assert backend.state() == "RUNNING" and _states() == {"weights": ("live", None)}


@built
@isolated
def test_what_torch_budget_cannot_honour_raises_unsupported():
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    assert issubclass(module.UnsupportedError, NotImplementedError)
    with pytest.raises(module.UnsupportedError, match="sleep_mode_backend_options"):
        module.TorchBudgetBackend(suspend_tags=("weights",))


@built
@isolated
def test_the_graph_pool_charges_captures_to_cudagraph_which_every_sleep_backs_up_and_every_wake_maps():
    # vLLM's V2 model runner with its default "cumem" backend captures every graph inside
    # `with allocator.cudagraph_pool() as pool` (use_cudagraph_pool in other versions)
    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        w = _alloc(host, 4 * MiB, b"w")
    with allocator.use_cudagraph_pool() as pool:
        assert allocator.current_tag == module.GRAPH_TAG == "cudagraph"
        g = _alloc(host, 2 * MiB, b"g")  # what a capture allocates
    assert allocator.current_tag == "default"
    with allocator.cudagraph_pool() as again, allocator.use_cudagraph_pool((0, 99)) as theirs:
        assert again == pool and theirs == (0, 99), "one pool of its own; vLLM's own where it passes one"
    allocator.sleep(offload_tags=())  # level 2: nothing offloaded, but a graph's memory always is
    assert _states() == {"weights": ("released", "none"), "cudagraph": ("released", "pinned")}
    allocator.wake_up(tags=["kv_cache"])  # any wake maps the graphs back
    assert _states() == {"weights": ("released", "none"), "cudagraph": ("live", "pinned")}
    assert host.peek(g, 4096) == b"g" * 4096
    allocator.wake_up(tags=["weights"])
    assert host.poke(w, b"w" * 4096)  # level 2 reloads the weights
    host.free(g)  # the graphs are destroyed
    allocator.release_cudagraph_pool()
    assert sleep.tag_states()["cudagraph"]["resident"] == 0, "their memory went back to the driver"
    with allocator.use_cudagraph_pool() as fresh:
        assert fresh != pool, "a recapture starts from a fresh pool"
    allocator.release_cudagraph_pool((0, 1))  # a pool that is not this allocator's: its tag's cache emptied, no error


@built
@isolated
def test_a_stray_end_of_a_pool_scope_raises_and_lists_no_tag_or_pool():
    # contextlib ran the body of a pool scope ended without being entered: use_memory_pool listed its tag
    # (the next sleep released it, so a use_memory_pool of it was refused until a wake) and added an
    # allocator_and_pools entry, use_cudagraph_pool made a graph pool and listed "cudagraph"; then
    # RuntimeError("generator didn't stop"). A second end passed silently.
    import torch

    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    made = []
    torch.cuda.graph_pool_handle = lambda: made.append(1) or (0, 42)
    with pytest.raises(StateError, match=r"CuMemAllocator\.use_memory_pool\('kv_cache'\) was never entered"):
        allocator.use_memory_pool("kv_cache").__exit__(None, None, None)
    with pytest.raises(StateError, match=r"CuMemAllocator\.use_cudagraph_pool\(\) was never entered"):
        allocator.cudagraph_pool().__exit__(None, None, None)
    assert allocator.allocator_and_pools == {} and made == [] and allocator.current_tag == "default"
    scope = allocator.use_memory_pool("weights")
    with scope:
        with pytest.raises(StateError, match=r"use_memory_pool\('weights'\) is open already"):
            scope.__enter__()
        _alloc(host, 2 * MiB, b"w")
    with pytest.raises(StateError, match=r"use_memory_pool\('weights'\) has ended already"):
        scope.__exit__(None, None, None)
    assert {t: len(e) for t, e in allocator.allocator_and_pools.items()} == {"weights": 1}
    allocator.sleep()
    assert _states() == {"weights": ("released", "none")}
    allocator.wake_up()


@built
@isolated
def test_a_graph_pool_that_could_not_be_made_leaves_sleep_working():
    # The graph tag was listed before torch made the pool: when that failed, every later sleep
    # raised "unknown tag 'cudagraph'".
    import torch

    host, module = _vllm()
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        _alloc(host, 4 * MiB, b"w")

    def no_pool():
        raise RuntimeError("CUDA error: out of memory")

    torch.cuda.graph_pool_handle = no_pool
    with pytest.raises(RuntimeError, match="out of memory"):
        with allocator.use_cudagraph_pool():
            pytest.fail("no pool to capture into")
    allocator.sleep(offload_tags=())
    assert _states() == {"weights": ("released", "none")}
    allocator.wake_up()


@built
@isolated
def test_a_device_without_vmm_is_refused():
    _, module = _vllm(vmm=False)
    with pytest.raises(module.UnsupportedError, match="virtual memory management"):
        with module.CuMemAllocator.get_instance().use_memory_pool("weights"):
            pass
    assert module.TorchBudgetBackend.is_supported() is False


def _served_like_vllm(host, module):
    """What a vLLM worker allocates under the sleep-mode allocator: weights (two parameters and a
    buffer), the model runner's state ("runtime"), the KV cache and a workspace."""
    allocator = module.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        params = [_alloc(host, 2 * MiB, b"p"), _alloc(host, 2 * MiB, b"q")]
        buffer = _alloc(host, MiB, b"b")  # a rotary table, say: no parameter, so never discardable
    with allocator.use_memory_pool("runtime"):
        runtime = _alloc(host, MiB, b"r")
    with allocator.use_memory_pool("kv_cache"):
        _alloc(host, 2 * MiB, b"k")
    with allocator.use_memory_pool("workspace"):
        _alloc(host, MiB, b"s")
    return params, buffer, runtime


def _asleep(weights_backup):
    """The states after a sleep of what _served_like_vllm allocated: the runtime state keeps its copy at
    every level, the KV cache and the workspace never do; the weights as `weights_backup` says."""
    return {"weights": ("released", weights_backup), "runtime": ("released", "pinned"),
            "kv_cache": ("released", "none"), "workspace": ("released", "none")}


@built
@isolated
def test_the_backend_sleeps_as_vllm_0_34s_cumem_backend_with_the_addresses_a_level_2_rewrites():
    # vLLM 0.34's worker: sleep(level) -> backend.suspend(discardable), the storage addresses of the
    # parameters the weight update rewrites (none at level 1); its cumem backend then sleeps
    # ("weights", "runtime", "cudagraph") with them
    host, module = _vllm()
    params, buffer, runtime = _served_like_vllm(host, module)
    backend = module.TorchBudgetBackend()
    assert module.TorchBudgetBackend.is_supported() is True
    backend.suspend(set())  # level 1
    assert backend.state() == "SUSPENDED"
    assert _states() == _asleep("pinned")
    backend.resume(["weights"])
    assert backend.state() == "RUNNING" and _states()["kv_cache"][0] == "released"
    assert [host.peek(p, 4096) for p in params] == [b"p" * 4096, b"q" * 4096]
    assert host.peek(runtime, 4096) == b"r" * 4096, "the runtime state is kept at every level"
    backend.resume()
    backend.suspend(set(params))  # level 2, with a buffer beside the parameters: only the buffer is copied
    weights = sleep.tag_states()["weights"]
    assert _states()["weights"] == ("released", "pinned")
    assert weights["backup_bytes"] == 2 * MiB and weights["released"] >= 3 * 2 * MiB, weights  # its page only
    backend.resume()
    assert host.peek(buffer, 4096) == b"b" * 4096
    for p in params:  # mapped again, for the weight update to write
        assert host.poke(p, b"u" * 4096) and host.peek(p, 4096) == b"u" * 4096
    backend.suspend(set(params) | {buffer})  # every weights allocation rewritten: no copy at all
    assert _states()["weights"] == ("released", "none") and _states()["runtime"] == ("released", "pinned")
    backend.resume()
    assert host.peek(runtime, 4096) == b"r" * 4096
    backend.discard(("kv_cache",))
    assert backend.state() == "SUSPENDED" and _states()["kv_cache"] == ("released", "none")


@built
@isolated
def test_the_backend_takes_vllm_0_33s_level_and_keeps_the_runtime_state_at_both():
    host, module = _vllm()
    params, _, runtime = _served_like_vllm(host, module)
    backend = module.TorchBudgetBackend()
    backend.suspend()  # vLLM 0.34's default: nothing discardable, as level 1
    assert _states()["weights"] == ("released", "pinned")
    backend.resume()
    backend.suspend(2)  # vLLM 0.33: suspend(level)
    assert _states() == _asleep("none")
    backend.resume()
    assert host.peek(params[0], 4096) != b"p" * 4096, "level 2 discards the weights"
    assert host.peek(runtime, 4096) == b"r" * 4096
    backend.suspend(1)
    assert _states()["weights"] == ("released", "pinned")
    backend.resume()
    backend.suspend(level=2)  # vLLM 0.33's keyword, taken as it is
    assert _states()["weights"] == ("released", "none")
    backend.resume()
    with pytest.raises(TypeError, match="discardable or level, not both"):
        backend.suspend({params[0]}, level=2)


@built
@isolated
def test_discardable_addresses_outside_the_weights_or_not_live_change_nothing():
    host, module = _vllm()
    params, buffer, runtime = _served_like_vllm(host, module)
    allocator = module.CuMemAllocator.get_instance()
    # the runtime allocation is not a weight, 12345 is no allocation: the buffer is still uncovered
    allocator.sleep(("weights", "runtime"), params + [runtime, 12345])
    assert _states()["weights"] == ("released", "pinned") and _states()["runtime"] == ("released", "pinned")
    allocator.wake_up()
    allocator.sleep(("weights",), params + [buffer])
    assert _states()["weights"] == ("released", "none")
    allocator.wake_up()
    allocator.sleep((), params + [buffer])  # weights not offloaded anyway
    assert _states()["weights"] == ("released", "none")


@built
@isolated
def test_a_discardable_address_past_64_bits_is_refused_and_counts_for_no_allocation():
    # ctypes truncated p + 2**64 to p: two "addresses" of one parameter counted as both weights
    # allocations, and the buffer nobody named was released without a copy
    host, module = _vllm()
    params, buffer, _ = _served_like_vllm(host, module)
    allocator = module.CuMemAllocator.get_instance()
    for bad in ([params[0], params[1], params[0] + 2**64], [params[0], params[1], buffer - 2**64]):
        with pytest.raises((TypeError, ValueError), match="device address"):
            allocator.sleep(("weights",), bad)
        assert _states()["weights"] == ("live", None)
    allocator.sleep(("weights",), params + [params[0]])  # one address twice is one allocation
    assert _states()["weights"] == ("released", "pinned")
    allocator.wake_up()
    assert host.peek(buffer, 4096) == b"b" * 4096


@built
@isolated
def test_register_installs_takes_vllms_allocator_slot_and_registers_the_backend():
    cumem = _fake_vllm()
    _, module = _vllm(cuda=True)
    assert not torch_budget.installed()
    module.register()
    assert torch_budget.installed()
    assert cumem.CuMemAllocator.instance is module.CuMemAllocator.get_instance()
    assert _Factory.get_backend_class("torch_budget") is module.TorchBudgetBackend
    module.register()  # vLLM loads plugins once per process, but twice is harmless
    assert cumem.CuMemAllocator.instance is module.CuMemAllocator.get_instance()


@built
@isolated
def test_register_refuses_a_vllm_allocator_created_before_it():
    cumem = _fake_vllm(backends=False)  # a vLLM without pluggable sleep backends
    cumem.CuMemAllocator.instance = object()
    _, module = _vllm(cuda=True)
    with pytest.raises(StateError, match="created before torch_budget's plugin ran"):
        module.register()


@built
@isolated
def test_register_where_cuda_started_natively_warns_leaves_vllm_its_allocator_and_the_backend_says_why(caplog):
    from torch_budget import _runtime

    cumem = _fake_vllm()
    _, module = _vllm(cuda=True)

    def started():
        raise InstallError("torch's CUDA allocator is already initialised")

    _runtime.check_can_install = started
    with caplog.at_level(logging.WARNING, logger=module.__name__):
        module.register()  # vLLM's load_general_plugins lets a plugin's exception end vLLM
    assert "already initialised" in caplog.text and "VLLM_PLUGINS" in caplog.text, caplog.text
    assert cumem.CuMemAllocator.instance is None, "vLLM's own CuMemAllocator keeps its slot"
    backend = _Factory.get_backend_class("torch_budget")
    with pytest.raises(InstallError, match="cannot serve this process.*already initialised"):
        backend()


@built
@isolated
def test_register_without_a_cuda_device_does_nothing():
    cumem = _fake_vllm()
    _, module = _vllm()  # torch sees no CUDA device here
    module.register()
    assert not torch_budget.installed() and cumem.CuMemAllocator.instance is None


# -- on a device: vLLM's sleep mode, as its worker drives it

@pytest.mark.exclusive  # reads device-wide free memory
@gpu
def test_sleep_gives_the_memory_back_and_wake_keeps_the_weights(fresh):
    fresh(sleep_gives_the_memory_back_and_wake_keeps_the_weights)


def sleep_gives_the_memory_back_and_wake_keeps_the_weights():
    import torch

    from torch_budget.adapters import vllm

    vllm.register()  # what vLLM's load_general_plugins does first in the process
    assert torch_budget.installed()
    allocator = vllm.CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        weights = torch.randn(64 << 20, device="cuda")  # 256 MiB
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.full((128 << 20,), 3.0, device="cuda")  # 512 MiB
    expected, address = weights.cpu(), weights.data_ptr()
    assert allocator.get_current_usage() >= 768 << 20
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    allocator.sleep(offload_tags=("weights",))
    asleep = torch.cuda.mem_get_info()[0]
    assert asleep - before > 0.95 * (768 << 20), (before, asleep)
    assert allocator.get_current_usage() >= 768 << 20, "vLLM counts sleeping allocations too"
    allocator.wake_up(tags=["weights"])
    woke = torch.cuda.mem_get_info()[0]
    assert asleep - woke > 0.95 * (256 << 20) and woke - before > 0.95 * (512 << 20), (before, asleep, woke)
    assert weights.data_ptr() == address and torch.equal(weights.cpu(), expected)
    allocator.wake_up(tags=["kv_cache"])
    assert woke - torch.cuda.mem_get_info()[0] > 0.95 * (512 << 20)
    kv.fill_(5.0)  # discarded contents; the memory is there again at the same address
    assert bool((kv == 5.0).all())


@pytest.mark.exclusive  # reads device-wide free memory
@gpu
def test_the_backend_levels_on_a_device(fresh):
    fresh(the_backend_levels_on_a_device)


def the_backend_levels_on_a_device():
    import torch

    from torch_budget.adapters import vllm

    vllm.register()
    allocator = vllm.CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        weights = torch.randn(32 << 20, device="cuda")  # 128 MiB
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.zeros(32 << 20, device="cuda")  # 128 MiB, kept: the cache vLLM holds  # noqa: F841
    backend = vllm.TorchBudgetBackend()
    assert vllm.TorchBudgetBackend.is_supported()
    expected = weights.cpu()
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    backend.suspend(set())  # vLLM 0.34's level 1: nothing the weight update rewrites
    assert torch.cuda.mem_get_info()[0] - before > 0.95 * (256 << 20)
    states = sleep.tag_states()
    assert (states["weights"]["backup"], states["kv_cache"]["backup"]) == ("pinned", "none"), states
    backend.resume()
    assert backend.state() == "RUNNING" and torch.equal(weights.cpu(), expected)
    assert before - torch.cuda.mem_get_info()[0] < 16 << 20, "all of it is back"
    backend.suspend({weights.untyped_storage().data_ptr()})  # level 2: the update rewrites every parameter
    assert torch.cuda.mem_get_info()[0] - before > 0.95 * (256 << 20)
    assert sleep.tag_states()["weights"]["backup"] == "none", "level 2 keeps no copy of the weights"
    backend.resume()
    weights.copy_(expected)  # after level 2 the weights are reloaded
    assert torch.equal(weights.cpu(), expected)


@gpu
def test_register_after_cuda_started_natively_leaves_torch_its_allocator_and_the_backend_refuses(fresh):
    fresh(register_after_cuda_started_natively)


def register_after_cuda_started_natively():
    import torch

    import torch_budget

    torch.zeros(1, device="cuda")  # torch's own allocator takes CUDA
    from torch_budget.adapters import vllm

    vllm.register()  # warns: an exception here would end vLLM
    assert not torch_budget.installed()
    x = torch.arange(1 << 20, device="cuda", dtype=torch.int64)
    assert int(x.sum().item()) == (1 << 20) * ((1 << 20) - 1) // 2, "torch's allocator keeps serving"
    with pytest.raises(InstallError, match="cannot serve this process.*VLLM_PLUGINS"):
        vllm.TorchBudgetBackend()


@gpu
@pytest.mark.parametrize("level", [1, 2])
def test_graphs_captured_into_the_sleep_mode_graph_pool_replay_after_either_sleep_level(fresh, level):
    fresh(graphs_captured_into_the_graph_pool_replay_after_sleep, level)


def graphs_captured_into_the_graph_pool_replay_after_sleep(level):
    # as vLLM's own test of its cuMem graph pool (tests/basic_correctness/test_cumem.py), driven the
    # way its V2 model runner and its default "cumem" backend drive the allocator
    import torch

    from torch_budget.adapters import vllm

    vllm.register()
    allocator = vllm.CuMemAllocator.get_instance()
    backend = vllm.TorchBudgetBackend()
    with allocator.use_memory_pool("weights"):
        weight = torch.full((1 << 20,), 2.0, device="cuda")
    x = torch.ones_like(weight)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with allocator.cudagraph_pool() as pool, torch.cuda.graph(graph, pool=pool, stream=stream):
        const = torch.empty_like(x)  # no replay writes it: only a backup keeps it
        y = x * weight + const
    const.fill_(3.0)
    states = sleep.tag_states()
    assert states["cudagraph"]["resident"] >= 2 * x.nbytes, states
    mapped = states["cudagraph"]["resident"]
    backend.suspend(set() if level == 1 else {weight.untyped_storage().data_ptr()})  # vLLM 0.34's worker
    assert sleep.tag_states()["cudagraph"]["state"] == "released"
    backend.resume(tags=["kv_cache"])  # any wake maps the graphs back, contents and all
    assert sleep.tag_states()["cudagraph"]["resident"] == mapped
    backend.resume(tags=["weights"])
    weight.fill_(2.0)  # level 2 discards the weights; vLLM reloads them
    graph.replay()
    assert torch.equal(y, torch.full_like(x, 5.0))
    del graph, y, const
    allocator.release_cudagraph_pool()
    assert sleep.tag_states()["cudagraph"]["resident"] == 0, "the graphs' memory went back to the driver"


@built
@isolated
def test_sleep_before_any_allocation_does_nothing():
    _, vllm = _vllm()
    allocator = vllm.CuMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        pass
    allocator.sleep(("weights",))  # it raised: the tag was live on no device
    allocator.wake_up()
    assert not sleep.any_released()


@built
@isolated
def test_a_pool_named_untagged_is_refused_before_it_allocates():
    # Its memory went to torch_budget's own "untagged", and every later sleep() raised for all tags.
    host, vllm = _vllm()
    allocator = vllm.CuMemAllocator.get_instance()
    with pytest.raises(InvalidArgumentError, match="'untagged' is torch_budget's name for memory of no tag"):
        with allocator.use_memory_pool("untagged"):
            pass
    with allocator.use_memory_pool("weights"):
        w = _alloc(host, 2 * MiB, b"w")
    allocator.sleep(("weights",))
    allocator.wake_up()
    assert host.peek(w, 4096) == b"w" * 4096
