"""A graph runner's captured steps as a resource manager (Note [Resource managers] in
torch_budget/resources.py): a token is a row of a replayed decode step.

What a captured graph holds is resident from capture until the graph is closed, and a replay
allocates nothing; what bounds the requests is the largest captured bucket: a step of more rows
cannot replay. So each running request holds one row from admission to its end, and a request
that finds every row taken waits for one.
"""
from __future__ import annotations

from ..errors import StateError
from ..resources import GENERATION, DummyRequest, Step
from .runner import GraphRunner

__all__ = ["GraphResource"]

GRAPHS_TAG = "graphs"  # the tag the planner gives graph pools and static buffers (planner.TAGS)


class GraphResource:
    """The rows of `runner`'s largest captured bucket."""

    def __init__(self, runner: GraphRunner, *, tag: str = GRAPHS_TAG):
        if not runner.buckets:
            raise ValueError(f"runner {runner.name!r} has no bucket left to replay")
        self.runner = runner
        self.tag = tag
        self._live: set = set()  # ids of the requests holding a row

    def capacity_tokens(self) -> int:
        return max(self.runner.buckets)

    def free_tokens(self) -> int:
        return self.capacity_tokens() - len(self._live)

    def tokens_to_completion(self, request) -> int:
        return 0 if request.request_id in self._live else 1

    def dummy_requests(self) -> list[DummyRequest]:
        """A decode step that fills the largest bucket: the graph the capture must hold."""
        return [DummyRequest(i, 1, 1, GENERATION) for i in range(self.capacity_tokens())]

    def prepare(self, step: Step) -> None:
        live = self._live | {r.request_id for r in step.requests}
        if len(live) > self.capacity_tokens():
            raise StateError(f"a step of {len(live)} rows was scheduled past runner {self.runner.name!r}'s largest "
                             f"bucket ({self.capacity_tokens()})")
        self._live = live

    def update(self, step: Step) -> None:
        """Nothing to do: a replay allocates nothing, and rows are held until `free`."""

    def free(self, request) -> None:
        self._live.discard(request.request_id)
