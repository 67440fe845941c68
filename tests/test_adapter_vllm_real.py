"""The vLLM adapter against vLLM's own sleep-mode code, from released wheels: the MemAllocator
protocol, SleepModeBackend, SleepModeBackendFactory and the default "cumem" backend of each
release in .stack_src/vllm-*/ (tools/fetch_stack_sources.py; CI fetches them, elsewhere these
tests skip). vLLM's package is loaded from those files, with stand-ins only for what they import
from the rest of vLLM (its logger, the platform, cumem's C extension), over the host core.

The calls are the ones vLLM's GPU worker makes (vllm/v1/worker/gpu_worker.py): 0.34's
sleep(level) -> backend.suspend(discardable), 0.33's -> backend.suspend(level), then
backend.resume(tags) and backend.discard(tags).
"""
import importlib
import inspect
import logging
import pathlib
import sys
import types

import pytest

from _harness import REPO
from _hostcore import MiB, isolated
from torch_budget import sleep
from test_adapter_vllm import _asleep, _served_like_vllm, _states, _vllm

SOURCES = sorted((REPO / ".stack_src").glob("vllm-*"), key=lambda p: tuple(int(x) for x in p.name[5:].split(".")))
pytestmark = [pytest.mark.built("_host_core"),
              pytest.mark.skipif(not SOURCES, reason="no vLLM release sources (python tools/fetch_stack_sources.py)")]
RELEASES = [pytest.param(p, id=p.name) for p in SOURCES]


def _version(source: pathlib.Path) -> tuple:
    return tuple(int(x) for x in source.name[5:].split("."))


