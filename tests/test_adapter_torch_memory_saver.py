"""torch_memory_saver's interface over torch_budget (torch_budget.adapters.torch_memory_saver).

The CPU tests run the adapter over the host stand-in in a forked child (_hostcore.python_api_over);
the GPU tests run torch_memory_saver-style programs in fresh processes. Nothing here imports the
adapter at the top level: importing it installs torch_budget when a CUDA device is free to take.
"""
import contextlib
import ctypes
import inspect
import os

import pytest

import torch_budget
from _hostcore import S1, MiB, Host, isolated, python_api_over
from torch_budget import sleep
from torch_budget.errors import InstallError, InvalidArgumentError, StateError, TagStateError, TorchBudgetError

built = pytest.mark.built("_host_core")
gpu = pytest.mark.gpu

# torch_memory_saver's public signatures (torch_memory_saver/entrypoint.py and hooks/mode_preload.py):
# the parameters in order, with their defaults.
NO_DEFAULT = inspect.Parameter.empty
SIGNATURES = {
    "region": [("self", NO_DEFAULT), ("tag", "default"), ("enable_cpu_backup", False),
               ("enable_disk_backup", False), ("cpu_backup_backend", None)],
    "cuda_graph": [("self", NO_DEFAULT), ("cuda_graph", NO_DEFAULT), ("pool", None), ("stream", None),
                   ("capture_error_mode", "global"), ("tag", "default"), ("enable_cpu_backup", False),
                   ("cpu_backup_backend", None)],
    "disable": [("self", NO_DEFAULT)],
    "pause": [("self", NO_DEFAULT), ("tag", None)],
    "resume": [("self", NO_DEFAULT), ("tag", None)],
    "get_cpu_backup": [("self", NO_DEFAULT), ("x", NO_DEFAULT), ("zero_copy", False)],
    "set_disk_backup_dir": [("self", NO_DEFAULT), ("path", NO_DEFAULT)],
}
# Properties: (has a getter that answers, has a setter).
PROPERTIES = {"enabled": (True, False), "hook_mode": (False, True), "memory_margin_bytes": (False, True),
              "retain_cpu_backup": (True, True)}


