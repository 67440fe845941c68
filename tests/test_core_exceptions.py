"""Note [An exception stops the process]: an exception thrown inside the core halfway through a
change (std::bad_alloc when host memory runs out) ends the process; it never reaches torch, which
would catch it and allocate on from pools, granule maps and a budget that disagree. A preloaded
operator new (csrc/testing/new_faults.cpp) fails the n-th allocation of one call, for every n the
call makes, each in a forked child: the call either finishes or the child stops on SIGABRT. Before
this, an allocation whose packing move failed left the packing flag set and a block counted live,
and every later free kept its memory. Creating a device is the one change an exception may leave
behind: the device is published only once whole, so the first allocation is refused as out of
memory and the next one serves."""
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(os.path.dirname(HERE), "csrc", "testing", "new_faults.cpp")

pytestmark = [pytest.mark.built("_host_core"),
              pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"),
                                 reason="needs g++ on Linux to build the failing operator new")]


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("new_faults") / "libnew_faults.so")
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", out, SOURCE], check=True)
    return out


def _setup(name, h):
    """The state before the call, and the call: ("malloc", size, stream) or ("free", ptr)."""
    from _hostcore import MiB, S1, S2, line_pressed

    if name == "device_creation":  # the first allocation creates the device, published only once whole
        return ("malloc", 4096, S1)
    if name == "packing_move":  # a 96 MiB request on another stream moves clean free memory
        line_pressed(h)
        return ("malloc", 96 * MiB, S2)
    h.malloc(4096, S1)  # the device exists (its creation changes no state before it is published)
    if name == "first_mapping":  # a new arena for large blocks and its first run mapping
        return ("malloc", 64 * MiB, S1)
    if name == "free_after_record_stream":  # the block waits on S2's event
        p = h.malloc(1 * MiB, S1)
        h.record_stream(p, S2)
        h.submit(S2)
        return ("free", p)
    raise ValueError(name)


def _core_defines_operator_new():
    """Whether the host core defines operator new itself (a Python whose extension flags link
    libstdc++ statically): its calls then bind inside it and a preloaded one never sees them."""
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(HERE), "torch_budget", "_host_core.*.so"))
    if not libs or shutil.which("nm") is None:
        return False
    symbols = subprocess.run(["nm", "-D", "--defined-only", libs[0]], capture_output=True, text=True, check=True)
    return any(line.split()[-1] == "_Znwm" for line in symbols.stdout.splitlines() if line.strip())


def _sweep(name, limit=400):
    """In the preloaded process: for n = 1, 2, ... a forked child sets up `name`, fails the
    call's n-th allocation and reports; stops at the first n the call never reaches."""
    from _hostcore import GiB, Host

    faults = ctypes.CDLL(None)
    outcomes = []
    for n in range(1, limit):
        pid = os.fork()
        if pid == 0:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)  # std::terminate's line, once per child
            h = Host(capacity=16 * GiB, route="vmm", packing_time=1.0)
            call = _setup(name, h)
            out = ctypes.c_void_p()
            faults.tb_new_faults_arm(n)
            if call[0] == "malloc":
                threw = faults.tb_new_faults_malloc(ctypes.cast(h.lib.tb_malloc, ctypes.c_void_p), ctypes.c_long(call[1]),
                                                   0, ctypes.c_void_p(call[2]), ctypes.byref(out))
            else:
                threw = faults.tb_new_faults_free(ctypes.cast(h.lib.tb_free, ctypes.c_void_p), ctypes.c_void_p(call[1]))
            reached = faults.tb_new_faults_left() == 0
            faults.tb_new_faults_arm(0)
            if threw or not reached:
                os._exit(3 if threw else 10)
            if call[0] == "malloc" and not out.value:  # refused: it must say so and have changed nothing
                said_oom = h.lib.tb_last_error_code() == 2
                again = h.lib.tb_malloc(call[1], 0, ctypes.c_void_p(call[2]))
                os._exit(5 if said_oom and again else 6)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            outcomes.append(signal.Signals(os.WTERMSIG(status)).name)
        else:
            code = os.WEXITSTATUS(status)
            if code == 10:
                break
            outcomes.append({0: "finished", 3: "exception reached the caller", 5: "refused, then served",
                             6: "refused, then refused again"}.get(code, f"exit {code}"))
    return outcomes


@pytest.mark.parametrize("name", ["device_creation", "packing_move", "first_mapping", "free_after_record_stream"])
def test_an_allocation_failing_inside_the_core_stops_the_process_never_reaches_the_caller(shim, name):
    if _core_defines_operator_new():
        pytest.skip("this build of the host core carries its own operator new (libstdc++ linked statically): "
                    "a preloaded one cannot fail its allocations")
    env = dict(os.environ, LD_PRELOAD=shim, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE)]))
    run = subprocess.run([sys.executable, __file__, name], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    outcomes = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcomes, "the call allocated nothing: the sweep tested nothing"
    assert "exception reached the caller" not in outcomes, outcomes
    assert set(outcomes) <= {"SIGABRT", "finished", "refused, then served"}, outcomes
    assert "SIGABRT" in outcomes, outcomes
    if name == "device_creation":  # creation changed nothing: the caller is told, and may go on
        assert "refused, then served" in outcomes, outcomes


if __name__ == "__main__":
    print(json.dumps(_sweep(sys.argv[1])))
