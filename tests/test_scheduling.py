"""The resource-manager protocol (torch_budget.resources) and the scheduler that drives it
(torch_budget.scheduling), on CPU over the real managers: the demo's paged KV cache, the eager
workspace and a graph runner's rows. A request that does not fit is deferred and served later,
never failed; one that could never fit is refused before any forward."""
from dataclasses import dataclass

import pytest
import torch

from torch_budget.demo.kv_resource import PagedKVResource
from torch_budget.demo.model import PagedKVCache
from torch_budget.eager_workspace import WORKSPACE_TAG, WorkspaceMetadata
from torch_budget.errors import RequestTooLargeError, StateError
from torch_budget.graphs import GraphPoolManager, GraphResource, StaticInput
from torch_budget.planner.shape import ModelShape
from torch_budget.resources import DummyRequest, ResourceManager, Step, dummy_step, profiling_step
from torch_budget.scheduling import Scheduler
from torch_budget.workspace_resource import WorkspaceResource

TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=256, vocab=97, head_dim=16, max_seq_len=32,
                  dtype="float32")
W = 64  # workspace bytes per prompt token in these tests


@dataclass(frozen=True)
class Req:
    request_id: int
    prompt_len: int
    max_new_tokens: int


def kv(usable_blocks=8, rows=4, longest=16):
    cache = PagedKVCache(TINY, num_blocks=usable_blocks + 1, max_batch=rows, block_size=4)
    return PagedKVResource(cache, longest_prompt=longest)


def workspace(tokens):
    meta = WorkspaceMetadata("cpu", reclaimable=True)
    meta.warm_up(W)
    return WorkspaceResource(meta, W, tokens)


def graph_rows(buckets=(1, 2)):
    runner = GraphPoolManager("cpu").runner("decode", lambda b: {"y": b["x"] + 1}, buckets=list(buckets),
                                            inputs=[StaticInput("x", torch.int64)])
    return GraphResource(runner)


def run(scheduler, steps_until_done):
    """Schedules steps; `steps_until_done[id]` is how many steps a request runs once admitted.
    Returns the ids admitted at each step."""
    admitted, left = [], {}
    while not scheduler.idle:
        step = scheduler.schedule()
        admitted.append([r.request_id for r in step.context])
        left.update({r.request_id: steps_until_done[r.request_id] for r in step.context})
        scheduler.complete(step)
        for req in step.generation:
            left[req.request_id] -= 1
            if left[req.request_id] == 0:
                scheduler.finish(req)
        assert len(admitted) < 100, "the scheduler made no progress"
    return admitted


def test_every_manager_speaks_the_protocol():
    for manager in (kv(), workspace(8), graph_rows()):
        assert isinstance(manager, ResourceManager), manager
        assert manager.capacity_tokens() == manager.free_tokens() > 0


def test_a_request_the_kv_cache_cannot_hold_now_waits_and_is_served_when_blocks_come_back():
    cache_res = kv(usable_blocks=8)  # 32 token slots
    scheduler = Scheduler([cache_res])
    a, b, c = Req(0, 10, 6), Req(1, 12, 4), Req(2, 8, 8)  # 4 blocks each
    for req in (a, b, c):
        scheduler.submit(req)
    first = scheduler.schedule()
    assert [r.request_id for r in first.context] == [0, 1] and cache_res.free_tokens() == 0
    assert scheduler.deferred == {2} and scheduler.waits["kv"] == 1
    rows = {r.request_id: cache_res.row_of(r) for r in first.context}
    scheduler.complete(first)
    scheduler.finish(a)
    second = scheduler.schedule()
    assert [r.request_id for r in second.context] == [2] and cache_res.row_of(c) == rows[0], "a's row, reused"
    assert [r.request_id for r in second.generation] == [1, 2]
    assert cache_res.cache.blocks_of(cache_res.row_of(c)) == 4, "every block c fills, reserved at admission"
    for req in (b, c):
        scheduler.finish(req)
    assert scheduler.idle and cache_res.free_tokens() == cache_res.capacity_tokens()


