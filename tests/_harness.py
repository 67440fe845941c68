"""Running test bodies in fresh processes: one process, or several ranks of a process group.

Tests that swap torch's allocator or capture graphs need a process of their own; tests of
rank agreement need several. A body is a module-level function of a test module, named
like its test without the `test_`:

    def test_every_route_serves_torch(fresh):
        out = fresh(every_route_serves_torch, "vmm")   # the child's stdout; out.value: what it returned

    def every_route_serves_torch(route):
        ...

The child imports the body's module from its file (pytest does not run there, so the
module's top level must not touch CUDA: install() has to precede the first CUDA allocation),
calls the body with the arguments (pickled) and sends its return value back (pickled). A body
that raises fails the test with the child's traceback, which points into the test module.

Children run under `-X faulthandler`, find this checkout's package first (PYTHONPATH) and
this folder's modules by name (the test modules' helpers import so, as under pytest). Ranks
meet through a file in a fresh temporary directory, so no TCP port can be taken by someone
else between choosing it and binding it. A code string runs as a script (`python -c`), for
code that is text by nature, such as the README's snippets.
"""
import contextlib
import importlib.util
import inspect
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def load_tool(name: str):
    """tools/<name>.py imported as module <name> (registered in sys.modules: a tool's dataclasses
    look their module up), so tests call its functions and stand in for its GPU children."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules[name] = tool
    spec.loader.exec_module(tool)
    return tool

# The child's script: find this module, then let it import and call the body.
_CHILD = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import _harness; _harness._child(*sys.argv[1:])"


class Output(str):
    """A child's stdout. `value` is what its body returned: None for a code string, or for a
    body that ended the process itself (sys.exit(0)); `stderr` is its standard error, for a
    body that reports a failure by what it returns."""

    value = None
    stderr = ""

    def both(self) -> str:
        """stdout and stderr together, for an assertion's message."""
        return _both(self, self.stderr)


def _both(stdout: str, stderr: str) -> str:
    return f"--- stdout\n{stdout}\n--- stderr\n{stderr}"


def repo_env(extra=None) -> dict:
    """The environment for a child process: this checkout first on PYTHONPATH, plus `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def _fail(what, proc_or_outputs):
    pytest.fail(f"{what}\n{proc_or_outputs}", pytrace=False)


def _last_line(stderr: str) -> str:
    """The child's last word (an exception's type and message, mostly), for the failure's headline."""
    lines = stderr.strip().splitlines()
    return f": {lines[-1].strip()[:200]}" if lines else ""


def _name(body) -> str:
    return body.strip().splitlines()[0] if isinstance(body, str) else f"{body.__module__}.{body.__qualname__}"


def _command(body, args, tmp: str, key: str):
    """The child's command line for `body` called with `args` (a code string: `args` are its
    sys.argv[1:]), and the file its return value comes back in (None for a code string)."""
    if isinstance(body, str):
        return [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(body), *map(str, args)], None
    module = sys.modules.get(getattr(body, "__module__", None))
    path = getattr(module, "__file__", None)
    if not inspect.isfunction(body) or "<" in body.__qualname__ or path is None:
        raise TypeError(f"{body!r} is not a module-level function of a test module: the child imports it "
                        "from its module's file by name")
    call, result = os.path.join(tmp, key + ".call"), os.path.join(tmp, key + ".result")
    with open(call, "wb") as f:
        pickle.dump(tuple(args), f)
    return [sys.executable, "-X", "faulthandler", "-c", _CHILD, body.__module__, path, body.__qualname__,
            call, result], result


def _child(module_name, path, qualname, call, result):
    """In the child: import the body's module from `path` as `module_name` (the name pytest
    gave it, so pickles of its functions resolve), call the body, pickle what it returns."""
    sys.argv[1:] = []                        # the body sees what a script without arguments sees
    if os.environ.get("TORCH_BUDGET_GRAPH_HISTORY"):  # torch's stray-block error in a graph pool then
        import torch._inductor.config                # names the stack that allocated the block
        torch._inductor.config.triton.cudagraph_trees_history_recording = True
    if os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    body = module
    for part in qualname.split("."):
        body = getattr(body, part)
    with open(call, "rb") as f:
        args = pickle.load(f)
    try:
        value = body(*args)
    except Exception as exc:
        # From the body's frame on: this function's frame says nothing about the failure.
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.exit(1)
    try:
        data = pickle.dumps(value)
    except Exception as exc:
        raise TypeError(f"{qualname} returned a {type(value).__name__}, which does not pickle") from exc
    with open(result, "wb") as f:
        f.write(data)