def _load_vllm(source: pathlib.Path) -> types.SimpleNamespace:
    """vLLM's device_allocator package and its sleep_mode_backend module from `source`, with the
    cumem module replaced by a holder of CuMemAllocator's singleton slot (its real one needs vLLM's
    compiled allocator)."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    vllm = types.ModuleType("vllm")
    vllm.__path__ = [str(source / "vllm")]
    logger = types.ModuleType("vllm.logger")
    logger.init_logger = logging.getLogger
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cuda_alike=lambda: True, is_xpu=lambda: False,
                                                       is_rocm=lambda: False, is_cpu=lambda: False)
    sys.modules.update({"vllm": vllm, "vllm.logger": logger, "vllm.platforms": platforms})
    allocator = importlib.import_module("vllm.device_allocator")
    cumem = types.ModuleType("vllm.device_allocator.cumem")

    class CuMemAllocator:  # vLLM's slot and get_instance(), as the real class has them
        instance = None

        @staticmethod
        def get_instance():
            assert CuMemAllocator.instance is not None, "the plugin takes the slot before vLLM asks for it"
            return CuMemAllocator.instance

    cumem.CuMemAllocator = CuMemAllocator
    sys.modules[cumem.__name__] = cumem
    backends = importlib.import_module("vllm.device_allocator.sleep_mode_backend")
    return types.SimpleNamespace(allocator=allocator, backends=backends, cumem=cumem)


def _registered(source):
    """vLLM's modules from `source`, then the plugin registered over a fresh host core, as vLLM's
    load_general_plugins() runs it in a worker."""
    real = _load_vllm(source)
    host, module = _vllm(cuda=True)
    module.register()
    return real, host, module


def _parameters(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_sources_are_vllms():
    for source in SOURCES:
        text = (source / "vllm/device_allocator/sleep_mode_backend.py").read_text()
        assert "class SleepModeBackend(ABC)" in text and "class SleepModeBackendFactory" in text, source


@pytest.mark.parametrize("source", RELEASES)
def test_the_allocator_and_the_backend_have_every_method_of_vllms_with_its_parameters(source):
    @isolated
    def body():
        real = _load_vllm(source)
        _, module = _vllm()
        for name, fn in vars(real.allocator.MemAllocator).items():
            if name.startswith("_") or not callable(fn):
                continue
            assert _parameters(getattr(module.CuMemAllocator, name))[:len(_parameters(fn))] == _parameters(fn), name
        base = real.backends.SleepModeBackend
        for name, attr in vars(base).items():
            if name.startswith("_"):
                continue
            ours = inspect.getattr_static(module.TorchBudgetBackend, name, None)
            assert ours is not None, f"TorchBudgetBackend has no {name}, which vLLM's SleepModeBackend has"
            assert isinstance(ours, classmethod) == isinstance(attr, classmethod), name
            if name == "suspend" and _version(source) < (0, 34):
                continue  # 0.33's suspend(level=1): taken positionally or by keyword (the next tests)
            fn = attr.__func__ if isinstance(attr, classmethod) else attr
            mine = inspect.signature(ours.__func__ if isinstance(ours, classmethod) else ours).parameters.values()
            theirs = _parameters(fn)
            assert [(p.name, p.default) for p in mine][:len(theirs)] == theirs, name
            # anything beyond vLLM's parameters is a keyword-only one with a default: vLLM never passes it
            assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in list(mine)[len(theirs):]), name

    body()


@pytest.mark.parametrize("source", RELEASES)
def test_vllms_factory_creates_the_registered_backend_and_the_workers_calls_sleep_and_wake(source):
    @isolated
    def body():
        real, host, module = _registered(source)
        assert real.cumem.CuMemAllocator.instance is module.CuMemAllocator.get_instance()
        assert real.allocator.get_mem_allocator_instance() is module.CuMemAllocator.get_instance()
        factory = real.backends.SleepModeBackendFactory
        assert factory.get_backend_class("torch_budget") is module.TorchBudgetBackend
        backend = factory.create_backend(types.SimpleNamespace(sleep_mode_backend="torch_budget"))
        params, buffer, runtime = _served_like_vllm(host, module)
        level_2 = set(params) | {buffer} if _version(source) >= (0, 34) else 2
        level_1 = set() if _version(source) >= (0, 34) else 1
        backend.suspend(level_2)  # as the worker calls it
        assert backend.state() == "SUSPENDED"
        assert _states() == _asleep("none")
        backend.resume(["weights"])  # a selective wake: the KV cache waits, the rest comes back
        assert {t: s for t, (s, _) in _states().items()} == {"weights": "live", "runtime": "live",
                                                             "kv_cache": "released", "workspace": "live"}
        assert host.peek(runtime, 4096) == b"r" * 4096
        backend.resume(None)
        for p, fill in zip(params, (b"p", b"q")):  # vLLM reloads the weights after a level-2 wake
            assert host.poke(p, fill * 4096)
        backend.suspend(level_1)
        assert _states()["weights"] == ("released", "pinned")
        backend.resume(None)
        assert [host.peek(p, 4096) for p in params] == [b"p" * 4096, b"q" * 4096]
        backend.discard(("kv_cache",))
        assert _states()["kv_cache"] == ("released", "none") and backend.state() == "SUSPENDED"

    body()


@pytest.mark.parametrize("source", RELEASES)
def test_vllms_own_cumem_backend_sleeps_and_wakes_torch_budgets_allocator(source):
    # --enable-sleep-mode without --sleep-mode-backend: vLLM's default backend reaches the allocator
    # through get_mem_allocator_instance(), whose slot the plugin holds
    @isolated
    def body():
        real, host, module = _registered(source)
        backend = real.backends.SleepModeBackendFactory.create_backend(
            types.SimpleNamespace(sleep_mode_backend="cumem"))
        assert isinstance(backend, real.backends.CuMemBackend)
        params, buffer, runtime = _served_like_vllm(host, module)
        backend.suspend(set(params) if _version(source) >= (0, 34) else 1)
        # 0.34 with the parameters alone: the buffer beside them keeps its copy, the parameters go
        # without one (Note [Discardable blocks]); 0.33's level 1 copies all of the weights
        assert _states() == _asleep("pinned")
        copied = sleep.tag_states()["weights"]["backup_bytes"]
        assert copied == (2 * MiB if _version(source) >= (0, 34) else sleep.tag_states()["weights"]["released"])
        backend.resume(None)
        assert host.peek(buffer, 4096) == b"b" * 4096 and host.peek(runtime, 4096) == b"r" * 4096
        assert module.CuMemAllocator.get_instance().get_current_usage() >= 9 * MiB

    body()