def test_a_later_small_request_does_not_overtake_a_deferred_one():
    scheduler = Scheduler([kv(usable_blocks=8)])
    for req in (Req(0, 20, 4), Req(1, 20, 4), Req(2, 1, 1)):  # 6, 6 and 1 blocks
        scheduler.submit(req)
    assert run(scheduler, {0: 2, 1: 1, 2: 1}) == [[0], [], [1, 2]]
    assert scheduler.deferred == {1}


def test_the_workspace_defers_what_passes_its_tokens_per_step_and_gives_them_back_after_the_step():
    ws = workspace(tokens=20)
    scheduler = Scheduler([ws])
    for req in (Req(0, 12, 3), Req(1, 12, 3), Req(2, 8, 3)):
        scheduler.submit(req)
    step = scheduler.schedule()
    assert [r.request_id for r in step.context] == [0] and ws.free_tokens() == 8
    assert ws.meta.capacity >= 12 * W, "prepare grew the workspace before the forward"
    scheduler.complete(step)
    assert ws.free_tokens() == 20 and ws.tokens_to_completion(Req(0, 12, 3)) == 0, "prefilled: needs no more"
    step = scheduler.schedule()
    assert [r.request_id for r in step.context] == [1, 2] and scheduler.deferred == {1}, "2 waited behind 1"
    assert scheduler.waits == {"workspace": 1}


@pytest.mark.parametrize("make", [
    lambda meta, **kw: WorkspaceResource(meta, W, 8, **kw),
    lambda meta, **kw: WorkspaceResource.from_budget(meta, W, 8 * W, **kw),
])
def test_the_workspace_names_the_tag_its_memory_is_charged_to_and_tag_is_deprecated(make):
    meta = WorkspaceMetadata("cpu", reclaimable=True)
    meta.warm_up(W)
    assert make(meta).tag == WORKSPACE_TAG
    with pytest.warns(DeprecationWarning, match=r"WorkspaceResource\(tag=\) is deprecated"):
        assert make(meta, tag=WORKSPACE_TAG).tag == WORKSPACE_TAG
    with pytest.raises(ValueError, match="allocates under tag 'workspace'"):
        make(meta, tag="scratch")  # it named a tag its memory was never charged to


def test_graph_rows_defer_a_request_until_a_row_of_the_largest_bucket_frees():
    rows = graph_rows(buckets=(1, 2))
    scheduler = Scheduler([rows])
    for i in range(3):
        scheduler.submit(Req(i, 4, 4))
    assert run(scheduler, {0: 1, 1: 3, 2: 1}) == [[0, 1], [2], []]
    assert scheduler.deferred == {2} and scheduler.waits["graphs"] == 1


def test_every_request_is_served_under_all_three_managers_and_none_fails():
    cache_res, ws, rows = kv(usable_blocks=10, rows=2), workspace(tokens=16), graph_rows(buckets=(1, 2))
    scheduler = Scheduler([cache_res, ws, rows])
    lengths = [(14, 2), (3, 9), (16, 4), (5, 5), (2, 1), (9, 7), (12, 4)]
    requests = [Req(i, p, n) for i, (p, n) in enumerate(lengths)]
    for req in requests:
        scheduler.submit(req)
    admitted = run(scheduler, {r.request_id: r.max_new_tokens for r in requests})
    assert sorted(i for ids in admitted for i in ids) == list(range(len(requests)))
    assert scheduler.deferred and set(scheduler.waits) <= {"kv", "workspace", "graphs"}
    assert cache_res.free_tokens() == cache_res.capacity_tokens() and ws.free_tokens() == 16 and rows.free_tokens() == 2


@pytest.mark.parametrize("make,request_,tag", [
    (lambda: kv(usable_blocks=4), Req(0, 10, 8), "kv"),  # 5 blocks of a 4-block cache
    (lambda: workspace(tokens=8), Req(0, 9, 1), "workspace"),
])
def test_a_request_no_manager_could_ever_hold_is_refused_at_submit(make, request_, tag):
    scheduler = Scheduler([make()])
    with pytest.raises(RequestTooLargeError, match=f"needs .* tokens of '{tag}', whose whole capacity is") as raised:
        scheduler.submit(request_)
    assert "could never be served" in str(raised.value)
    assert scheduler.idle