def _run(children, timeout: float, tmp: str) -> tuple:
    """Starts each (command, env) child, waits for all of them until `timeout` seconds have
    passed (then kills the rest) and returns ([(returncode, stdout, stderr)], timed_out).
    Output goes to files, not pipes, so a grandchild that holds them open cannot stall the wait."""
    with contextlib.ExitStack() as files:
        procs, streams = [], []
        try:
            for i, (command, env) in enumerate(children):
                out, err = (files.enter_context(open(os.path.join(tmp, f"{i}.{name}"), "w+", errors="replace"))
                            for name in ("stdout", "stderr"))
                streams.append((out, err))
                procs.append(subprocess.Popen(command, stdout=out, stderr=err, env=env))
            deadline = time.monotonic() + timeout
            timed_out = False
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        outputs = []
        for proc, (out, err) in zip(procs, streams):
            out.seek(0)
            err.seek(0)
            outputs.append((proc.returncode, out.read(), err.read()))
        return outputs, timed_out


def _output(stdout: str, result, stderr: str = "") -> Output:
    out = Output(stdout)
    out.stderr = stderr
    if result is not None and os.path.exists(result):
        with open(result, "rb") as f:
            out.value = pickle.load(f)
    return out


def run_fresh(body, *args, timeout: float = 300, env=None) -> Output:
    """Runs `body(*args)` in a fresh Python process and returns its stdout, with what it
    returned as `.value`; fails the test with the child's output (its traceback included) when
    it exits non-zero or outlives `timeout` seconds. `env` adds to the child's environment."""
    with tempfile.TemporaryDirectory() as tmp:
        command, result = _command(body, args, tmp, "fresh")
        [(rc, stdout, stderr)], timed_out = _run([(command, repo_env(env))], timeout, tmp)
        if timed_out or rc != 0:
            why = f"timed out after {timeout:g} s" if timed_out else f"failed (rc={rc})"
            _fail(f"child process {why}: {_name(body)}{_last_line(stderr)}", _both(stdout, stderr))
        return _output(stdout, result, stderr)


def run_ranks(body, world_size: int = 2, timeout: float = 300, env=None, rank_args=None, args=()) -> list:
    """Runs `body` as `world_size` processes and returns each rank's stdout (as run_fresh).

    Each rank sees RANK, WORLD_SIZE and TB_INIT_METHOD (a file:// rendezvous for
    torch.distributed.init_process_group) in its environment, plus `env`, and is called as
    `body(*args, *rank_args[rank])`; a code string gets them, as strings, in sys.argv[1:].
    `timeout` is for all ranks together: at the deadline the ones still running are killed.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        children, results = [], []
        for rank in range(world_size):
            rank_env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "TB_INIT_METHOD": init, **(env or {})}
            command, result = _command(body, [*args, *(rank_args[rank] if rank_args else [])], tmp, f"rank{rank}")
            children.append((command, repo_env(rank_env)))
            results.append(result)
        outputs, timed_out = _run(children, timeout, tmp)
        failed = [r for r, (rc, _, _) in enumerate(outputs) if rc != 0]
        if timed_out or failed:
            why = f"timed out after {timeout:g} s" if timed_out else f"rank(s) {failed} failed"
            last = "".join(_last_line(outputs[r][2]) for r in failed[:1])
            _fail(f"{why}: {_name(body)}{last}",
                  "\n".join(f"--- rank {r} (rc={rc}) stdout\n{o}\n--- rank {r} stderr\n{e}"
                            for r, (rc, o, e) in enumerate(outputs)))
        return [_output(o, result, e) for (_, o, e), result in zip(outputs, results)]
