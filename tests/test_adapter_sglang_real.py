"""The SGLang plugin against SGLang's own code, from a released wheel: its memory-saver adapter
module (sglang/srt/utils/torch_memory_saver_adapter.py), its memory tags (sglang/srt/constants.py)
and its plugin group (sglang/srt/plugins/__init__.py), from .stack_src/sglang-*/
(tools/fetch_stack_sources.py; CI fetches them, elsewhere these tests skip). The adapter module runs
as SGLang's source has it, with a stand-in only for the one helper it imports (is_xpu), over the
host core.
"""
import ast
import os
import runpy
import sys
import types

import pytest

import torch_budget
from _harness import REPO
from _hostcore import MiB, isolated
from test_adapter_sglang import ADAPTER, _alloc, _sglang, _states, check_the_noop_adapter_tags_nothing, sglang_stand_in

SOURCES = sorted((REPO / ".stack_src").glob("sglang-*"))
pytestmark = [pytest.mark.built("_host_core"),
              pytest.mark.skipif(not SOURCES, reason="no SGLang release sources (python tools/fetch_stack_sources.py)")]
RELEASES = [pytest.param(p, id=p.name) for p in SOURCES]


def _constants(path) -> dict:
    """The module-level constants a source file assigns (literals only), without importing it."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                if isinstance(node.value, ast.List):  # a list of names of constants
                    out[node.targets[0].id] = [out.get(e.id) for e in node.value.elts if isinstance(e, ast.Name)]
    return out


def _real_adapter_module(source):
    """SGLang's memory-saver adapter module, executed from its released source; torch_memory_saver is not
    installed, so SGLang records the ImportError, as it does in an environment without it."""
    common = types.ModuleType("sglang.srt.utils.common")
    common.is_xpu = lambda: False
    for package in ("sglang", "sglang.srt", "sglang.srt.utils"):
        sys.modules.setdefault(package, types.ModuleType(package)).__path__ = []
    sys.modules[common.__name__] = common
    return sglang_stand_in(ADAPTER, (source / "sglang/srt/utils/torch_memory_saver_adapter.py").read_text())


@pytest.mark.parametrize("source", RELEASES)
def test_the_plugin_group_and_the_tags_are_sglangs(source):
    group = _constants(source / "sglang/srt/plugins/__init__.py")["GENERAL_PLUGINS_GROUP"]
    setup_py = runpy.run_path(str(REPO / "setup.py"), run_name="setup_under_test")
    assert setup_py["ENTRY_POINTS"][group] == ["torch_budget = torch_budget.adapters.sglang:register"]
    tags = _constants(source / "sglang/srt/constants.py")["GPU_MEMORY_ALL_TYPES"]

    @isolated
    def body():
        _, module = _sglang()  # imported where torch sees no device: importing installs nothing
        assert sorted(tags) == sorted(module.TAGS)

    body()


@pytest.mark.parametrize("source", RELEASES)
def test_sglangs_adapter_module_releases_and_resumes_through_torch_budget(source):
    @isolated
    def body():
        adapter_module = _real_adapter_module(source)
        assert adapter_module.import_error is not None
        host, module = _sglang()
        module.register()
        assert torch_budget.installed() and adapter_module.import_error is None
        saver = adapter_module.TorchMemorySaverAdapter.create(enable=True)  # --enable-memory-saver
        assert saver.enabled and type(saver).__name__ == "_TorchMemorySaverAdapterReal"
        with saver.region("weights", enable_cpu_backup=True):  # --enable-weights-cpu-backup
            weights = _alloc(host, 4 * MiB, b"w")
        with saver.region("kv_cache"):
            kv = _alloc(host, 8 * MiB, b"k")
            with saver.disable():  # what SGLang allocates inside a region but must never release
                kept = _alloc(host, MiB, b"x")
        saver.pause("kv_cache")  # release_memory_occupation(tags=["kv_cache"])
        assert _states() == {"weights+pinned": ("live", None), "kv_cache": ("released", "none")}
        assert host.peek(kept, 4096) == b"x" * 4096
        saver.pause("weights")
        assert torch_budget.stats()["by_tag"]["weights+pinned"]["resident"] == 0
        saver.resume("weights")
        saver.resume("kv_cache")
        assert host.peek(weights, 4096) == b"w" * 4096 and host.peek(kv, 4096) != b"k" * 4096
        with saver.configure_subprocess():  # nothing to preload: every SGLang process loads the plugin
            assert "LD_PRELOAD" not in os.environ
        saver.check_validity("release_memory_occupation")

    body()


@pytest.mark.parametrize("source", RELEASES)
def test_without_enable_memory_saver_sglangs_noop_adapter_tags_nothing(source):
    isolated(lambda: check_the_noop_adapter_tags_nothing(_real_adapter_module(source)))()