def test_a_manager_that_lost_track_of_its_tokens_is_an_error_not_a_hang():
    class Leaky:
        tag = "leaky"

        def capacity_tokens(self):
            return 10

        def free_tokens(self):
            return 3  # nothing holds the other 7

        def tokens_to_completion(self, request):
            return request.prompt_len

        def dummy_requests(self):
            return []

        def prepare(self, step):
            pass

        def update(self, step):
            pass

        def free(self, request):
            pass

    scheduler = Scheduler([Leaky()])
    scheduler.submit(Req(0, 5, 1))
    with pytest.raises(StateError, match="'leaky' has 3 of 10 tokens free with no request holding any"):
        scheduler.schedule()


def test_the_profiling_step_holds_each_managers_worst_case_once():
    cache_res, ws, rows = kv(longest=16), workspace(tokens=16), graph_rows(buckets=(1, 2))
    step = profiling_step([cache_res, ws, rows])
    assert [(r.prompt_len, r.phase) for r in step.context] == [(16, "context")], "one long prompt, named twice"
    assert [(r.prompt_len, r.max_new_tokens, r.phase) for r in step.generation] == [(1, 1, "generation")] * 2
    assert [r.request_id for r in step.requests] == [0, 1, 2]


def test_dummy_step_prepares_the_managers_and_gives_everything_back_even_when_the_forward_fails():
    cache_res, ws = kv(longest=16), workspace(tokens=16)
    with dummy_step([cache_res, ws]) as step:
        assert cache_res.cache.blocks_of(cache_res.row_of(step.context[0])) == 4
        assert ws.free_tokens() == 0 and ws.meta.capacity >= 16 * W
    assert cache_res.free_tokens() == cache_res.capacity_tokens() and ws.free_tokens() == 16
    with pytest.raises(RuntimeError, match="forward failed"):
        with dummy_step([cache_res, ws]):
            raise RuntimeError("forward failed")
    assert cache_res.free_tokens() == cache_res.capacity_tokens()
    with pytest.raises(StateError):
        cache_res.row_of(step.context[0])


def test_a_dummy_request_checks_its_fields():
    with pytest.raises(ValueError, match="phase"):
        DummyRequest(0, 4, phase="decode")
    with pytest.raises(ValueError, match=">= 0"):
        DummyRequest(0, -1)
    assert Step(context=(Req(0, 1, 1),), generation=(Req(0, 1, 1), Req(1, 1, 1))).requests == (Req(0, 1, 1),
                                                                                             Req(1, 1, 1))


class _Recording:
    """A manager that records the hooks called on it."""

    tag = "recording"

    def __init__(self):
        self.calls = []

    def dummy_requests(self):
        return [DummyRequest(0, 8)]

    def prepare(self, step):
        self.calls.append("prepare")

    def update(self, step):
        self.calls.append("update")

    def free(self, request):
        self.calls.append("free")


def test_a_stray_end_of_dummy_step_raises_and_calls_no_hook():
    # contextlib ran the body of a dummy_step ended without being entered: every manager prepared the
    # profiling step and only the cache's requests were freed, so the workspace stayed grown to its worst
    # case with no token free; then RuntimeError("generator didn't stop"). A second end passed silently.
    cache_res, ws = kv(longest=16), workspace(tokens=16)
    with pytest.raises(StateError, match="dummy_step\\(\\) was never entered"):
        dummy_step([cache_res, ws]).__exit__(None, None, None)
    assert (ws.meta.capacity, ws.free_tokens()) == (W, 16)
    assert cache_res.free_tokens() == cache_res.capacity_tokens()
    manager = _Recording()
    scope = dummy_step([manager])
    with scope:
        with pytest.raises(StateError, match="dummy_step\\(\\) is open already"):
            scope.__enter__()
    with pytest.raises(StateError, match="dummy_step\\(\\) has ended already"):
        scope.__exit__(None, None, None)
    assert manager.calls == ["prepare", "update", "free"]
