"""The resource-manager protocol: what every component that holds memory for requests (the KV
cache, the eager workspace, the graph pools) tells the planner and the scheduler.

Note [Resource managers]
A component states, in one unit (tokens), how much it can hold (`capacity_tokens`), how much
is free now (`free_tokens`) and how much more a request needs to run to completion
(`tokens_to_completion`); it names the dummy requests whose step is its worst case, which
the planner's profiling runs (`dummy_requests`, `dummy_step`); and it is told about every step
before the forward (`prepare`: take what the step's requests need), after it (`update`) and
about every finished request (`free`). A scheduler admits a request only when every manager
has room for all it still needs (torch_budget.scheduling), so a request that would not fit
waits a step instead of failing mid-forward - the shape of TensorRT-LLM's resource managers
and of its no-eviction capacity scheduler.

What a token means is each manager's own: a KV slot for the cache, an attended prompt token of
one step for the workspace, a row of a captured decode step for the graph pools. A manager
whose memory lives only for the step (the workspace) frees it at `update`; one that holds it
per request (the cache) at `free`.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from . import _scope

__all__ = ["TokenRequest", "DummyRequest", "Step", "ResourceManager", "profiling_step", "dummy_step"]

CONTEXT, GENERATION = "context", "generation"


@runtime_checkable
class TokenRequest(Protocol):
    """What a manager reads of a request: an id unique among live requests, the prompt's
    length and the most tokens it may generate."""

    request_id: int
    prompt_len: int
    max_new_tokens: int


@dataclass(frozen=True)
class DummyRequest:
    """A request made up for the profiling run: `phase` "context" (its prompt is processed in
    the step) or "generation" (it generates one token in the step)."""

    request_id: int
    prompt_len: int
    max_new_tokens: int = 0
    phase: str = CONTEXT

    def __post_init__(self):
        if self.phase not in (CONTEXT, GENERATION):
            raise ValueError(f"a dummy request's phase is {CONTEXT!r} or {GENERATION!r}, got {self.phase!r}")
        if self.prompt_len < 0 or self.max_new_tokens < 0:
            raise ValueError(f"a dummy request's lengths must be >= 0, got {self.prompt_len}, {self.max_new_tokens}")


@dataclass(frozen=True)
class Step:
    """One step of a server: `context` requests process their prompts (and are new to every
    manager), `generation` requests generate one token each (a request admitted in this step
    may be in both)."""

    context: tuple = ()
    generation: tuple = ()

    @property
    def requests(self) -> tuple:
        """Every request of the step, once each, context first."""
        seen, out = set(), []
        for req in (*self.context, *self.generation):
            if req.request_id not in seen:
                seen.add(req.request_id)
                out.append(req)
        return tuple(out)


@runtime_checkable
class ResourceManager(Protocol):
    """See Note [Resource managers]. `tag` is the ledger tag the manager's memory is charged to
    (the budget Plan.apply() gives it)."""

    tag: str

    def capacity_tokens(self) -> int:
        """Tokens the manager can hold at once: what its budget admits."""

    def free_tokens(self) -> int:
        """Tokens it can still give now (capacity minus what live requests hold)."""

    def tokens_to_completion(self, request) -> int:
        """Tokens `request` needs beyond what it holds already to run to its end."""

    def dummy_requests(self) -> list[DummyRequest]:
        """The requests of its worst-case step, for the profiling run."""

    def prepare(self, step: Step) -> None:
        """Before the step's forward: take what its requests need (the scheduler checked it fits)."""

    def update(self, step: Step) -> None:
        """After the step's forward."""

    def free(self, request) -> None:
        """`request` finished (or was dropped): give back what it holds."""


def profiling_step(managers: Sequence[ResourceManager]) -> Step:
    """The one step the profiling run must hold: every manager's dummy requests, a request shape
    (phase, prompt, new tokens) as often as the manager that asks for it most (two managers that
    both name one long prompt as their worst case get one), ids renumbered from 0."""
    counts: dict[tuple, int] = {}
    for manager in managers:
        mine: dict[tuple, int] = {}
        for d in manager.dummy_requests():
            key = (d.phase, d.prompt_len, d.max_new_tokens)
            mine[key] = mine.get(key, 0) + 1
        for key, n in mine.items():
            counts[key] = max(counts.get(key, 0), n)
    context, generation = [], []
    for (phase, prompt, new), n in counts.items():
        for _ in range(n):
            req = DummyRequest(len(context) + len(generation), prompt, new, phase)
            (context if phase == CONTEXT else generation).append(req)
    return Step(tuple(context), tuple(generation))


@_scope.once(lambda *_, **__: "dummy_step()")
def dummy_step(managers: Sequence[ResourceManager]) -> Iterator[Step]:
    """`with dummy_step(managers) as step:` runs the profiling step's hooks around the block: each
    manager prepares the step, the block runs its forward, then each updates and frees every
    dummy request, even when the forward raised (the managers end as they began). Entered once and
    ended once: an end without an entry, or a second one, raises StateError and calls no hook."""
    step = profiling_step(managers)
    prepared = []
    try:
        for manager in managers:
            manager.prepare(step)
            prepared.append(manager)
        yield step
        for manager in managers:
            manager.update(step)
    finally:
        for manager in reversed(prepared):
            for req in step.requests:
                manager.free(req)
