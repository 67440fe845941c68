"""SGLang's memory saver over torch_budget (torch_budget.adapters.sglang).

The CPU tests run the plugin over the host stand-in in a forked child (_hostcore.python_api_over),
with a stand-in of SGLang's memory-saver adapter module: it reads torch_memory_saver by the names
SGLang's does (the module `torch_memory_saver`, its singleton `_memory_saver`, `import_error`). The GPU
tests run SGLang's release and resume of weights, KV cache and CUDA graphs in fresh processes. Nothing
here imports the adapter at the top level: importing it installs torch_budget when a CUDA device is free.
"""
import os
import runpy
import sys
import types

import pytest

import torch_budget
from _harness import REPO
from _hostcore import MiB, Host, isolated, python_api_over, sees_cuda
from torch_budget import sleep
from torch_budget.errors import InstallError

built = pytest.mark.built("_host_core")
gpu = pytest.mark.gpu

ADAPTER = "sglang.srt.utils.torch_memory_saver_adapter"
OLD_ADAPTER = "sglang.srt.torch_memory_saver_adapter"

# What SGLang's memory-saver adapter module does with torch_memory_saver, in the fewest lines.
STAND_IN = '''
import contextlib

try:
    import torch_memory_saver
    _memory_saver = torch_memory_saver.torch_memory_saver
    import_error = None
except ImportError as e:
    import_error = e


class TorchMemorySaverAdapter:
    @staticmethod
    def create(enable):
        if enable and import_error is not None:
            raise import_error
        return Real() if enable else Noop()


class Real(TorchMemorySaverAdapter):
    def configure_subprocess(self):
        return torch_memory_saver.configure_subprocess()

    def region(self, tag, enable_cpu_backup=False):
        return _memory_saver.region(tag=tag, enable_cpu_backup=enable_cpu_backup)

    def cuda_graph(self, **kwargs):
        return _memory_saver.cuda_graph(**kwargs)

    def pause(self, tag):
        return _memory_saver.pause(tag=tag)

    def resume(self, tag):
        return _memory_saver.resume(tag=tag)

    @property
    def enabled(self):
        return _memory_saver is not None and _memory_saver.enabled


class Noop(TorchMemorySaverAdapter):
    def region(self, tag, enable_cpu_backup=False):
        return contextlib.nullcontext()

    def pause(self, tag):
        pass

    def resume(self, tag):
        pass

    enabled = False
'''


def sglang_stand_in(name=ADAPTER, source=STAND_IN, real_saver=False):
    """Puts packages sglang, sglang.srt(.utils) and the adapter module `name` (made from `source`) in
    sys.modules; with `real_saver`, a module `torch_memory_saver` stands for the real package."""
    if real_saver:
        real = types.ModuleType("torch_memory_saver")
        real.torch_memory_saver = types.SimpleNamespace(enabled=True, region=None)
        real.configure_subprocess = lambda: "real LD_PRELOAD"
        sys.modules["torch_memory_saver"] = real
    for package in ("sglang", "sglang.srt", "sglang.srt.utils"):
        module = sys.modules.setdefault(package, types.ModuleType(package))
        module.__path__ = []
    adapter = types.ModuleType(name)
    exec(compile(source, name, "exec"), adapter.__dict__)
    sys.modules[name] = adapter
    return adapter


def _sglang(cuda=True):
    """The plugin over a fresh host core, imported while torch sees no CUDA device (so the import
    installs nothing, on any machine); afterwards torch sees one when `cuda` (the plugin acts only then)."""
    sees_cuda(False)
    host = Host(configure=False)
    python_api_over(host)
    from torch_budget.adapters import sglang as module

    sees_cuda(cuda)
    return host, module


def _alloc(host, nbytes, fill):
    p = host.malloc(nbytes, stream=host.stream(0))
    assert host.poke(p, fill * 4096)
    return p


def _states():
    return {tag: (s["state"], s["backup"]) for tag, s in sleep.tag_states().items() if tag != "untagged"}


