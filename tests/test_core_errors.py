"""torch_budget.errors: one root, each class also the builtin it replaced, and the core's error
codes arriving as the tree's classes (over the host stand-in)."""
import pytest

import torch_budget
from _hostcore import MiB, Host, isolated
from torch_budget import _native, errors
from torch_budget.errors import InvalidArgumentError, StateError, TagStateError, TorchBudgetError

BUILTINS = {"InvalidArgumentError": ValueError, "ConfigError": ValueError, "NotWarmedUpError": ValueError,
            "PlanDoesNotFitError": ValueError, "RequestTooLargeError": ValueError,
            "NotInstalledError": RuntimeError, "InstallError": RuntimeError, "StateError": RuntimeError,
            "TagStateError": RuntimeError, "PoolInUseError": RuntimeError, "PoolReleasedError": RuntimeError,
            "DriverError": RuntimeError, "BackupFileError": OSError, "StaticBufferRebindError": TypeError,
            "NotBuiltError": ImportError,
            "UnsupportedError": NotImplementedError}


def test_every_exception_has_the_root_and_the_builtin_it_replaces():
    assert set(errors.__all__) == set(BUILTINS) | {"TorchBudgetError"}
    for name, builtin in BUILTINS.items():
        cls = getattr(errors, name)
        assert issubclass(cls, TorchBudgetError) and issubclass(cls, builtin), name
    assert issubclass(TagStateError, StateError) and issubclass(errors.ConfigError, InvalidArgumentError)
    assert not issubclass(TorchBudgetError, (RuntimeError, ValueError, TypeError))


def test_the_graph_and_workspace_errors_are_the_trees():
    from torch_budget import eager_workspace, graphs

    assert graphs.PoolInUseError is errors.PoolInUseError and graphs.PoolReleasedError is errors.PoolReleasedError
    assert graphs.StaticBufferRebindError is errors.StaticBufferRebindError
    with pytest.raises(errors.NotWarmedUpError):
        eager_workspace.WorkspaceMetadata("cpu").get(MiB)


def test_the_top_level_exports_the_whole_tree():
    for name in errors.__all__:
        assert getattr(torch_budget, name) is getattr(errors, name) and name in torch_budget.__all__, name


@pytest.mark.built("_host_core")
@isolated
def test_core_error_codes_arrive_as_the_trees_classes():
    host = Host(route="vmm")
    lib = host.lib
    with pytest.raises(InvalidArgumentError, match="not allocated by torch_budget"):
        _native.check(lib, lib.tb_free_checked(0x1234))
    with pytest.raises(StateError, match="empty route/tag scope"):
        _native.check(lib, lib.tb_pop_scope())
    host.push("vmm", "w")
    host.malloc(MiB)
    host.pop()
    host.release("w")
    with pytest.raises(TagStateError, match="already released"):
        _native.check(lib, lib.tb_release_tag(0, host.tag("w"), 0), state=TagStateError)


@isolated  # importing an adapter installs torch_budget where a device is there: not in the pytest process
def test_every_adapter_raises_the_one_unsupported_error():
    import importlib

    for name in ("torch_memory_saver", "vllm", "tensorrt_llm", "sglang"):
        module = importlib.import_module(f"torch_budget.adapters.{name}")
        assert module.UnsupportedError is errors.UnsupportedError, name
