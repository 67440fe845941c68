"""The eager workspace as a resource manager (Note [Resource managers] in
torch_budget/resources.py): a token is a prompt token attended in one step.

A context request's prefill asks the workspace for `bytes_per_token` per prompt token; the
workspace lives for the step only, so what a step takes comes back at its `update`. The
per-step capacity is the admission cap of the planner's workspace split (SPEC 6: requests over
it are deferred, not failed), or what the workspace tag's budget holds (`from_budget`).
`prepare` grows the workspace to the largest prompt of the step before the forward starts, so
should the budget be short, the refusal comes between steps and not half-way through a forward.
Its memory is the eager workspace's, charged to tag "workspace" (WORKSPACE_TAG); `tag` names
that tag, and the `tag=` argument, which named another without charging it, is deprecated.
"""
from __future__ import annotations

from torch_budget import _deprecation
from torch_budget._validate import non_negative_int, positive_int
from torch_budget.eager_workspace import WORKSPACE_TAG, get
from torch_budget.errors import InvalidArgumentError, StateError
from torch_budget.resources import DummyRequest, Step


class WorkspaceResource:
    """The eager workspace of `meta` (warmed up), `tokens` prompt tokens per step at
    `bytes_per_token` each."""

    tag = WORKSPACE_TAG  # where the eager workspace allocates (the scheduler's messages name it)

    def __init__(self, meta, bytes_per_token: int, tokens: int, *, tag: str | None = None):
        _deprecated_tag(tag)
        self.meta = meta
        self.bytes_per_token = positive_int(bytes_per_token, "bytes_per_token")
        self.tokens = positive_int(tokens, "tokens")
        self._taken = 0  # prompt tokens of the step being run; 0 between steps
        self._prefilled: set = set()  # ids of running requests whose prompts were processed

    @classmethod
    def from_budget(cls, meta, bytes_per_token: int, budget_bytes: int, *, tag: str | None = None):
        """As many tokens per step as `budget_bytes` (the workspace tag's budget) holds."""
        _deprecated_tag(tag)
        non_negative_int(budget_bytes, "budget_bytes")
        tokens = budget_bytes // positive_int(bytes_per_token, "bytes_per_token")
        if tokens < 1:
            raise ValueError(f"a workspace budget of {budget_bytes} bytes holds no token at {bytes_per_token} "
                             "bytes per token; raise it")
        return cls(meta, bytes_per_token, tokens)

    def capacity_tokens(self) -> int:
        return self.tokens

    def free_tokens(self) -> int:
        return self.tokens - self._taken

    def tokens_to_completion(self, request) -> int:
        return 0 if request.request_id in self._prefilled else request.prompt_len

    def dummy_requests(self) -> list[DummyRequest]:
        return [DummyRequest(0, self.tokens)]

    def prepare(self, step: Step) -> None:
        fresh = [r for r in step.context if r.request_id not in self._prefilled]
        taken = sum(r.prompt_len for r in fresh)
        if taken > self.tokens:
            raise StateError(f"a step of {taken} prompt tokens was scheduled past the eager workspace's "
                             f"{self.tokens} per step")
        self._taken = taken
        if fresh:
            get(self.meta, self.bytes_per_token * max(r.prompt_len for r in fresh))

    def update(self, step: Step) -> None:
        self._prefilled.update(r.request_id for r in step.context)
        self._taken = 0

    def free(self, request) -> None:
        self._prefilled.discard(request.request_id)


def _deprecated_tag(tag) -> None:
    """tag=: refused unless it is the workspace's own tag, and deprecated even then."""
    if tag is None:
        return
    if tag != WORKSPACE_TAG:
        raise InvalidArgumentError(f"WorkspaceResource(tag={tag!r}): the eager workspace allocates under tag "
                                   f"{WORKSPACE_TAG!r}, so its budget and the scheduler's messages are that tag's; "
                                   "drop tag=")
    _deprecation.warn("torch_budget.workspace_resource.WorkspaceResource(tag=)",
                      f"drop tag=: the eager workspace is always charged to tag {WORKSPACE_TAG!r}", stacklevel=4)