@built
@isolated
def test_setup_declares_the_plugin_entry_point():
    setup_py = runpy.run_path(str(REPO / "setup.py"), run_name="setup_under_test")
    declared = setup_py["ENTRY_POINTS"]["sglang.srt.plugins"]
    assert declared == ["torch_budget = torch_budget.adapters.sglang:register"]
    _, module = _sglang()
    assert declared[0].split(" = ")[1] == f"{module.__name__}:{module.register.__name__}"
    assert module.TAGS == ("weights", "kv_cache", "cuda_graph")


@built
@isolated
def test_sglangs_memory_saver_releases_and_resumes_through_torch_budget():
    adapter_module = sglang_stand_in()  # torch_memory_saver is not installed: SGLang recorded the ImportError
    host, module = _sglang()
    module.register()
    assert torch_budget.installed()
    saver = adapter_module.TorchMemorySaverAdapter.create(enable=True)  # --enable-memory-saver
    assert saver.enabled
    with saver.region("weights", enable_cpu_backup=True):  # --enable-weights-cpu-backup
        weights = _alloc(host, 4 * MiB, b"w")
    with saver.region("kv_cache"):
        kv = _alloc(host, 8 * MiB, b"k")
    saver.pause("kv_cache")  # release_memory_occupation(tags=["kv_cache"])
    assert _states() == {"weights+pinned": ("live", None), "kv_cache": ("released", "none")}
    saver.pause("weights")
    assert torch_budget.stats()["reserved"] == 0
    saver.resume("weights")
    saver.resume("kv_cache")
    assert host.peek(weights, 4096) == b"w" * 4096 and host.peek(kv, 4096) != b"k" * 4096
    with saver.configure_subprocess():
        assert "LD_PRELOAD" not in os.environ


@built
@isolated
def test_weights_without_the_cpu_backup_flag_are_not_kept():
    adapter_module = sglang_stand_in(real_saver=True)  # the real torch_memory_saver is installed too
    host, module = _sglang()
    module.register()
    saver = adapter_module.TorchMemorySaverAdapter.create(enable=True)
    with saver.configure_subprocess():  # not the real package's LD_PRELOAD
        pass
    with saver.region("weights"):  # without --enable-weights-cpu-backup
        weights = _alloc(host, 4 * MiB, b"w")
    saver.pause("weights")
    assert _states() == {"weights": ("released", "none")}
    saver.resume("weights")
    assert host.peek(weights, 4096) != b"w" * 4096


def check_the_noop_adapter_tags_nothing(adapter_module):
    """Without --enable-memory-saver SGLang's no-op adapter serves: nothing is tagged or released."""
    host, module = _sglang()
    module.register()
    saver = adapter_module.TorchMemorySaverAdapter.create(enable=False)
    assert not saver.enabled
    with saver.region("weights", enable_cpu_backup=True):
        _alloc(host, 2 * MiB, b"w")
    saver.pause("weights")
    assert _states() == {} and torch_budget.stats()["by_tag"]["untagged"]["allocated"] == 2 * MiB


@built
@isolated
def test_without_enable_memory_saver_nothing_is_tagged():
    check_the_noop_adapter_tags_nothing(sglang_stand_in())


@built
@isolated
def test_the_older_adapter_module_is_pointed_too():
    adapter_module = sglang_stand_in(name=OLD_ADAPTER)
    host, module = _sglang()
    module.register()
    saver = adapter_module.TorchMemorySaverAdapter.create(enable=True)
    with saver.region("kv_cache"):
        _alloc(host, MiB, b"k")
    saver.pause("kv_cache")
    assert _states() == {"kv_cache": ("released", "none")}
    module.register()  # twice: harmless
    saver.resume("kv_cache")


@built
@isolated
def test_an_sglang_without_a_memory_saver_adapter_still_gets_torch_budget():
    for package in ("sglang", "sglang.srt", "sglang.srt.utils"):
        sys.modules[package] = types.ModuleType(package)
        sys.modules[package].__path__ = []
    _, module = _sglang()
    module.register()
    assert torch_budget.installed()


@built
@isolated
def test_what_cannot_be_honoured_raises_unsupported():
    sglang_stand_in(source="class TorchMemorySaverAdapter:\n    pass\n")  # reads torch_memory_saver otherwise
    _, module = _sglang()
    with pytest.raises(module.UnsupportedError, match="cannot be pointed at torch_budget"):
        module.register()
    sglang_stand_in()
    os.environ["LD_PRELOAD"] = "/usr/lib/libfoo.so:/site-packages/torch_memory_saver_hook_mode_preload.abi3.so"
    with pytest.raises(module.UnsupportedError, match="LD_PRELOAD holds torch_memory_saver's hook"):
        module.register()
    os.environ["LD_PRELOAD"] = "/usr/lib/libfoo.so"
    module.register()


