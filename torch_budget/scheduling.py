"""A scheduler over resource managers: requests are admitted first come, first served while
every manager has room for all they still need, and wait otherwise (Note [Resource managers]
in torch_budget/resources.py).

A request is admitted only when, for every manager, what it needs to run to completion fits
in what is free once the running requests' own remaining needs are set aside (TensorRT-LLM's
no-eviction capacity policy). So no request ever runs out of memory half-way: one that would
not fit is deferred to a later step, when finished requests have given theirs back. Only a
request that needs more than a manager's whole capacity is refused, at `submit`, before any
forward: waiting could never serve it.

Driving one step:

    step = scheduler.schedule()      # admits what fits; every manager prepares the step
    ... run step.context's prompts, then one token for step.generation ...
    scheduler.complete(step)         # every manager updates
    scheduler.finish(request)        # for each request that is done: every manager frees it
"""
from __future__ import annotations

import collections
from collections.abc import Sequence

from torch_budget.errors import RequestTooLargeError, StateError
from torch_budget.resources import ResourceManager, Step

__all__ = ["Scheduler"]


class Scheduler:
    """First come, first served admission over `managers`. `waiting` holds submitted requests
    in order, `running` the admitted ones not yet finished; `deferred` the ids of requests that
    waited at least one step because some manager had no room, and `waits` by tag how often a
    manager was what held the head of the queue back."""

    def __init__(self, managers: Sequence[ResourceManager]):
        self.managers = tuple(managers)
        if not self.managers:
            raise ValueError("a scheduler needs at least one resource manager")
        self.waiting: collections.deque = collections.deque()
        self.running: dict = {}  # request_id -> request, in admission order
        self.deferred: set = set()
        self.waits: collections.Counter = collections.Counter()

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs."""
        return not self.waiting and not self.running

    def submit(self, request) -> None:
        """Queue `request`. RequestTooLargeError when some manager could never hold what it
        needs, even with nothing else running."""
        if request.request_id in self.running or any(r.request_id == request.request_id for r in self.waiting):
            raise ValueError(f"request id {request.request_id} is already submitted")
        for manager in self.managers:
            need, capacity = manager.tokens_to_completion(request), manager.capacity_tokens()
            if need > capacity:
                raise RequestTooLargeError(
                    f"request {request.request_id} ({request.prompt_len} prompt tokens, up to "
                    f"{request.max_new_tokens} new) needs {need} tokens of {manager.tag!r}, whose whole capacity is "
                    f"{capacity}: it could never be served; raise {manager.tag!r}'s budget or shorten the request")
        self.waiting.append(request)

    def _reserved(self) -> list[int]:
        """Per manager: what the running requests still need to complete (set aside before admitting)."""
        return [sum(m.tokens_to_completion(r) for r in self.running.values()) for m in self.managers]

    def schedule(self) -> Step:
        """Admit waiting requests in order while each fits every manager; the first that does not
        stops admission (no request overtakes an earlier one) and is deferred. Returns the step:
        the admitted requests as `context`, every running request (them included) as
        `generation`; every manager has prepared it."""
        available = [m.free_tokens() - r for m, r in zip(self.managers, self._reserved())]
        admitted = []
        while self.waiting:
            request = self.waiting[0]
            needs = [m.tokens_to_completion(request) for m in self.managers]
            short = [m for m, need, room in zip(self.managers, needs, available) if need > room]
            if short:
                if not self.running and not admitted:
                    # Nothing holds anything, and submit() checked the capacity: a manager lost track.
                    m = short[0]
                    raise StateError(
                        f"request {request.request_id} cannot be admitted although nothing runs: {m.tag!r} has "
                        f"{m.free_tokens()} of {m.capacity_tokens()} tokens free with no request holding any")
                self.deferred.add(request.request_id)
                self.waits.update(m.tag for m in short)
                break
            available = [room - need for room, need in zip(available, needs)]
            admitted.append(self.waiting.popleft())
        for request in admitted:
            self.running[request.request_id] = request
        step = Step(tuple(admitted), tuple(self.running.values()))
        for manager in self.managers:
            manager.prepare(step)
        return step

    def complete(self, step: Step) -> None:
        """After the step's forward: every manager updates."""
        for manager in self.managers:
            manager.update(step)

    def finish(self, request) -> None:
        """`request` is done: every manager frees what it holds."""
        if self.running.pop(request.request_id, None) is None:
            raise ValueError(f"request id {request.request_id} is not running")
        for manager in self.managers:
            manager.free(request)
