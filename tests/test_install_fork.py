"""install(start_driver=False) and the adapters' installs leave the CUDA driver to the first
allocation, so a process that installed can still fork children that use CUDA (Note [Installing
without the driver], csrc/bridge/torch_allocator.cpp). Each body runs in a fresh process."""
import pytest

gpu = pytest.mark.gpu


def driver_state():
    """cuDeviceGetCount's result in this process: 3 (CUDA_ERROR_NOT_INITIALIZED) until someone
    ran cuInit, 0 after; "no driver" where libcuda is not there."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no driver"
    count = ctypes.c_int(-1)
    return cuda.cuDeviceGetCount(ctypes.byref(count))


def forked_exit_code(check):
    """Forks; the child exits 0 when `check()` is true, 2 when false, 1 when it raises. Its exit code."""
    import os

    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = 0 if check() else 2
        finally:
            os._exit(status)
    _, code = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(code)


def computes_under_torch_budget(value):
    """A CUDA tensor of `value`s sums right, and torch_budget serves this process."""
    import torch

    import torch_budget

    return torch.full((1 << 20,), value, device="cuda").sum().item() == value * (1 << 20) and torch_budget.installed()


@pytest.mark.built("_C")
def test_the_deferred_install_hands_torch_the_allocator_without_starting_the_driver(fresh):
    state, installed = fresh(install_deferred_in_the_bridge).value
    assert installed == 1
    assert state in ("no driver", 3), f"cuDeviceGetCount returned {state}: the driver was started"


def install_deferred_in_the_bridge():
    from torch_budget import _runtime

    lib = _runtime.library()
    assert lib.tb_torch_install_deferred() == 0, lib.tb_last_error()
    return driver_state(), lib.tb_torch_installed()


@gpu
def test_install_without_the_driver_then_fork_serves_the_child_and_the_parent(fresh):
    out = fresh(install_then_fork).value
    assert out["before_fork"] == 3, out  # the probe itself is right: 0 once the driver started
    assert out["settings"] == (None, None), out
    assert out["child"] == 0, out
    assert out["parent"] is True and out["after"] == 0, out


def install_then_fork():
    import torch

    import torch_budget

    settings = torch_budget.install(start_driver=False)
    out = {"before_fork": driver_state(), "settings": (settings["route"], settings["capabilities"])}

    def child():
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        served = sum(t["allocated"] for t in torch_budget.stats(0)["by_tag"].values())
        return (x * 2).sum().item() == float((1 << 20) * ((1 << 20) - 1)) and served >= 4 << 20

    out["child"] = forked_exit_code(child)
    y = torch.ones(1 << 20, device="cuda")
    out["parent"] = bool(y.sum().item() == 1 << 20) and torch_budget.installed()
    out["after"] = driver_state()
    return out


@gpu
def test_the_vllm_plugin_in_a_parent_leaves_its_forked_worker_able_to_start_cuda(fresh):
    out = fresh(vllm_plugin_then_fork).value
    assert out == {"driver": 3, "child": 0}, out


def vllm_plugin_then_fork():
    from torch_budget.adapters import vllm

    vllm.register()  # vLLM's load_general_plugins, in the process that forks EngineCore
    out = {"driver": driver_state()}
    out["child"] = forked_exit_code(lambda: computes_under_torch_budget(3.0))
    return out


@gpu
def test_importing_the_torch_memory_saver_adapter_with_tms_init_enable_starts_no_driver(fresh):
    out = fresh(tms_import_then_fork).value
    assert out == {"driver": 3, "child": 0}, out


def tms_import_then_fork():
    import os

    os.environ["TMS_INIT_ENABLE"] = "1"
    from torch_budget.adapters import torch_memory_saver  # noqa: F401 - installs at import

    out = {"driver": driver_state()}
    out["child"] = forked_exit_code(lambda: computes_under_torch_budget(2.0))  # under tag 'default' (TMS_INIT_ENABLE)
    return out


@pytest.mark.built("_host_core")
def test_the_adapters_install_without_asking_torch_cuda_is_available():
    from _hostcore import Host, in_child, python_api_over

    def body():
        import torch

        import torch_budget
        from torch_budget import _runtime, allocator

        check = _runtime.check_can_install  # the real one, which python_api_over replaces
        python_api_over(Host(configure=False))
        _runtime.check_can_install = check

        def poisons():
            raise AssertionError("torch.cuda.is_available() runs cuInit: a child forked later could not start CUDA")

        torch.version.cuda = torch.version.cuda or "13.0"
        torch.cuda.is_available = poisons
        torch.cuda.device_count = lambda: 1  # what NVML counts
        from torch_budget.adapters import vllm  # installs at import, as the other adapters do

        vllm.register()  # vLLM's load_general_plugins in its parent process
        return torch_budget.installed(), allocator.install(start_driver=False)["capabilities"]

    assert in_child(body) == (True, None)