@built
@isolated
def test_where_cuda_started_natively_the_plugin_and_the_first_region_say_so():
    from torch_budget import _runtime

    adapter_module = sglang_stand_in()
    _, module = _sglang()

    def started():
        raise InstallError("torch's CUDA allocator is already initialised")

    _runtime.check_can_install = started
    with pytest.raises(InstallError, match="SGLANG_PLUGINS") as raised:
        module.register()
    assert "already initialised" in str(raised.value)
    saver = adapter_module.TorchMemorySaverAdapter.create(enable=True)  # SGLang logged the error and went on
    with pytest.raises(InstallError, match="before the first CUDA tensor"):
        with saver.region("weights"):
            pass


@built
@isolated
def test_without_a_cuda_device_the_plugin_does_nothing():
    adapter_module = sglang_stand_in()
    _, module = _sglang(cuda=False)
    module.register()
    assert not torch_budget.installed() and adapter_module.import_error is not None


# -- on a device: SGLang's release_memory_occupation and resume_memory_occupation

@pytest.mark.exclusive  # reads device-wide free memory
@gpu
def test_weights_kv_cache_and_cuda_graph_are_released_and_resumed(fresh):
    fresh(weights_kv_cache_and_cuda_graph_are_released_and_resumed)


def weights_kv_cache_and_cuda_graph_are_released_and_resumed():
    import torch

    adapter_module = sglang_stand_in()
    from torch_budget.adapters import sglang

    sglang.register()  # SGLang's load_plugins(), first in the scheduler process
    assert torch_budget.installed()
    saver = adapter_module.TorchMemorySaverAdapter.create(enable=True)
    with saver.region("weights", enable_cpu_backup=True):
        weights = torch.randn(64 << 20, device="cuda")  # 256 MiB
    with saver.region("kv_cache"):
        kv = torch.zeros(128 << 20, device="cuda")  # 512 MiB
    static_input = torch.zeros(4, device="cuda")
    out = {}

    def step():
        scratch = torch.ones(64 << 20, device="cuda") * (static_input.sum() + weights[0])  # 256 MiB in the pool
        out["y"] = scratch.mean()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(cuda_graph=graph, tag="cuda_graph"):  # SGLANG_MEMORY_SAVER_CUDA_GRAPH=1
        step()
    static_input.fill_(1.0)
    graph.replay()
    expected, first = weights.cpu(), float(out["y"])
    assert first == pytest.approx(4.0 + float(weights[0]), rel=1e-5, abs=1e-5)
    torch.cuda.synchronize()
    freed = {}
    for tag, size in (("kv_cache", 512 << 20), ("weights", 256 << 20), ("cuda_graph", 256 << 20)):
        before = torch.cuda.mem_get_info()[0]
        saver.pause(tag)
        freed[tag] = torch.cuda.mem_get_info()[0] - before
        assert freed[tag] > 0.95 * size, (tag, freed)
    for tag in ("cuda_graph", "weights", "kv_cache"):
        saver.resume(tag)
    assert torch.equal(weights.cpu(), expected)
    kv.fill_(1.0)
    graph.replay()
    assert float(out["y"]) == pytest.approx(first, rel=1e-5, abs=1e-5)
    assert bool((kv == 1.0).all())


@gpu
def test_a_region_after_cuda_started_natively_raises(fresh):
    fresh(a_region_after_cuda_started_natively_raises)


def a_region_after_cuda_started_natively_raises():
    import torch

    torch.zeros(1, device="cuda")  # torch's own allocator takes CUDA
    adapter_module = sglang_stand_in()
    from torch_budget.adapters import sglang

    with pytest.raises(InstallError, match="SGLANG_PLUGINS"):
        sglang.register()
    with pytest.raises(InstallError, match="before the first CUDA tensor"):
        with adapter_module.TorchMemorySaverAdapter.create(enable=True).region("weights"):
            pass
