"""Processes that take turns: the timing of one allocator against another on a machine whose
speed moves while it runs.

On the GPU machines this project measures on, a core runs the same loop at one speed and then,
for a second or more, at half of it (a calibration loop timed just before a pass does not predict
the pass). Processes timed one after the other therefore differ by up to 2x for reasons that are
not theirs. Here every configuration runs at once, each in its own process (the allocator is
chosen before CUDA starts), but only one works at a time: the parent hands the turn to each in
a rotating order, a slice of work each (a few milliseconds of a trace, one step of a model), so
a slow spell of the machine falls on every configuration's slices alike; the pinned ones all
share one core. A waiting process sleeps on its pipe and has synchronised its device work; the
time it waited earns torch_budget no packing credit (turn_starts()).

The protocol is lines: the parent writes a command to a child's stdin; the child answers with
one line `LOCKSTEP <answer>` on stdout (other output is ignored, so warnings cannot break it);
`LOCKSTEP error <message>` reports a failure of the command.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import tempfile
import threading

PREFIX = "LOCKSTEP "


class ChildError(RuntimeError):
    """A child failed a command, died or stopped answering; the message says which and how."""


class Child:
    """One child process speaking the protocol, as the parent sees it."""

    def __init__(self, name: str, cmd: list, env: dict | None = None):
        self.name = name
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True, bufsize=1, env=env)
        self._lines: queue.Queue = queue.Queue()
        # A thread reads the child's stdout, so the parent can wait on several children with a timeout.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self._proc.stdout:
            if line.startswith(PREFIX):
                self._lines.put(line[len(PREFIX):].rstrip("\n"))
        self._lines.put(None)  # end of output: the child exited

    def send(self, command: str) -> None:
        try:
            self._proc.stdin.write(command + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ChildError(f"{self.name}: cannot send {command.split()[0]!r}: {e}; {self.tail()}") from e

    def receive(self, timeout: float) -> str:
        """The next answer; ChildError when it is an error, the child exited, or none came in time."""
        try:
            answer = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise ChildError(f"{self.name}: no answer within {timeout:.0f} s; {self.tail()}") from None
        if answer is None:
            self._proc.wait()
            raise ChildError(f"{self.name}: exited with {self._proc.returncode}; {self.tail()}")
        if answer.startswith("error "):
            raise ChildError(f"{self.name}: {answer[6:]}")
        return answer

    def ask(self, command: str, timeout: float) -> str:
        self.send(command)
        return self.receive(timeout)

    def tail(self, lines: int = 3) -> str:
        """The last lines the child wrote to stderr: why it failed, usually."""
        self._stderr.seek(0)
        text = self._stderr.read().strip().splitlines()
        return "stderr: " + " | ".join(text[-lines:]) if text else "nothing on stderr"

    def close(self, timeout: float = 30.0) -> None:
        """Asks the child to quit, then kills it if it does not; closes its pipes."""
        if self._proc.poll() is None:
            try:
                self.send("quit")
                self._proc.wait(timeout=timeout)
            except (ChildError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout=timeout)  # it ends at the end of the child's output
        for pipe in (self._proc.stdin, self._proc.stdout, self._stderr):
            try:
                pipe.close()
            except OSError:  # a broken pipe's buffered bytes: the child is gone anyway
                pass


def start(children: dict, timeout: float) -> dict:
    """Starts a Child per name (name -> (cmd, env)) and waits until each says `ready`. A child that
    fails to get ready is left out: the result maps each name to its Child or to its ChildError."""
    started = {name: Child(name, cmd, env) for name, (cmd, env) in children.items()}
    out = {}
    for name, child in started.items():
        try:
            answer = child.receive(timeout)
            if answer != "ready":
                raise ChildError(f"{name}: said {answer!r} before it was ready")
            out[name] = child
        except ChildError as e:
            child.close(timeout=5.0)
            out[name] = e
    return out


def rotation(names: list, turn: int) -> list:
    """The order of `turn`: each name goes first in turn, so none always follows the same one."""
    k = turn % len(names) if names else 0
    return names[k:] + names[:k]


# The child's side.

def answer(text: str) -> None:
    sys.stdout.write(PREFIX + text + "\n")
    sys.stdout.flush()


def tell_installed(call: str) -> None:
    """Under install(): the C ABI's `call` on the current device (a replaying child's word on its
    packing credit, Note [Packing time]); torch's own allocator has nothing to tell."""
    import torch_budget

    if torch_budget.installed():
        from torch_budget import _runtime

        getattr(_runtime.library(), call)(_runtime.current_device())


def turn_starts() -> None:
    """In a child, as its turn starts: the time it waited earns torch_budget no packing credit
    (Note [Packing time]), so it packs as a process that never waited does. Without this a
    configuration's packing depended on how many others shared its round, and how slow they were."""
    tell_installed("tb_packing_idle")


def commands():
    """The parent's commands, one per line, until `quit` or the end of stdin."""
    for line in sys.stdin:
        line = line.strip()
        if line == "quit":
            return
        if line:
            yield line


def serve(handlers: dict) -> None:
    """A child's loop: says `ready`, then answers each command with what its handler returns
    (called with the command's words after the first); a handler's exception, or a command
    without one, is answered as an error, and the child goes on."""
    answer("ready")
    for line in commands():
        word, *args = line.split()
        handler = handlers.get(word)
        if handler is None:
            answer(f"error unknown command {line!r}")
            continue
        try:
            text = handler(*args)
        except Exception as e:  # noqa: BLE001  (the parent reports it, naming the configuration)
            text = f"error {type(e).__name__}: {e}".replace("\n", " ")
        answer(text)

