"""The demo's paged KV cache as a resource manager (Note [Resource managers] in
torch_budget/resources.py): a token is a KV slot, held from admission to the end.

Each admitted request gets a cache row and, at once, every block its prompt and new tokens will
fill, so a step never runs out of KV mid-request; the scheduler admits it only when that many
blocks are free beside what the running requests hold.
"""
from __future__ import annotations

from torch_budget.demo.model import PagedKVCache
from torch_budget.demo.settings import TAG_KV
from torch_budget.errors import StateError
from torch_budget.resources import DummyRequest, Step


class PagedKVResource:
    """`cache`'s blocks for requests. `longest_prompt`: the longest prompt the server admits,
    the profiling run's dummy request."""

    def __init__(self, cache: PagedKVCache, *, longest_prompt: int, tag: str = TAG_KV):
        if not 0 < longest_prompt <= cache.cfg.max_seq_len:
            raise ValueError(f"longest_prompt must be in [1, max_seq_len={cache.cfg.max_seq_len}], got {longest_prompt}")
        self.cache = cache
        self.tag = tag
        self.longest_prompt = longest_prompt
        self._rows: dict[int, int] = {}  # request_id -> its cache row, while it is admitted

    def row_of(self, request) -> int:
        """The cache row `request` was given when its step was prepared."""
        try:
            return self._rows[request.request_id]
        except KeyError:
            raise StateError(f"request {request.request_id} holds no KV cache row: it was not admitted") from None

    def _blocks(self, request) -> int:
        return -(-(request.prompt_len + request.max_new_tokens) // self.cache.block_size)

    def capacity_tokens(self) -> int:
        return (self.cache.num_blocks - 1) * self.cache.block_size  # block 0 is the null block

    def free_tokens(self) -> int:
        return self.cache.free_blocks * self.cache.block_size

    def tokens_to_completion(self, request) -> int:
        row = self._rows.get(request.request_id)
        held = 0 if row is None else self.cache.blocks_of(row)
        return max(self._blocks(request) - held, 0) * self.cache.block_size

    def dummy_requests(self) -> list[DummyRequest]:
        return [DummyRequest(0, self.longest_prompt)]

    def prepare(self, step: Step) -> None:
        """Gives each request new to the cache the lowest free row and every block it will fill."""
        for request in step.context:
            if request.request_id in self._rows:
                continue
            taken = set(self._rows.values())
            row = next((r for r in range(self.cache.max_batch) if r not in taken), None)
            if row is None:
                raise StateError(f"request {request.request_id} was admitted but all {self.cache.max_batch} KV cache "
                                 "rows are held: the scheduler needs a manager that counts rows (the graph slots)")
            self.cache.reserve(row, request.prompt_len + request.max_new_tokens)
            self._rows[request.request_id] = row

    def update(self, step: Step) -> None:
        """Nothing to do: every block a request fills was reserved when it was admitted."""

    def free(self, request) -> None:
        row = self._rows.pop(request.request_id, None)
        if row is not None:
            self.cache.release(row)