def _parameters(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _saver(devices=1, **env):
    """The adapter over a fresh host core, with torch_memory_saver's variables `env` set."""
    os.environ.update(env)
    host = Host(configure=False, devices=devices)
    python_api_over(host)
    from torch_budget.adapters import torch_memory_saver as module

    return host, module


def _init_enabled_saver():
    """The saver initialised with TMS_INIT_ENABLE=1 and CPU backups, as torch_memory_saver's
    nested_region and training_engine examples run it."""
    host, module = _saver(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    saver = module.torch_memory_saver
    saver._ensure_initialized()
    return host, saver


def _alloc(host, nbytes, fill, device=0):
    p = host.malloc(nbytes, stream=host.stream(device), device=device)
    assert host.poke(p, fill * 4096)
    return p


@built
@isolated
def test_every_public_name_has_torch_memory_saver_signature():
    _, module = _saver()
    assert isinstance(module.torch_memory_saver, module.TorchMemorySaver)
    assert _parameters(module.configure_subprocess) == []
    cls = module.TorchMemorySaver
    public = {n for n in dir(cls) if not n.startswith("_")}
    assert public == set(SIGNATURES) | set(PROPERTIES), public
    for name, expected in SIGNATURES.items():
        assert _parameters(getattr(cls, name)) == expected, name
    for name, (getter, setter) in PROPERTIES.items():
        prop = inspect.getattr_static(cls, name)
        assert isinstance(prop, property) and (prop.fset is not None) == setter, name
    saver = module.torch_memory_saver
    assert saver.enabled is True and saver.retain_cpu_backup is False
    with pytest.raises(AttributeError):
        saver.hook_mode
    with pytest.raises(NotImplementedError, match="only be set"):
        saver.memory_margin_bytes


@built
@isolated
def test_first_use_installs_torch_budget():
    _, module = _saver()
    assert not torch_budget.installed()
    with module.torch_memory_saver.region():
        pass
    assert torch_budget.installed()
    assert torch_budget.stats()["by_tag"]["default"]["state"] == "live"


@built
@isolated
def test_first_use_after_cuda_started_natively_raises_install_error_saying_so():
    from torch_budget import _runtime

    _, module = _saver()

    def started():
        raise InstallError("torch's CUDA allocator is already initialised")

    _runtime.check_can_install = started
    with pytest.raises(InstallError, match="before the first CUDA tensor") as raised:
        with module.torch_memory_saver.region():
            pass
    assert "already initialised" in str(raised.value)


@built
@isolated
def test_pause_keeps_cpu_backed_contents_and_loses_the_rest():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region(enable_cpu_backup=True):
        kept = _alloc(host, 4 * MiB, b"k")
    with saver.region(enable_cpu_backup=False):  # the same tag, no backup
        lost = _alloc(host, 2 * MiB, b"l")
    saver.pause()
    states = sleep.tag_states()
    assert states["default+pinned"]["state"] == states["default"]["state"] == "released", states
    assert states["default+pinned"]["backup"] == "pinned" and states["default"]["backup"] == "none"
    assert torch_budget.stats()["reserved"] == 0
    saver.resume()
    assert host.peek(kept, 4096) == b"k" * 4096
    assert host.peek(lost, 4096) != b"l" * 4096


@built
@isolated
def test_a_tag_that_holds_nothing_is_not_paused_and_blocks_no_pause_of_every_tag():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("kv"):
        _alloc(host, MiB, b"k")
    with saver.region("cuda_graph"):
        pass                                     # a region that allocated nothing
    saver.pause("cuda_graph")                    # as torch_memory_saver: no allocation to walk
    saver.pause("cuda_graph")
    saver.resume("cuda_graph")
    saver.pause()                                # pauses 'kv'
    assert sleep.tag_states()["kv"]["state"] == "released"
    with pytest.raises(TagStateError, match="'kv' already paused"):
        saver.pause("kv")                        # a tag that holds memory is refused twice
    saver.resume()
    assert sleep.tag_states()["kv"]["state"] == "live"


@built
@pytest.mark.parametrize("refused", ["long", "many"])
@isolated
def test_a_region_the_core_refuses_leaves_no_tag_for_pause_to_look_for(refused):
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("kv"):
        _alloc(host, MiB, b"k")
    if refused == "long":
        with pytest.raises(InvalidArgumentError, match="tag 'x{60}' with backup 'pinned'.*longer than 63 bytes"):
            with saver.region("x" * 60, enable_cpu_backup=True):
                pass
    else:
        with pytest.raises(InvalidArgumentError, match="too many tags"):
            for k in range(64):
                with saver.region(f"t{k}", enable_cpu_backup=True):
                    pass
    saver.pause()
    assert sleep.tag_states()["kv"]["state"] == "released"
    saver.resume()


@built
@isolated
def test_retain_cpu_backup_keeps_the_backup_and_an_unchanged_pause_copies_nothing():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("w", enable_cpu_backup=True):
        p = _alloc(host, 8 * MiB, b"r")
    with saver.region("kv"):
        _alloc(host, 2 * MiB, b"x")
    assert saver.retain_cpu_backup is False
    saver.retain_cpu_backup = True
    saver.pause()
    saver.resume()
    assert sleep.tag_states()["w+pinned"]["retained"] and not sleep.tag_states()["kv"]["retained"]
    saver.pause("w")
    assert host.tag_info("w+pinned")["last_backup"] == 0        # unchanged since the resume: no copy
    saver.retain_cpu_backup = False                            # read at resume, as torch_memory_saver does
    saver.resume("w")
    assert host.peek(p, 4096) == b"r" * 4096
    assert not sleep.tag_states()["w+pinned"]["retained"] and sleep.host_pool_stats()["used"] == 0


@built
@pytest.mark.parametrize("paused", [False, True])
@isolated
def test_a_retained_backup_goes_with_the_memory_it_backs_as_torch_memory_saver_frees_it(paused):
    # torch_memory_saver's cpu_backup example (_assert_cpu_backup_released_on_allocation_free): a
    # retained pinned backup, the region's pool dropped, the tensor freed under the region's config,
    # the cache emptied: the backup's host memory is unpinned, the tag paused or not.
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("keep", enable_cpu_backup=True):
        k = _alloc(host, 2 * MiB, b"k")
    with saver.region("t", enable_cpu_backup=True):
        t = _alloc(host, 4096, b"t")
    assert set(saver._impl._mem_pools) == {("keep", True, False, "pinned", 0), ("t", True, False, "pinned", 0)}
    saver.retain_cpu_backup = True
    saver.pause("keep")
    saver.resume("keep")                   # "keep" retains its backup, in a chunk of its own
    kept = sleep.host_pool_stats()
    pinned = host.lib.tb_host_pinned()  # the pool's chunk, and what the digests are read back through
    saver.pause("t")
    address, view = host.backup_view(t, 4096)
    assert ctypes.string_at(address, 4096) == b"t" * 4096
    if not paused:
        saver.resume("t")
        assert host.peek(t, 4096) == b"t" * 4096 and sleep.tag_states()["t+pinned"]["retained"]
    pool = saver._impl._mem_pools.pop(("t", True, False, "pinned", 0))
    assert pool.tag == "t+pinned"
    host.backup_view_end(view)
    assert sleep.host_pool_stats()["bytes"] == kept["bytes"] + 2 * MiB, "the backup still holds its memory"
    cdll = saver._impl._binary_wrapper.cdll
    with saver._impl._with_region_config(tag="t", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        assert (cdll.tms_get_current_tag(), cdll.tms_get_enable_cpu_backup()) == (b"t", True)
        host.free(t)
        del pool
        torch_budget.empty_cache()
    stats = sleep.host_pool_stats()
    assert stats["bytes"] == kept["bytes"] and host.lib.tb_host_pinned() == pinned, stats
    assert sleep.tag_states()["t+pinned"]["backup_bytes"] == 0
    assert sleep.tag_states()["keep+pinned"]["retained"] and host.peek(k, 4096) == b"k" * 4096
    saver.pause("keep")
    assert host.tag_info("keep+pinned")["last_backup"] == 0, "the other tag's retained backup is untouched"
    saver.retain_cpu_backup = False
    saver.resume()
    assert host.peek(k, 4096) == b"k" * 4096
    assert sleep.host_pool_stats()["bytes"] == 0 and host.lib.tb_host_pinned() == pinned - kept["bytes"]


@built
@isolated
def test_retain_cpu_backup_is_one_flag_for_the_process_as_torch_memory_saver_keeps_it():
    host, module = _saver()
    first, second = module.torch_memory_saver, module.TorchMemorySaver()
    with first.region("w", enable_cpu_backup=True):
        p = _alloc(host, 2 * MiB, b"r")
    second.retain_cpu_backup = True
    assert first.retain_cpu_backup is True
    first.pause("w")
    first.resume("w")
    assert sleep.tag_states()["w+pinned"]["retained"] and host.peek(p, 4096) == b"r" * 4096
    first.retain_cpu_backup = False
    assert second.retain_cpu_backup is False


@built
@isolated
def test_a_resume_that_keeps_no_backup_unpins_its_host_memory_as_torch_memory_saver_frees_it():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("w", enable_cpu_backup=True):
        w = _alloc(host, 64 * MiB, b"w")
    with saver.region("o", enable_cpu_backup=True):
        o = _alloc(host, 8 * MiB, b"o")
    saver.pause()
    assert sleep.host_pool_stats()["used"] == 72 * MiB
    saver.resume("w")
    assert host.peek(w, 4096) == b"w" * 4096
    stats = sleep.host_pool_stats()  # o's backup, still paused, keeps its memory
    assert stats["used"] == stats["bytes"] == 8 * MiB and host.lib.tb_host_pinned() == 8 * MiB, stats
    saver.pause("w")
    address, view = host.backup_view(w, 4096)  # a zero-copy view outlives the resume
    saver.resume("w")
    assert sleep.host_pool_stats()["bytes"] == 72 * MiB
    assert ctypes.string_at(address, 4096) == b"w" * 4096
    host.backup_view_end(view)
    saver.resume("o")
    assert host.peek(o, 4096) == b"o" * 4096
    assert sleep.host_pool_stats()["bytes"] == 0 and host.lib.tb_host_pinned() == 0
    saver.retain_cpu_backup = True  # kept across the resume: pinned it stays
    saver.pause()
    saver.resume()
    assert sleep.host_pool_stats()["bytes"] == 72 * MiB and host.peek(w, 4096) == b"w" * 4096


@built
@isolated
def test_a_host_pool_reserved_at_install_stays_pinned_across_resumes():
    host, module = _saver(TORCH_BUDGET_CONF="host_pool:16MiB")
    saver = module.torch_memory_saver
    with saver.region("w", enable_cpu_backup=True):
        w = _alloc(host, 8 * MiB, b"w")
    saver.pause()
    saver.resume()
    assert host.peek(w, 4096) == b"w" * 4096 and sleep.host_pool_stats()["bytes"] == 16 * MiB


@built
def test_tms_retain_cpu_backup_sets_the_flag_at_start():
    @isolated
    def body():
        _, module = _saver(TMS_RETAIN_CPU_BACKUP="1")
        assert module.torch_memory_saver.retain_cpu_backup is True

    body()


@built
@isolated
def test_mmap_backend_is_a_pageable_backup_and_the_variable_sets_the_default():
    host, module = _saver(TMS_INIT_CPU_BACKUP_BACKEND="mmap")
    saver = module.torch_memory_saver
    with saver.region("w", enable_cpu_backup=True):
        p = _alloc(host, 2 * MiB, b"m")
    with saver.region("w", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        q = _alloc(host, 2 * MiB, b"p")
    saver.pause("w")
    states = sleep.tag_states()
    assert states["w+cpu"]["backup"] == "cpu" and states["w+pinned"]["backup"] == "pinned", states
    saver.resume("w")
    assert host.peek(p, 4096) == b"m" * 4096 and host.peek(q, 4096) == b"p" * 4096


@built
@isolated
def test_pause_of_one_tag_leaves_another_and_untagged_memory():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("kv_cache"):  # the first use installs torch_budget
        _alloc(host, 4 * MiB, b"c")
    untagged = _alloc(host, MiB, b"u")
    with saver.region("weights", enable_cpu_backup=True):
        w = _alloc(host, 2 * MiB, b"w")
    saver.pause("kv_cache")
    states = sleep.tag_states()
    assert states["kv_cache"]["state"] == "released" and states["weights+pinned"]["state"] == "live", states
    assert host.peek(w, 4096) == b"w" * 4096
    saver.pause("weights")
    assert host.peek(untagged, 4096) == b"u" * 4096
    assert torch_budget.stats()["by_tag"]["untagged"]["allocated"] == MiB
    saver.resume("weights")
    assert host.peek(w, 4096) == b"w" * 4096 and sleep.tag_states()["kv_cache"]["state"] == "released"
    saver.resume()
    assert {s["state"] for s in sleep.tag_states().values()} == {"live"}


@built
@isolated
def test_nested_regions_take_the_innermost_tag_and_backup():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("model", enable_cpu_backup=True):
        weight = _alloc(host, 2 * MiB, b"w")
        with saver.region("grad_buffer", enable_cpu_backup=False):
            grad = _alloc(host, 2 * MiB, b"g")
        extra = _alloc(host, 2 * MiB, b"e")
    by_tag = torch_budget.stats()["by_tag"]
    assert by_tag["model+pinned"]["allocated"] == 4 * MiB and by_tag["grad_buffer"]["allocated"] == 2 * MiB
    saver.pause()
    saver.resume()
    assert host.peek(weight, 4096) == b"w" * 4096 and host.peek(extra, 4096) == b"e" * 4096
    assert host.peek(grad, 4096) != b"g" * 4096


@built
@isolated
def test_a_nested_region_without_a_backend_keeps_the_enclosing_one_as_torch_memory_saver_does():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("outer", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        with saver.region("mid"):  # no backup: the backend stays the outer region's
            with saver.region("inner", enable_cpu_backup=True):
                p = _alloc(host, 2 * MiB, b"i")
                assert saver._impl._binary_wrapper.cdll.tms_get_cpu_backup_backend() == b"mmap"
    with saver.region("inner", enable_cpu_backup=True):  # outside: TMS_INIT_CPU_BACKUP_BACKEND's default
        q = _alloc(host, 2 * MiB, b"q")
    by_tag = torch_budget.stats()["by_tag"]
    assert by_tag["inner+cpu"]["allocated"] == by_tag["inner+pinned"]["allocated"] == 2 * MiB, by_tag
    saver.pause("inner")
    assert sleep.tag_states()["inner+cpu"]["backup"] == "cpu"
    saver.resume("inner")
    assert host.peek(p, 4096) == b"i" * 4096 and host.peek(q, 4096) == b"q" * 4096


@built
@isolated
def test_disable_leaves_its_allocations_untagged_and_unpaused():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("train", enable_cpu_backup=True):
        _alloc(host, 2 * MiB, b"t")
        with saver.disable():
            scratch = _alloc(host, 4 * MiB, b"s")
            with pytest.raises(StateError, match="inside a region"):  # disable() of disable(), as in torch_memory_saver
                with saver.disable():
                    pass
            with saver.region("inner"):  # a region inside disable() tags again
                _alloc(host, MiB, b"i")
    by_tag = torch_budget.stats()["by_tag"]
    assert by_tag["untagged"]["allocated"] == 4 * MiB and by_tag["inner"]["allocated"] == MiB, by_tag
    saver.pause()
    assert host.peek(scratch, 4096) == b"s" * 4096
    saver.resume()
    with pytest.raises(StateError, match="inside a region"):
        with saver.disable():
            pass
@built
@isolated
def test_disable_gives_its_memory_back_also_when_its_body_raises():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("train"):
        with pytest.raises(RuntimeError, match="step failed"):
            with saver.disable():
                host.free(_alloc(host, 4 * MiB, b"s"))
                assert torch_budget.stats()["reserved"] >= 4 * MiB  # freed, still cached
                raise RuntimeError("step failed")
    assert torch_budget.stats()["reserved"] == 0


def _saver_capturing():
    """(host, saver) as _saver gives them, with torch.cuda.graph over the stand-in: the capture
    allocates from `pool` on stream S1 (torch's beginAllocateToPool), as on a device."""
    import torch

    host, module = _saver()

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        host.begin_pool(pool, S1)
        try:
            yield
        finally:
            host.end_pool(pool)

    torch.cuda.graph = graph
    return host, module.torch_memory_saver


@built
@isolated
def test_cuda_graph_into_a_pool_another_tag_created_raises_naming_the_pool_and_both_tags():
    import torch

    host, saver = _saver_capturing()
    shared = (0, 7)  # SGLang's one graph pool for every runner
    with saver.cuda_graph(object(), pool=shared, tag="cuda_graph"):
        host.malloc(8 * MiB, stream=S1)
    with saver.cuda_graph(object(), pool=shared, tag="cuda_graph"):  # the pool's own tag: fine
        host.malloc(2 * MiB, stream=S1)
    with pytest.raises(InvalidArgumentError, match=r"graph pool \(0, 7\) belongs to torch_budget tag 'cuda_graph' \("
                                                   r"torch_memory_saver tag 'cuda_graph', no backup\).*'graph2'"):
        with saver.cuda_graph(object(), pool=shared, tag="graph2"):
            pytest.fail("captured into another tag's pool")
    plain = (0, 8)
    with torch.cuda.graph(object(), pool=plain):  # torch.cuda.graph outside every region: an untagged pool
        host.malloc(MiB, stream=S1)
    with pytest.raises(InvalidArgumentError, match=r"graph pool \(0, 8\) is untagged.*'cuda_graph'"):
        with saver.cuda_graph(object(), pool=plain, tag="cuda_graph"):
            pass
    saver.pause("graph2")   # the refused capture registered nothing: a tag never used, nothing to do
    saver.pause()           # every tag (both raised "unknown tag 'graph2'" once the refusal had registered it)
    assert sleep.tag_states()["cuda_graph"]["state"] == "released" and torch_budget.stats()["reserved"] <= 2 * MiB
    saver.resume()


@built
@isolated
def test_a_stray_end_of_a_saver_scope_raises_and_changes_nothing():
    # contextlib ran the body of a scope ended without being entered: a disable() emptied the cache of every
    # device, a cuda_graph() began and ended a capture into its pool, a region() registered its pool; then
    # RuntimeError("generator didn't stop"). A second end passed silently.
    import torch

    host, saver = _saver_capturing()
    captures = []
    graph = torch.cuda.graph
    torch.cuda.graph = lambda *args, **kwargs: captures.append(args) or graph(*args, **kwargs)
    with saver.region("train"):
        host.free(_alloc(host, 4 * MiB, b"t"))  # freed, cached under "train"
        with pytest.raises(StateError, match=r"torch_memory_saver\.disable\(\) was never entered"):
            saver.disable().__exit__(None, None, None)
        assert torch_budget.stats()["reserved"] == 4 * MiB, "the stray end emptied the cache"
        with pytest.raises(StateError, match=r"torch_memory_saver\.cuda_graph\(tag='g'\) was never entered"):
            saver.cuda_graph(object(), pool=(0, 9), tag="g").__exit__(None, None, None)
        assert captures == [] and sleep.pool_tag((0, 9)) is None
        pools = dict(saver._impl._mem_pools)
        with pytest.raises(StateError, match=r"torch_memory_saver\.region\('w'\) was never entered"):
            saver.region("w", enable_cpu_backup=True).__exit__(None, None, None)
        assert saver._impl._mem_pools == pools
        assert saver._impl._binary_wrapper.cdll.tms_get_current_tag() == b"train"
        scope = saver.region("inner")
        with scope:
            with pytest.raises(StateError, match=r"region\('inner'\) is open already"):
                scope.__enter__()
            _alloc(host, MiB, b"i")
        with pytest.raises(StateError, match=r"region\('inner'\) has ended already"):
            scope.__exit__(None, None, None)
        assert saver._impl._binary_wrapper.cdll.tms_get_current_tag() == b"train"
        _alloc(host, 2 * MiB, b"t")
    by_tag = torch_budget.stats()["by_tag"]
    assert (by_tag["train"]["allocated"], by_tag["inner"]["allocated"]) == (2 * MiB, MiB), by_tag


def _saver_state(saver):
    """What torch_memory_saver's getters say on this thread, and whether disable() is refused here."""
    cdll = saver._impl._binary_wrapper.cdll
    said = (cdll.tms_get_interesting_region(), cdll.tms_get_current_tag(), cdll.tms_get_enable_cpu_backup())
    try:
        with saver.disable():
            return (*said, False)
    except StateError:
        return (*said, True)


OUTSIDE = (False, b"default", False, True)  # no region: nothing is the saver's, disable() refused


def _a_later_region_works(host, saver):
    with saver.region("later", enable_cpu_backup=True):
        assert _saver_state(saver) == (True, b"later", True, False)
        _alloc(host, MiB, b"l")
    assert _saver_state(saver) == OUTSIDE
    assert torch_budget.stats()["by_tag"]["later+pinned"]["allocated"] == MiB


@built
@isolated
def test_a_region_ended_before_one_opened_inside_it_is_refused_and_ends_after_it():
    # The saver's state popped the inner region's entry: inside it the getters said 'outer' (with its backup)
    # and, once both ended, the thread counted one region open for good (disable() allowed outside every region).
    host, module = _saver()
    saver = module.torch_memory_saver
    outer, inner = saver.region("outer", enable_cpu_backup=True), saver.region("inner")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(StateError, match=r"region\('outer\+pinned'\) is ended while region\('inner'\), opened inside"):
        outer.__exit__(None, None, None)
    assert _saver_state(saver) == (True, b"inner", False, False)  # still inside inner, and outer with it
    _alloc(host, 2 * MiB, b"i")
    inner.__exit__(None, None, None)  # outer ends with it
    assert _saver_state(saver) == OUTSIDE
    _alloc(host, 4 * MiB, b"u")
    by_tag = torch_budget.stats()["by_tag"]
    assert (by_tag["inner"]["allocated"], by_tag["outer+pinned"]["allocated"], by_tag["untagged"]["allocated"]) == (
        2 * MiB, 0, 4 * MiB), by_tag
    _a_later_region_works(host, saver)


@built
@isolated
def test_regions_of_interleaved_asyncio_tasks_leave_the_saver_outside_every_region():
    import asyncio

    host, module = _saver()
    saver = module.torch_memory_saver

    async def task(tag, delay):
        with saver.region(tag, enable_cpu_backup=True):
            await asyncio.sleep(delay)

    async def main():
        a = asyncio.create_task(task("a", 0.01))
        await asyncio.sleep(0)
        b = asyncio.create_task(task("b", 0.05))  # opens inside a's region, on the same thread
        await asyncio.sleep(0.03)
        inside_b = _saver_state(saver)  # a's end was refused: b is in force, a ends with it
        return inside_b, await asyncio.gather(a, b, return_exceptions=True)

    inside_b, outcome = asyncio.run(main())
    assert isinstance(outcome[0], StateError) and outcome[1] is None, outcome
    assert inside_b == (True, b"b", True, False)
    assert _saver_state(saver) == OUTSIDE
    _a_later_region_works(host, saver)


def _end_on_another_thread(scope, saver):
    """Ends `scope` on a new thread, which region() refuses (StateError); the saver's state that
    thread saw after the refusal."""
    import threading

    seen = []

    def end_it():
        with pytest.raises(StateError, match="did not open it"):
            scope.__exit__(None, None, None)
        seen.append(_saver_state(saver))

    other = threading.Thread(target=end_it)
    other.start()
    other.join()
    assert len(seen) == 1, "the end on the other thread was not refused"
    return seen[0]


@built
@isolated
def test_a_region_ended_on_another_thread_ends_when_its_own_thread_next_uses_one():
    # The other thread popped this thread's entry at once (the core kept charging the region's tag) and set its
    # own count of regions to this thread's: there disable() was allowed outside every region.
    host, module = _saver()
    saver = module.torch_memory_saver

    def open_two_and_end_the_inner_on_another_thread():
        outer, inner = saver.region("outer"), saver.region("a", enable_cpu_backup=True)
        outer.__enter__()
        inner.__enter__()
        assert _end_on_another_thread(inner, saver) == OUTSIDE
        return outer

    outer = open_two_and_end_the_inner_on_another_thread()
    cdll = saver._impl._binary_wrapper.cdll
    assert (cdll.tms_get_current_tag(), cdll.tms_get_enable_cpu_backup()) == (b"a", True)  # as the core: still in a
    _alloc(host, 2 * MiB, b"a")
    outer.__exit__(None, None, None)  # ends a, then outer
    assert _saver_state(saver) == OUTSIDE
    outer = open_two_and_end_the_inner_on_another_thread()
    with saver.disable():  # opening a scope ends a first, as opening a region() does
        pass
    assert _saver_state(saver) == (True, b"outer", False, False)
    outer.__exit__(None, None, None)
    assert _saver_state(saver) == OUTSIDE
    by_tag = torch_budget.stats()["by_tag"]
    assert (by_tag["a+pinned"]["allocated"], by_tag["outer"]["allocated"]) == (2 * MiB, 0), by_tag
    _a_later_region_works(host, saver)


@built
@isolated
def test_outside_every_region_but_one_ended_on_another_thread_disable_is_refused_and_a_flip_ends_it():
    host, module = _saver()
    saver = module.torch_memory_saver
    scope = saver.region("a")
    scope.__enter__()
    _end_on_another_thread(scope, saver)
    with pytest.raises(StateError, match="inside a region"):  # opening it would end a first
        with saver.disable():
            pass
    cdll = saver._impl._binary_wrapper.cdll
    assert cdll.tms_get_current_tag() == b"a"  # the refusal changed nothing: still in a, as the core
    _alloc(host, MiB, b"a")
    cdll.tms_set_interesting_region(False)  # a is what made it True: ending a is what sets it
    assert _saver_state(saver) == OUTSIDE
    _alloc(host, 2 * MiB, b"u")
    by_tag = torch_budget.stats()["by_tag"]
    assert (by_tag["a"]["allocated"], by_tag["untagged"]["allocated"]) == (MiB, 2 * MiB), by_tag
    _a_later_region_works(host, saver)


@built
@isolated
def test_a_flip_left_open_in_a_region_ended_out_of_order_goes_when_the_region_ends():
    # slime's tms_set_interesting_region(False) left on, then a region opened inside: the refused outer region
    # used to close the flip under the inner one, popping the inner one's entry.
    host, module = _saver()
    saver = module.torch_memory_saver
    outer, inner = saver.region("outer"), saver.region("inner")
    outer.__enter__()
    cdll = saver._impl._binary_wrapper.cdll
    cdll.tms_set_interesting_region(False)
    inner.__enter__()
    with pytest.raises(StateError, match="opened inside it"):
        outer.__exit__(None, None, None)
    assert _saver_state(saver) == (True, b"inner", False, False)
    inner.__exit__(None, None, None)
    assert _saver_state(saver) == OUTSIDE  # the flip went with outer, as outer's in-order end closes it
    _alloc(host, MiB, b"u")
    assert torch_budget.stats()["by_tag"]["untagged"]["allocated"] == MiB
    _a_later_region_works(host, saver)


@built
@isolated
def test_pause_and_resume_act_on_every_device():
    host, module = _saver(devices=2)
    saver = module.torch_memory_saver
    with saver.region("w", enable_cpu_backup=True):
        on0 = _alloc(host, 2 * MiB, b"0")
        host.set_current(1)
        on1 = _alloc(host, 2 * MiB, b"1", device=1)
    host.set_current(0)
    saver.pause("w")
    assert sleep.tag_states(0)["w+pinned"]["state"] == sleep.tag_states(1)["w+pinned"]["state"] == "released"
    saver.resume()
    assert host.peek(on0, 4096) == b"0" * 4096 and host.peek(on1, 4096) == b"1" * 4096


@built
@isolated
def test_pause_and_resume_in_the_wrong_state_raise_and_unknown_tags_are_nothing_to_do():
    host, module = _saver()
    saver = module.torch_memory_saver
    saver.pause("never_used")
    saver.resume("never_used")
    saver.resume()  # nothing paused
    with saver.region("kv"):
        _alloc(host, MiB, b"k")
    with pytest.raises(TagStateError, match="'kv' is not paused"):
        saver.resume("kv")
    saver.pause("kv")
    with pytest.raises(TagStateError, match="already paused"):
        saver.pause("kv")
    with pytest.raises(TagStateError, match="already paused"):
        saver.pause()
    saver.resume("kv")
    with pytest.raises(TypeError):
        saver.pause(5)


@built
@isolated
def test_a_tag_named_untagged_pauses_as_any_other_and_an_empty_tag_means_every_tag():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("untagged"):
        _alloc(host, 2 * MiB, b"u")
    with saver.region("untagged", enable_cpu_backup=True):
        kept = _alloc(host, 2 * MiB, b"k")
    with saver.region("kv"):
        _alloc(host, MiB, b"v")
    plain = _alloc(host, MiB, b"p")  # outside every region: torch_budget's untagged memory, never paused
    assert torch_budget.stats()["by_tag"]["untagged"]["allocated"] == MiB
    saver.pause("untagged")
    states = sleep.tag_states()
    assert states["tms_untagged"]["state"] == states["tms_untagged+pinned"]["state"] == "released", states
    assert states["kv"]["state"] == "live" and host.peek(plain, 4096) == b"p" * 4096
    saver.resume("untagged")
    assert host.peek(kept, 4096) == b"k" * 4096
    saver.pause("")  # every tag, as torch_memory_saver's library reads ""
    assert {s["state"] for name, s in sleep.tag_states().items() if name != "untagged"} == {"released"}
    saver.resume("")
    assert {s["state"] for s in sleep.tag_states().values()} == {"live"}
    assert host.peek(kept, 4096) == b"k" * 4096 and host.peek(plain, 4096) == b"p" * 4096
    with pytest.raises(InvalidArgumentError, match="'tms_untagged', which tag 'untagged' .* already uses"):
        with saver.region("tms_untagged"):
            pass


@built
@isolated
def test_disk_backups_spill_to_the_directory_and_come_back(tmp_path):
    host, module = _saver(TMS_DISK_BACKUP_DIR=str(tmp_path / "from-env"))
    saver = module.torch_memory_saver
    with saver.region(enable_disk_backup=True):
        kept = _alloc(host, 6 * MiB, b"d")
    with saver.region(enable_disk_backup=False):
        lost = _alloc(host, 2 * MiB, b"l")
    saver.pause()
    assert sleep.tag_states()["default+disk"]["backup"] == "disk"
    assert os.listdir(tmp_path / "from-env"), "TMS_DISK_BACKUP_DIR was not used"
    saver.resume()
    assert host.peek(kept, 4096) == b"d" * 4096 and host.peek(lost, 4096) != b"l" * 4096
    saver.set_disk_backup_dir(str(tmp_path / "set"))  # created, as torch_memory_saver does
    saver.pause()
    assert os.listdir(tmp_path / "set") and not os.listdir(tmp_path / "from-env")
    saver.resume()
    assert host.peek(kept, 4096) == b"d" * 4096 and not os.listdir(tmp_path / "set")
    with pytest.raises(InvalidArgumentError, match="mutually exclusive"):
        with saver.region(enable_cpu_backup=True, enable_disk_backup=True):
            pass


@built
@isolated
def test_what_torch_budget_cannot_honour_raises_unsupported():
    _, module = _saver()
    saver, Unsupported = module.torch_memory_saver, module.UnsupportedError
    assert issubclass(Unsupported, TorchBudgetError) and issubclass(Unsupported, NotImplementedError)
    with pytest.raises(Unsupported, match="set_budget"):
        saver.memory_margin_bytes = 1 << 30
    saver.memory_margin_bytes = 0  # no margin: what torch_memory_saver does by default
    with pytest.raises(Unsupported, match="_impl._hook_util"):
        saver._impl._hook_util  # noqa: B018  (its allocator hooks: torch_budget serves the memory itself)
    with pytest.raises(Unsupported, match="tms_pause"):
        saver._impl._binary_wrapper.cdll.tms_pause  # noqa: B018
    with open("/proc/self/maps") as maps:
        runtime = any(os.path.basename(line.split()[-1]).startswith("libcudart.so") for line in maps)
    if runtime:  # the CUDA runtime functions its library links, as ctypes finds them there
        assert callable(saver._impl._binary_wrapper.cdll.cudaGetLastError)
    else:
        with pytest.raises(Unsupported, match="cudaHostGetFlags: the CUDA runtime is not loaded"):
            saver._impl._binary_wrapper.cdll.cudaHostGetFlags  # noqa: B018


@built
@isolated
def test_the_c_library_getters_its_tests_read_follow_the_regions():
    # torch_memory_saver's nested_region example, over the adapter: TMS_INIT_ENABLE=1 with backups.
    host, saver = _init_enabled_saver()
    cdll = saver._impl._binary_wrapper.cdll
    state = lambda: (cdll.tms_get_interesting_region(), cdll.tms_get_current_tag(),  # noqa: E731
                     cdll.tms_get_enable_cpu_backup(), cdll.tms_get_cpu_backup_backend())
    assert state() == (True, b"default", True, b"pinned")
    with saver.region(tag="grad_buffer", enable_cpu_backup=False):
        assert state() == (True, b"grad_buffer", False, b"pinned")
        with saver.disable():
            assert not cdll.tms_get_interesting_region()
        with saver.region(enable_cpu_backup=True, cpu_backup_backend="mmap"):
            assert state() == (True, b"default", True, b"mmap")
        assert state() == (True, b"grad_buffer", False, b"pinned")
    assert state() == (True, b"default", True, b"pinned")
    with saver.region(enable_disk_backup=True):
        assert cdll.tms_get_enable_disk_backup() and not cdll.tms_get_enable_cpu_backup()
    assert not cdll.tms_get_retain_cpu_backup()
    saver.retain_cpu_backup = True
    assert cdll.tms_get_retain_cpu_backup()


@built
@isolated
def test_impl_is_none_until_first_use_and_tms_set_interesting_region_flips_this_threads_allocations():
    host, module = _saver()
    saver = module.torch_memory_saver
    assert saver._impl is None  # slime's DeepEP patch reads it so, before touching the library
    with saver.region("w", enable_cpu_backup=True):
        cdll = saver._impl._binary_wrapper.cdll
        kept = _alloc(host, 2 * MiB, b"w")
        cdll.tms_set_interesting_region(False)  # slime: deep_ep.Buffer's memory is not the saver's
        assert not cdll.tms_get_interesting_region()
        buffer = _alloc(host, 4 * MiB, b"d")
        cdll.tms_set_interesting_region(True)
        assert cdll.tms_get_interesting_region() and cdll.tms_get_current_tag() == b"w"
        more = _alloc(host, 2 * MiB, b"m")
        cdll.tms_set_interesting_region(False)  # left so: the region puts back on exit what it found
        _alloc(host, MiB, b"x")
    by_tag = torch_budget.stats()["by_tag"]
    assert by_tag["untagged"]["allocated"] == 5 * MiB and by_tag["w+pinned"]["allocated"] == 4 * MiB, by_tag
    assert not cdll.tms_get_interesting_region()
    cdll.tms_set_interesting_region(True)  # outside a region: under the thread's tag, "default"
    outside = _alloc(host, MiB, b"o")
    cdll.tms_set_interesting_region(False)
    assert torch_budget.stats()["by_tag"]["default"]["allocated"] == MiB
    saver.pause()
    assert host.peek(buffer, 4096) == b"d" * 4096
    assert sleep.tag_states()["default"]["state"] == "released"
    saver.resume()
    assert host.peek(kept, 4096) == b"w" * 4096 and host.peek(more, 4096) == b"m" * 4096
    assert host.peek(outside, 4096) is not None


@built
@isolated
def test_with_tms_init_enable_disable_works_outside_a_region():
    # torch_memory_saver's training_engine example: everything is the saver's from the start, so
    # disable() outside any region is what keeps a tensor out of the pause.
    host, saver = _init_enabled_saver()
    weights = _alloc(host, 4 * MiB, b"w")
    saver.pause()
    with saver.disable():
        kept = _alloc(host, 2 * MiB, b"k")  # allocatable while tag 'default' is paused: untagged
    saver.resume()
    assert host.peek(weights, 4096) == b"w" * 4096 and host.peek(kept, 4096) == b"k" * 4096


@built
@isolated
def test_bad_arguments_raise_before_anything_is_done():
    _, module = _saver()
    saver = module.torch_memory_saver
    with pytest.raises(ValueError, match="cpu_backup_backend requires enable_cpu_backup=True"):
        with saver.region(cpu_backup_backend="mmap"):
            pass
    with pytest.raises(InvalidArgumentError, match="unknown cpu_backup_backend 'disk'"):
        with saver.region(enable_cpu_backup=True, cpu_backup_backend="disk"):
            pass
    with pytest.raises(TypeError, match="enable_cpu_backup must be a bool"):
        with saver.region(enable_cpu_backup="yes"):
            pass
    with pytest.raises(TypeError, match="tag must be a str"):
        with saver.region(tag=None):
            pass
    with pytest.raises(InvalidArgumentError, match="memory_margin_bytes"):
        saver.memory_margin_bytes = -1
    with pytest.raises(InvalidArgumentError, match="unknown hook_mode 'ld'"):
        saver.hook_mode = "ld"
    assert not torch_budget.installed()  # nothing above got as far as installing
    saver.hook_mode = "torch"
    with saver.region("a", enable_cpu_backup=True):
        pass
    with pytest.raises(InvalidArgumentError, match="already uses"):
        with saver.region("a+pinned"):  # would be the torch_budget tag of ("a", pinned)
            pass
    saver.hook_mode = "torch"
    with pytest.raises(StateError, match="hook_mode cannot change after first use"):
        saver.hook_mode = "preload"


@built
@pytest.mark.parametrize("cpu_backup", ["1", "0"])
def test_tms_init_enable_puts_every_allocation_outside_a_region_under_default(cpu_backup):
    @isolated
    def body():
        host, module = _saver(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP=cpu_backup)
        saver = module.torch_memory_saver
        assert saver.retain_cpu_backup is False       # first use: installs, then the default tag
        outside = _alloc(host, 4 * MiB, b"o")         # no region: under tag "default"
        with saver.region("kv"):
            kv = _alloc(host, 2 * MiB, b"k")
        name = "default+pinned" if cpu_backup == "1" else "default"
        assert torch_budget.stats()["by_tag"][name]["allocated"] >= 4 * MiB
        saver.pause()
        assert sleep.tag_states()[name]["state"] == sleep.tag_states()["kv"]["state"] == "released"
        with saver.region("kv"):
            with saver.disable():
                free = _alloc(host, 2 * MiB, b"d")    # untagged inside disable(): not paused
        assert host.peek(free, 4096) == b"d" * 4096
        saver.resume()
        assert (host.peek(outside, 4096) == b"o" * 4096) == (cpu_backup == "1")
        assert host.peek(kv, 4096) is not None

    body()


@built
@isolated
def test_tms_init_enable_disk_backup_spills_what_is_outside_a_region_to_disk(tmp_path):
    host, module = _saver(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_DISK_BACKUP="1", TMS_DISK_BACKUP_DIR=str(tmp_path))
    saver = module.torch_memory_saver
    saver._ensure_initialized()
    outside = _alloc(host, 4 * MiB, b"o")  # no region: under tag "default", backed up to disk
    assert torch_budget.stats()["by_tag"]["default+disk"]["allocated"] >= 4 * MiB
    assert saver._impl._binary_wrapper.cdll.tms_get_enable_disk_backup()
    saver.pause()
    assert sleep.tag_states()["default+disk"]["backup"] == "disk" and os.listdir(tmp_path)
    saver.resume()
    assert host.peek(outside, 4096) == b"o" * 4096


@built
@isolated
def test_tms_init_enable_refuses_a_cpu_and_a_disk_backup_together():
    # torch_memory_saver exits at the first allocation outside a region: "mutually exclusive".
    _, module = _saver(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", TMS_INIT_ENABLE_DISK_BACKUP="1")
    with pytest.raises(InvalidArgumentError, match="TMS_INIT_ENABLE_CPU_BACKUP=1 and TMS_INIT_ENABLE_DISK_BACKUP=1 "
                                                   "are mutually exclusive"):
        module.torch_memory_saver.pause()


@built
def test_tms_variables_with_values_it_would_refuse_raise():
    @isolated
    def body():
        _, module = _saver(TMS_INIT_ENABLE="maybe")
        with pytest.raises(InvalidArgumentError, match="TMS_INIT_ENABLE"):
            module.torch_memory_saver.pause()

    body()


def test_configure_subprocess_is_a_context_that_changes_no_variable():
    # Imported in a child: on a machine with a free GPU the import installs torch_budget.
    @isolated
    def body():
        from torch_budget.adapters.torch_memory_saver import configure_subprocess

        before = dict(os.environ)
        with configure_subprocess():
            assert dict(os.environ) == before
        assert dict(os.environ) == before

    body()


# -- on a device: torch_memory_saver's own examples, written against the adapter

@pytest.mark.exclusive  # reads device-wide free memory
@gpu
def test_pause_gives_a_region_back_and_resume_keeps_its_address(fresh):
    fresh(pause_gives_a_region_back_and_resume_keeps_its_address)


def pause_gives_a_region_back_and_resume_keeps_its_address():
    from torch_budget.adapters.torch_memory_saver import torch_memory_saver  # installs torch_budget
    import torch

    torch_memory_saver.hook_mode = "torch"
    normal = torch.full((1_000_000,), 100, dtype=torch.uint8, device="cuda")  # CUDA starts before any region
    with torch_memory_saver.region():
        pauseable = torch.full((1 << 30,), 100, dtype=torch.uint8, device="cuda")
    address = pauseable.data_ptr()
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    torch_memory_saver.pause()
    paused = torch.cuda.mem_get_info()[0]
    assert paused - before > 0.9 * (1 << 30), (before, paused)
    torch_memory_saver.resume()
    assert paused - torch.cuda.mem_get_info()[0] > 0.9 * (1 << 30)
    assert pauseable.data_ptr() == address
    pauseable.fill_(7)
    assert int(pauseable[0]) == 7 and int(normal[0]) == 100


@gpu
def test_cpu_backup_keeps_contents_on_a_device(fresh):
    fresh(cpu_backup_keeps_contents_on_a_device)


def cpu_backup_keeps_contents_on_a_device():
    from torch_budget.adapters.torch_memory_saver import torch_memory_saver
    import torch

    with torch_memory_saver.region(enable_cpu_backup=True):
        with_backup = torch.full((20_000_000,), 10, dtype=torch.uint8, device="cuda")
        typed = torch.randn((10, 20, 30), dtype=torch.float32, device="cuda")
        expected = typed.cpu()
    with torch_memory_saver.region(enable_cpu_backup=False):
        without_backup = torch.full((20_000_000,), 20, dtype=torch.uint8, device="cuda")
    assert torch_memory_saver.get_cpu_backup(typed) is None  # live: no backup
    torch_memory_saver.pause()
    copied = torch_memory_saver.get_cpu_backup(typed)
    assert copied.dtype == torch.float32 and copied.shape == typed.shape and torch.equal(copied, expected)
    view = torch_memory_saver.get_cpu_backup(typed, zero_copy=True)
    assert torch.equal(view, expected) and view.is_pinned()  # the pinned backup itself
    assert torch_memory_saver.get_cpu_backup(without_backup) is None
    unrelated = torch.full((20_000_000,), 30, dtype=torch.uint8, device="cuda")  # takes some of the freed memory
    torch_memory_saver.resume()
    assert with_backup[:3].tolist() == [10, 10, 10] and torch.equal(typed.cpu(), expected)
    assert without_backup[:3].tolist() != [20, 20, 20]
    assert torch_memory_saver.get_cpu_backup(typed) is None
    assert torch.equal(view, expected), "the zero-copy view dangled after the resume"
    assert int(unrelated[0]) == 30


@gpu
def test_disk_backups_restore_bitwise_on_a_device(fresh):
    fresh(disk_backups_restore_bitwise_on_a_device)


def disk_backups_restore_bitwise_on_a_device():
    import tempfile

    from torch_budget.adapters.torch_memory_saver import torch_memory_saver
    import torch

    with tempfile.TemporaryDirectory() as d:
        torch_memory_saver.set_disk_backup_dir(d)
        with torch_memory_saver.region(enable_disk_backup=True):
            big = torch.randn((40 << 20) // 4 + 12345, device="cuda")  # several pieces, an odd tail
            small = torch.full((7,), 10, dtype=torch.uint8, device="cuda")
        oracle = big.cpu(), small.cpu()
        sizes = set()
        for _ in range(3):
            torch_memory_saver.pause()
            on_disk = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
            assert on_disk >= big.numel() * 4 and len(os.listdir(d)) >= 2
            sizes.add(on_disk)
            torch_memory_saver.resume()
            assert torch.equal(big.cpu(), oracle[0]) and torch.equal(small.cpu(), oracle[1])
            assert not os.listdir(d)
        assert len(sizes) == 1


@gpu
def test_zero_copy_backups_keep_their_address_while_retained_as_torch_memory_saver_does(fresh):
    fresh(zero_copy_backups_keep_their_address_while_retained)


def zero_copy_backups_keep_their_address_while_retained():
    from torch_budget.adapters.torch_memory_saver import torch_memory_saver
    import torch

    expected = torch.arange(3 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    with torch_memory_saver.region(tag="w", enable_cpu_backup=True):
        weights = expected.cuda()
    torch_memory_saver.pause("w")
    first = torch_memory_saver.get_cpu_backup(weights, zero_copy=True)
    address = first.data_ptr()
    assert torch.equal(first, expected)
    torch_memory_saver.retain_cpu_backup = True
    del first
    torch_memory_saver.resume("w")
    kept = torch_memory_saver.get_cpu_backup(weights, zero_copy=True)
    assert kept.data_ptr() == address and torch.equal(kept, expected) and torch.equal(weights.cpu(), expected)
    del kept
    changed = expected.flip(0).contiguous()
    weights.copy_(changed)
    torch_memory_saver.pause("w")  # retained: the same host memory takes the new contents
    again = torch_memory_saver.get_cpu_backup(weights, zero_copy=True)
    assert again.data_ptr() == address and torch.equal(again, changed)
    torch_memory_saver.retain_cpu_backup = False
    del again
    torch_memory_saver.resume("w")
    assert torch_memory_saver.get_cpu_backup(weights) is None and torch.equal(weights.cpu(), changed)


@pytest.mark.exclusive  # reads device-wide free memory
@gpu
def test_cuda_graph_memory_pauses_with_its_tag(fresh):
    fresh(cuda_graph_memory_pauses_with_its_tag)


def cuda_graph_memory_pauses_with_its_tag():
    from torch_budget.adapters.torch_memory_saver import torch_memory_saver
    import torch

    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.full((5, 25_000_000), 1.0, device="cuda")
    static_input = torch.zeros((5,), device="cuda")
    out = {}

    def step():
        big = torch.ones((250_000_000,), device="cuda") * (static_input + kv.mean(dim=1)).mean()
        out["y"] = big.mean()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch_memory_saver.cuda_graph(graph, tag="graph"):
        step()
    static_input[...] = 100
    graph.replay()
    assert float(out["y"]) == 101
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    torch_memory_saver.pause("kv_cache")
    after_kv = torch.cuda.mem_get_info()[0]
    assert after_kv - free > 400_000_000, (free, after_kv)
    torch_memory_saver.pause("graph")
    assert torch.cuda.mem_get_info()[0] - after_kv > 900_000_000  # the graph's 1 GB intermediate
    torch_memory_saver.resume("graph")
    torch_memory_saver.resume("kv_cache")
    kv[...] = 2
    static_input[...] = 200
    graph.replay()
    assert float(out["y"]) == 202


@pytest.mark.exclusive  # reads device-wide free memory
@gpu
def test_disable_runs_untagged_and_gives_its_memory_back(fresh):
    fresh(disable_runs_untagged_and_gives_its_memory_back)


def disable_runs_untagged_and_gives_its_memory_back():
    from torch_budget.adapters.torch_memory_saver import torch_memory_saver
    import torch

    with torch_memory_saver.region(enable_cpu_backup=True):
        weights = torch.full((1 << 28,), 42, dtype=torch.uint8, device="cuda")
    torch_memory_saver.pause()
    torch.cuda.synchronize()
    paused = torch.cuda.mem_get_info()[0]
    with torch_memory_saver.region(), torch_memory_saver.disable():
        scratch = torch.full((1 << 30,), 53, dtype=torch.uint8, device="cuda")
        assert scratch.float().mean().item() == 53
        del scratch
    assert paused - torch.cuda.mem_get_info()[0] <= 10 * (1 << 20)
    torch_memory_saver.resume()
    assert int(weights.min()) == int(weights.max()) == 42


@gpu
def test_cuda_started_natively_before_the_import_raises_install_error(fresh):
    fresh(cuda_started_natively_before_the_import_raises_install_error)


def cuda_started_natively_before_the_import_raises_install_error():
    import torch

    torch.zeros(1, device="cuda")  # torch's own allocator takes CUDA
    from torch_budget.adapters.torch_memory_saver import torch_memory_saver

    with pytest.raises(InstallError, match="before the first CUDA tensor"):
        with torch_memory_saver.region():
            pass



@built
@isolated
def test_pause_and_resume_before_any_allocation_do_nothing_as_in_torch_memory_saver():
    # SGLang pauses its tags whether or not anything was allocated under them; with nothing
    # allocated on any device, torch_memory_saver has nothing to walk.
    _, module = _saver(TMS_INIT_ENABLE="1")
    saver = module.torch_memory_saver
    with saver.region(tag="weights"):
        pass
    saver.pause()
    saver.pause("weights")
    saver.resume("weights")
    saver.resume()


@built
@isolated
def test_resume_maps_back_the_cache_a_tag_held_at_pause_without_copying_into_it():
    # torch_memory_saver maps back every segment torch's allocator held, used or not: its
    # training_engine example checks that the memory in use after resume is what it was before
    # pause, and that the next forward pass needs no more
    host, saver = _init_enabled_saver()
    w = _alloc(host, 4 * MiB, b"w")
    host.free(_alloc(host, 64 * MiB, b"a"))  # activations, freed into the cache
    before = host.device_used()
    saver.pause()
    assert host.device_used() == 0
    saver.resume()
    assert host.device_used() == before, "the cache is back"
    assert host.peek(w, 4096) == b"w" * 4096
    tag = torch_budget.stats()["by_tag"]["default+pinned"]  # TMS_INIT_ENABLE_CPU_BACKUP's tag
    assert tag["resident"] - tag["allocated"] >= 64 * MiB
    again = host.malloc(64 * MiB, stream=host.stream(0))
    assert host.device_used() == before, "the next pass finds its memory in the cache"
    host.free(again)


@built
@isolated
def test_pausing_a_graph_tag_again_and_again_holds_the_same_memory():
    # A graph pool's free blocks come back with the restore; they were counted as the tag's cache
    # and mapped a second time at each resume: 16, 24, 32 ... MiB with SGLang pausing every RL step.
    host, saver = _saver_capturing()
    with saver.cuda_graph(object(), pool=(0, 7), tag="cuda_graph"):
        scratch = host.malloc(8 * MiB, stream=S1)  # freed before the capture ends: the pool's
        out = host.malloc(8 * MiB, stream=S1)
        host.free(scratch)
    before = host.device_used()
    for _ in range(3):
        saver.pause("cuda_graph")
        saver.resume("cuda_graph")
        assert host.device_used() == before
    del out


@built
@isolated
def test_a_resume_under_a_tag_budget_regrows_no_cache_past_it_and_counts_no_oom():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("kv_cache"):
        _alloc(host, 4 * MiB, b"a")
        host.free(_alloc(host, 4 * MiB, b"c"))  # 4 MiB cached
    torch_budget.set_budget(("bytes", 6 * MiB), tag="kv_cache")
    saver.pause("kv_cache")
    saver.resume("kv_cache")
    assert torch_budget.stats()["raw"]["num_ooms"] == 0, "the regrow was refused as an out-of-memory error"


@built
@isolated
def test_a_pause_that_fails_drops_no_contents_of_a_tag_without_backup():
    # The groups without a backup went first: undone, they came back with their contents lost.
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("weights"):
        a = _alloc(host, 2 * MiB, b"A")
    with saver.region("weights", enable_cpu_backup=True):
        b = _alloc(host, 2 * MiB, b"B")
    host.fail("cuMemcpyDtoHAsync", nth=1)
    with pytest.raises(TorchBudgetError):
        saver.pause("weights")
    host.heal()
    assert not sleep.any_released()
    assert host.peek(a, 4096) == b"A" * 4096 and host.peek(b, 4096) == b"B" * 4096

@built
@isolated
def test_disk_backup_without_a_directory_goes_to_tmp_as_in_torch_memory_saver():
    host, module = _saver()          # no TMS_DISK_BACKUP_DIR, no set_disk_backup_dir: TMS uses /tmp
    saver = module.torch_memory_saver
    with saver.region(enable_disk_backup=True):
        p = _alloc(host, 4 * MiB, b"d")
    saver.pause()                    # it had raised InvalidArgumentError: no directory set
    saver.resume()
    assert host.peek(p, 4096) == b"d" * 4096


@built
@isolated
def test_a_resume_regrows_no_cache_past_the_tag_familys_budget():
    host, module = _saver()
    saver = module.torch_memory_saver
    with saver.region("kv", enable_cpu_backup=True):
        _alloc(host, 4 * MiB, b"s")                 # kv+pinned counts against kv's budget
    with saver.region("kv"):
        _alloc(host, 2 * MiB, b"a")
        host.free(_alloc(host, 4 * MiB, b"c"))
    torch_budget.set_budget(("bytes", 9 * MiB), tag="kv")
    saver.pause("kv")
    saver.resume("kv")
    assert torch_budget.stats()["raw"]["num_ooms"] == 0   # the regrow had asked past kv's budget


@built
@isolated
def test_private_stubs_answer_hasattr_and_getattr_default():
    _, module = _saver()
    saver = module.torch_memory_saver
    saver._ensure_initialized()
    assert not hasattr(saver._impl._binary_wrapper.cdll, "tms_xpu_prewarm_devices")
    assert getattr(saver._impl, "_is_xpu", False) is False
