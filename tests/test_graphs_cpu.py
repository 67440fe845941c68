"""GraphPoolManager logic that does not need a device: buckets, static buffers, padding,
rebinding, the shadow ring, pool ownership. CPU tensors stand in for device buffers."""

import pytest
import torch

from conftest import MiB
from torch_budget.graphs import (
    BucketRule,
    EagerPiece,
    GraphPoolManager,
    PoolInUseError,
    PoolLedger,
    PoolReleasedError,
    StaticBufferRebindError,
    ShadowRing,
    StaticInput,
    pad_to_bucket,
    resolve_buckets,
)
from torch_budget.errors import StateError

HIDDEN = 8


def _linear_piece(weight):
    def linear(buffers):
        return {"y": buffers["x"] @ weight + buffers["pos"].unsqueeze(-1)}
    return linear


def _runner(manager, name="decode", buckets=(1, 2, 4, 8), **kwargs):
    weight = torch.randn(HIDDEN, HIDDEN)
    inputs = kwargs.pop("inputs", [
        StaticInput("x", torch.float32, (HIDDEN,)),
        StaticInput("pos", torch.float32, (), pad_value=-1),
    ])
    return manager.runner(name, kwargs.pop("pieces", _linear_piece(weight)), buckets=buckets,
                          inputs=inputs, **kwargs), weight


# -- buckets ---------------------------------------------------------------------------

def test_bucket_rule_builds_small_sizes_then_multiples_of_step_then_coarse_steps():
    rule = BucketRule(300, small=(1, 2, 4), step=8, coarse_from=256, coarse_step=16)
    buckets = rule.buckets()
    assert buckets[:5] == (1, 2, 4, 8, 16)
    assert all(b % 8 == 0 for b in buckets[3:] if b < 256)
    assert buckets[-4:] == (256, 272, 288, 300)
    assert 248 in buckets and 264 not in buckets


def test_bucket_rule_always_offers_the_max_as_a_candidate():
    assert BucketRule(13).buckets() == (1, 2, 4, 8, 13)
    assert BucketRule(3).buckets() == (1, 2, 3)


def test_bucket_rule_drops_sizes_not_divisible_by_tensor_parallel_size():
    buckets = BucketRule(100, divisible_by=8).buckets()
    assert buckets[0] == 8
    assert all(b % 8 == 0 for b in buckets)
    assert buckets[-1] == 96  # 100 itself is dropped, so the largest captured bucket is 96


def test_bucket_rule_count_limit_keeps_smallest_and_largest_spread_between():
    buckets = BucketRule(512, max_count=5).buckets()
    assert len(buckets) == 5
    assert buckets[0] == 1 and buckets[-1] == 512
    assert list(buckets) == sorted(set(buckets))
    assert BucketRule(512, max_count=1).buckets() == (512,)


def test_bucket_rule_memory_limit_drops_buckets_that_cost_too_much():
    rule = BucketRule(64, memory_limit=5 * MiB)
    buckets = rule.buckets(cost=lambda b: b * 256 * 1024)  # 256 KiB per row
    assert buckets[-1] == 16 and 24 not in buckets
    with pytest.raises(ValueError, match="cost function"):
        rule.buckets()


def test_bucket_rule_that_leaves_nothing_raises_naming_the_rule():
    with pytest.raises(ValueError, match="divisible_by=16.*leaves no bucket"):
        BucketRule(8, divisible_by=16).buckets()


# A value out of range is a ValueError, the wrong type a TypeError (torch_budget._validate).
@pytest.mark.parametrize("field,value,error", [("max_size", 0, ValueError), ("step", -8, ValueError),
                                               ("divisible_by", 2.0, TypeError), ("max_count", 0, ValueError),
                                               ("memory_limit", -1, ValueError), ("small", (1, True), TypeError)])
def test_bucket_rule_rejects_bad_knobs_naming_them(field, value, error):
    kwargs = {"max_size": 64, field: value}
    shown = value[-1] if isinstance(value, tuple) else value
    with pytest.raises(error, match=f"{field}.*{shown}"):
        BucketRule(**kwargs)


def test_bucket_rule_stores_plain_ints():
    rule = BucketRule(torch.tensor(12), step=torch.tensor(4))
    assert type(rule.max_size) is int and type(rule.step) is int
    assert rule.buckets() == (1, 2, 4, 8, 12) and all(type(b) is int for b in rule.buckets())


def test_explicit_bucket_list_is_sorted_and_deduplicated():
    assert resolve_buckets([8, 2, 8, 1]) == (1, 2, 8)
    assert resolve_buckets(16) == BucketRule(16).buckets()
    with pytest.raises(ValueError, match="bucket 0"):
        resolve_buckets([4, 0])
    with pytest.raises(ValueError, match="must not be empty"):
        resolve_buckets([])
    with pytest.raises(TypeError, match="bucket True"):
        resolve_buckets([4, True])
    with pytest.raises(TypeError, match="a list of sizes"):
        resolve_buckets("16")


def test_rows_pad_up_to_the_nearest_bucket():
    buckets = (1, 2, 4, 8, 16)
    assert [pad_to_bucket(buckets, n) for n in (1, 3, 4, 5, 16)] == [1, 4, 4, 8, 16]


def test_rows_above_the_largest_bucket_run_eagerly():
    assert pad_to_bucket((1, 2, 4), 5) is None


@pytest.mark.parametrize("n,error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)])
def test_row_count_must_be_a_positive_int(n, error):
    with pytest.raises(error, match="row count"):
        pad_to_bucket((1, 2, 4), n)


# -- static buffers ---------------------------------------------------------------------

def test_static_buffers_are_capped_by_largest_captured_bucket_not_user_max():
    manager = GraphPoolManager("cpu")
    runner, _ = _runner(manager, buckets=BucketRule(100, divisible_by=8))
    assert runner.buckets[-1] == 96
    assert runner.inputs["x"].shape == (96, HIDDEN)
    assert runner.inputs["pos"].shape == (96,)
    assert runner.static_nbytes == 96 * HIDDEN * 4 + 96 * 4
    assert runner.shadow_slots == 2
    assert runner.shadow_nbytes == 2 * runner.static_nbytes
    assert runner.bucket_for(97) is None


def test_memory_limit_uses_static_input_bytes_per_bucket():
    manager = GraphPoolManager("cpu")
    inputs = [StaticInput("hidden", torch.float16, (1024,))]  # 2 KiB per row
    runner, _ = _runner(manager, buckets=BucketRule(4096, memory_limit=1 * MiB), inputs=inputs,
                        pieces=lambda b: None)
    assert runner.buckets[-1] == 512
    assert runner.inputs["hidden"].numel() * 2 == 1 * MiB


def test_symbolic_axis_is_sized_at_its_maximum_over_captured_buckets():
    manager = GraphPoolManager("cpu")
    inputs = [
        StaticInput("tokens", torch.int64, ()),
        StaticInput("block_table", torch.int32, ("blocks",), pad_value=-1),
        StaticInput("rope", torch.float32, ("rot", 2), batch_axis=None),
    ]
    runner, _ = _runner(manager, buckets=[1, 4, 16], inputs=inputs, pieces=lambda b: None,
                        axes={"blocks": lambda b: 64 // b, "rot": 32})
    # blocks is largest at the smallest bucket; each dimension is sized at its maximum.
    assert runner.inputs["block_table"].shape == (16, 64)
    assert runner.view("block_table", 4).shape == (4, 16)
    assert runner.view("rope", 1).shape == runner.view("rope", 16).shape == (32, 2)


def test_undeclared_symbolic_axis_is_rejected_naming_input_and_axis():
    manager = GraphPoolManager("cpu")
    with pytest.raises(ValueError, match="'block_table'.*'blocks'"):
        _runner(manager, inputs=[StaticInput("block_table", torch.int32, ("blocks",))])


def test_bucket_views_are_contiguous_prefixes_of_one_allocation():
    manager = GraphPoolManager("cpu")
    inputs = [StaticInput("kv_index", torch.int32, (3,), batch_axis=1)]
    runner, _ = _runner(manager, inputs=inputs, pieces=lambda b: None)
    full = runner.inputs["kv_index"]
    assert full.shape == (3, 8)
    for bucket in runner.buckets:
        view = runner.view("kv_index", bucket)
        assert view.shape == (3, bucket)
        assert view.is_contiguous()
        assert view.data_ptr() == full.data_ptr()


@pytest.mark.parametrize("kwargs,match", [
    ({"name": "1x"}, "identifier"),
    ({"name": "_x"}, "identifier"),
    ({"name": "n"}, "'n' is a parameter of step"),        # step(n, ...) could never be given it
    ({"shape": 16}, "shape must be a tuple of dimensions"),  # "'int' object is not iterable"
    ({"name": "bucket"}, "'bucket' is a parameter of step"),
    ({"dtype": "float32"}, "torch.dtype"),
    ({"shape": (0,)}, "dimension 0"),
    ({"batch_axis": 2}, "batch_axis"),
    ({"source": "disk"}, "'disk'"),
    ({"dtype": torch.int64, "pad_value": 0.5}, "pad_value 0.5"),
    ({"dtype": torch.int32, "pad_value": float("nan")}, "pad_value nan is not an integer"),   # int()'s ValueError
    ({"dtype": torch.int32, "pad_value": float("inf")}, "pad_value inf is not an integer"),   # int()'s OverflowError
    ({"dtype": torch.int8, "pad_value": 1000}, "pad_value 1000 does not fit torch.int8"),    # refused at capture
])
def test_static_input_declaration_errors_name_the_bad_value(kwargs, match):
    fields = {"name": "x", "dtype": torch.float32, "shape": (4,)}
    fields.update(kwargs)
    with pytest.raises(ValueError, match=match):
        StaticInput(**fields)


# -- rebinding --------------------------------------------------------------------------

def test_rebinding_an_input_item_raises_naming_the_buffer():
    runner, _ = _runner(GraphPoolManager("cpu"))
    with pytest.raises(StaticBufferRebindError, match="'x'.*copy_"):
        runner.inputs["x"] = torch.zeros(8, HIDDEN)


def test_rebinding_by_attribute_raises_naming_the_buffer():
    runner, _ = _runner(GraphPoolManager("cpu"))
    with pytest.raises(StaticBufferRebindError, match="'pos'"):
        runner.inputs.pos = torch.zeros(8)
    with pytest.raises(StaticBufferRebindError, match="'pos'"):
        setattr(runner, "pos", torch.zeros(8))
    with pytest.raises(StaticBufferRebindError, match="'x'"):
        del runner.inputs["x"]


def test_rebinding_an_output_raises_once_the_output_exists():
    runner, _ = _runner(GraphPoolManager("cpu"))
    runner.run_eager(2, x=torch.randn(2, HIDDEN), pos=torch.zeros(2))
    with pytest.raises(StaticBufferRebindError, match="'y'"):
        runner.outputs["y"] = torch.zeros(8, HIDDEN)
    with pytest.raises(StaticBufferRebindError, match="'y'"):
        runner.y = torch.zeros(8, HIDDEN)


def test_in_place_writes_reach_every_bucket_view():
    runner, _ = _runner(GraphPoolManager("cpu"))
    runner.inputs["x"].copy_(torch.full((8, HIDDEN), 3.0))
    assert torch.equal(runner.view("x", 2), torch.full((2, HIDDEN), 3.0))
    assert runner.x.data_ptr() == runner.view("x", 4).data_ptr()


# -- staging, padding, outputs ----------------------------------------------------------

def test_step_data_is_padded_into_the_shadow_and_outputs_are_narrowed():
    runner, weight = _runner(GraphPoolManager("cpu"))
    x, pos = torch.randn(3, HIDDEN), torch.arange(3.0)
    out = runner.run_eager(3, x=x, pos=pos)
    assert out["y"].shape == (3, HIDDEN)
    torch.testing.assert_close(out["y"], x @ weight + pos.unsqueeze(-1))
    # Bucket 4: the fourth row is padding with the declared pad value.
    assert runner.view("pos", 4)[3].item() == -1
    assert runner.shadows["pos"][3].item() == -1
    assert torch.equal(runner.view("x", 4)[3], torch.zeros(HIDDEN))


def test_padding_overwrites_rows_left_from_a_larger_earlier_step():
    runner, _ = _runner(GraphPoolManager("cpu"))
    runner.run_eager(4, x=torch.ones(4, HIDDEN), pos=torch.ones(4))
    runner.run_eager(3, x=torch.ones(3, HIDDEN), pos=torch.ones(3))
    assert runner.view("pos", 4).tolist() == [1, 1, 1, -1]


def test_symbolic_axis_data_smaller_than_its_maximum_is_padded():
    manager = GraphPoolManager("cpu")
    inputs = [StaticInput("block_table", torch.int32, ("blocks",), pad_value=-1)]
    runner = manager.runner("paged", lambda b: {"first": b["block_table"][:, 0].clone()}, buckets=[2, 4],
                            inputs=inputs, axes={"blocks": 6})
    out = runner.run_eager(3, block_table=torch.tensor([[5, 6], [7, 8], [9, 10]], dtype=torch.int32))
    assert out["first"].tolist() == [5, 7, 9]
    assert runner.view("block_table", 4)[0].tolist() == [5, 6, -1, -1, -1, -1]
    assert runner.view("block_table", 4)[3].tolist() == [-1] * 6


def test_outputs_get_static_buffers_sized_for_the_largest_bucket_even_if_first_seen_small():
    runner, _ = _runner(GraphPoolManager("cpu"))
    runner.run_eager(1, x=torch.randn(1, HIDDEN), pos=torch.zeros(1))
    assert runner.outputs["y"].shape == (8, HIDDEN)
    first = runner.outputs["y"].data_ptr()
    runner.run_eager(7, x=torch.randn(7, HIDDEN), pos=torch.zeros(7))
    assert runner.outputs["y"].data_ptr() == first


@pytest.mark.parametrize("data,error,match", [
    ({"x": torch.randn(3, HIDDEN)}, ValueError, r"\['pos'\] missing"),
    ({"x": torch.randn(3, HIDDEN), "pos": torch.zeros(3), "mask": torch.zeros(3)}, ValueError, "'mask'"),
    ({"x": torch.randn(2, HIDDEN), "pos": torch.zeros(3)}, ValueError, "'x' has 2 rows.*n=3"),
    ({"x": torch.randn(3, HIDDEN + 1), "pos": torch.zeros(3)}, ValueError, "'x' has shape .3, 9."),
    ({"x": torch.randn(3), "pos": torch.zeros(3)}, ValueError, "'x' expects 2 dims"),
    ({"x": torch.randn(3, HIDDEN), "pos": torch.zeros(3, dtype=torch.complex64)}, TypeError, "'pos'.*complex64"),
])
def test_bad_step_data_is_rejected_naming_the_input(data, error, match):
    runner, _ = _runner(GraphPoolManager("cpu"))
    with pytest.raises(error, match=match):
        runner.run_eager(3, **data)


def test_integer_host_data_is_cast_to_the_declared_dtype():
    manager = GraphPoolManager("cpu")
    runner = manager.runner("ids", lambda b: {"ids2": b["ids"] * 2}, buckets=[4],
                            inputs=[StaticInput("ids", torch.int32, ())])
    assert runner.run_eager(2, ids=[3, 4])["ids2"].tolist() == [6, 8]


def test_a_refused_step_writes_no_buffer_and_takes_no_shadow_slot():
    manager = GraphPoolManager("cpu")
    runner = manager.runner("mix", lambda b: {"y": b["a"] + b["x"]}, buckets=[4], shadow_slots=2, inputs=[
        StaticInput("a", torch.float32, (2,), source="device"),
        StaticInput("b", torch.float32, (2,), source="device"),
        StaticInput("x", torch.float32, (2,)),
        StaticInput("h", torch.int64, (2,)),
    ])
    ones, ints = torch.ones(4, 2), torch.ones(4, 2, dtype=torch.int64)
    runner.run_eager(4, a=ones, b=ones, x=ones, h=ints)
    shadows = [{k: v.clone() for k, v in runner.shadows_at(s).items()} for s in range(2)]
    # A valid device input before a bad one, and a valid host input before a bad one.
    with pytest.raises(ValueError, match="'b' has shape"):
        runner.run_eager(4, a=ones * 7, b=torch.ones(4, 3), x=ones * 7, h=ints)
    with pytest.raises(TypeError, match="'h'"):
        runner.run_eager(4, a=ones * 7, b=ones, x=ones * 9, h=torch.full((4, 2), 0.5))
    assert torch.equal(runner.inputs["a"], ones) and torch.equal(runner.inputs["b"], ones)
    for s in range(2):
        assert all(torch.equal(runner.shadows_at(s)[k], shadows[s][k]) for k in ("x", "h"))
    # The ring did not move: the next step takes slot 1, as it would have without the refusals.
    runner.run_eager(4, a=ones, b=ones, x=ones * 5, h=ints)
    assert runner.shadows_at(1)["x"][0, 0].item() == 5.0 and runner.shadows_at(0)["x"][0, 0].item() == 1.0


@pytest.mark.parametrize("junk", ["abc", [[1, 2], [3]], object()])
def test_step_data_that_is_not_a_tensor_is_refused_naming_the_input(junk):
    runner, _ = _runner(GraphPoolManager("cpu"))
    with pytest.raises(ValueError, match="'pos' cannot be read as a tensor"):
        runner.run_eager(2, x=torch.randn(2, HIDDEN), pos=junk)


@pytest.mark.parametrize("source", ["host", "device"])
def test_step_data_that_autograd_tracks_leaves_the_buffers_untracked(source):
    manager = GraphPoolManager("cpu")
    runner = manager.runner("g", lambda b: {"y": b["x"] * 2}, buckets=[2, 4],
                            inputs=[StaticInput("x", torch.float32, (2,), source=source)])
    tracked = torch.ones(4, 2, requires_grad=True)
    assert runner.run_eager(4, x=tracked)["y"].tolist() == [[2.0, 2.0]] * 4
    assert runner.run_eager(2, x=tracked[:2] * 3)["y"].tolist() == [[6.0, 6.0]] * 2
    assert not runner.inputs["x"].requires_grad
    assert not any(t.requires_grad for t in runner.shadows.values())
    assert runner.run_eager(2, x=torch.full((2, 2), 4.0))["y"].tolist() == [[8.0, 8.0]] * 2


@pytest.mark.parametrize("last_outputs", ["copy", "in_pool"])
def test_outputs_of_pieces_that_autograd_tracks_leave_the_output_buffers_untracked(last_outputs):
    # A weight that requires grad (a module's parameter) made the in-place copy into the static output
    # buffer tracked: the buffer took a grad_fn, results came back with requires_grad, and each run chained
    # one more copy onto the buffer's graph, keeping every earlier run's activations alive.
    weight = torch.ones(2, 2, requires_grad=True)
    manager = GraphPoolManager("cpu")
    runner = manager.runner("g", [lambda b: {"h": b["x"] @ weight}, lambda b: {"y": b["h"] * 2}], buckets=[2, 4],
                            inputs=[StaticInput("x", torch.float32, (2,))], pool="own", last_outputs=last_outputs)
    for n in (4, 2, 3):
        out = runner.run_eager(n, x=torch.ones(n, 2))
        assert out["y"].tolist() == [[4.0, 4.0]] * n
        assert not any(t.requires_grad for t in out.values())
        assert not any(t.requires_grad or t.grad_fn is not None for t in runner.outputs.values())


def test_step_above_the_largest_bucket_raises_with_eager_hint():
    runner, _ = _runner(GraphPoolManager("cpu"))
    with pytest.raises(ValueError, match=r"9 rows exceed its largest bucket 8; run this step eagerly"):
        runner.step(9, x=torch.randn(9, HIDDEN), pos=torch.zeros(9))
    # run_eager pads into the same buffers: it cannot be the eager run it was told to do
    with pytest.raises(ValueError, match=r"9 rows exceed its largest bucket 8: run_eager\(\) too pads into "
                                         r"the static buffers.*call the pieces' forward without the runner"):
        runner.run_eager(9, x=torch.randn(9, HIDDEN), pos=torch.zeros(9))


def test_explicit_bucket_must_hold_the_rows():
    runner, _ = _runner(GraphPoolManager("cpu"))
    out = runner.run_eager(3, bucket=8, x=torch.randn(3, HIDDEN), pos=torch.zeros(3))
    assert out["y"].shape == (3, HIDDEN) and runner.view("pos", 8)[3].item() == -1
    with pytest.raises(ValueError, match="bucket 2 cannot hold 3 rows"):
        runner.run_eager(3, bucket=2, x=torch.randn(3, HIDDEN), pos=torch.zeros(3))


def test_output_without_batch_axis_needs_output_axes_none():
    manager = GraphPoolManager("cpu")
    summed = lambda b: {"total": b["x"].sum()}  # noqa: E731
    runner = manager.runner("sum", summed, buckets=[2, 4], inputs=[StaticInput("x", torch.float32, ())])
    with pytest.raises(ValueError, match="'total'.*output_axes"):
        runner.run_eager(2, x=torch.ones(2))
    runner = manager.runner("sum2", summed, buckets=[2, 4], inputs=[StaticInput("x", torch.float32, ())],
                            output_axes={"total": None})
    assert runner.run_eager(2, x=torch.ones(2))["total"].item() == 2.0


def test_piece_returning_a_bare_tensor_is_rejected():
    manager = GraphPoolManager("cpu")
    runner = manager.runner("bare", lambda b: b["x"] * 2, buckets=[2], inputs=[StaticInput("x", torch.float32, ())])
    with pytest.raises(TypeError, match="returned Tensor.*dict"):
        runner.run_eager(2, x=torch.ones(2))


def test_pieces_see_earlier_outputs_and_eager_pieces_write_in_place():
    manager = GraphPoolManager("cpu")

    def first(b):
        return {"h": b["x"] + 1}

    def double_into_scratch(b):
        b["scratch"].copy_(b["h"] * 2)

    def second(b):
        return {"y": b["scratch"] - 1}

    inputs = [StaticInput("x", torch.float32, ()), StaticInput("scratch", torch.float32, (), source="device")]
    runner = manager.runner("pw", [first, EagerPiece(double_into_scratch), second], buckets=[4], inputs=inputs)
    out = runner.run_eager(2, x=torch.tensor([1.0, 2.0]))
    assert out["y"].tolist() == [3.0, 5.0]


def test_eager_piece_must_not_return_a_value():
    manager = GraphPoolManager("cpu")
    runner = manager.runner("bad", [lambda b: None, EagerPiece(lambda b: b["x"] * 2)], buckets=[2],
                            inputs=[StaticInput("x", torch.float32, ())])
    with pytest.raises(TypeError, match="in place"):
        runner.run_eager(2, x=torch.ones(2))


def test_first_piece_must_be_captured():
    with pytest.raises(ValueError, match="first piece must be captured"):
        GraphPoolManager("cpu").runner("bad", [EagerPiece(lambda b: None)], buckets=[2])


def test_capture_needs_a_cuda_device():
    runner, _ = _runner(GraphPoolManager("cpu"))
    with pytest.raises(RuntimeError, match="'decode' lives on cpu.*CUDA device"):
        runner.capture()


def test_cuda_runner_without_a_device_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="sees no CUDA device.*GraphPoolManager\\('cpu'\\)"):
        GraphPoolManager("cuda:0").runner("decode", lambda b: None, buckets=[2])


def test_step_on_an_uncaptured_bucket_raises():
    runner, _ = _runner(GraphPoolManager("cpu"))
    with pytest.raises(RuntimeError, match="bucket 4 is not captured"):
        runner.step(3, x=torch.randn(3, HIDDEN), pos=torch.zeros(3))


def test_close_drops_static_buffers_and_the_runner_name():
    manager = GraphPoolManager("cpu")
    runner, _ = _runner(manager)
    runner.close()
    assert runner.closed and runner.static_nbytes == 0
    assert "decode" not in manager.runners
    with pytest.raises(RuntimeError, match="closed"):
        runner.run_eager(1, x=torch.randn(1, HIDDEN), pos=torch.zeros(1))
    with pytest.raises(StateError, match="closed: its static buffer 'x' is gone"):  # was a bare KeyError: 'x'
        runner.x
    _runner(manager)  # the name is free again


def test_duplicate_runner_name_is_rejected():
    manager = GraphPoolManager("cpu")
    _runner(manager)
    with pytest.raises(ValueError, match="'decode' already exists"):
        _runner(manager)


# -- shadow ring ------------------------------------------------------------------------

class _FakeFence:
    """Stands in for torch.cuda.Event: logs records and waits as (what, fence id, step)."""

    def __init__(self, log, clock):
        self.log, self.clock, self.id = log, clock, len([e for e in log if e[0] == "new"])
        log.append(("new", self.id, clock[0]))

    def record(self, stream):
        self.recorded_at = self.clock[0]
        self.log.append(("record", self.id, self.clock[0]))

    def synchronize(self):
        self.log.append(("wait", self.id, self.recorded_at))


def _drive_ring(slots, steps):
    log, clock = [], [0]
    ring = ShadowRing(slots, lambda: _FakeFence(log, clock))
    used = []
    for k in range(steps):
        clock[0] = k
        slot = ring.acquire()
        used.append(slot)
        ring.release(slot, stream=None)
    return used, log


def test_steps_take_shadow_slots_in_turn():
    used, _ = _drive_ring(3, 7)
    assert used == [0, 1, 2, 0, 1, 2, 0]


def test_a_step_waits_only_on_the_replay_that_last_read_its_slot():
    slots = 3
    used, log = _drive_ring(slots, 10)
    waits = [(fence, recorded) for what, fence, recorded in log if what == "wait"]
    # Step k waits once, on the fence of slot k % 3, recorded at step k - 3; the first
    # round finds every slot unused and waits on nothing.
    assert [recorded for _, recorded in waits] == list(range(0, 10 - slots))
    fence_of_slot = {}
    for what, fence, step in log:
        if what == "record":
            fence_of_slot.setdefault(used[step], fence)
            assert fence_of_slot[used[step]] == fence, "a slot changed its fence"
    assert len(fence_of_slot) == slots
    assert [fence for fence, _ in waits] == [fence_of_slot[k % slots] for k in range(slots, 10)]


def test_one_shadow_slot_is_a_plain_fence_on_the_previous_step():
    _, log = _drive_ring(1, 5)
    assert [step for what, _, step in log if what == "wait"] == [0, 1, 2, 3]


def test_a_slot_waited_on_is_not_waited_on_again_until_recorded():
    log, clock = [], [0]
    ring = ShadowRing(1, lambda: _FakeFence(log, clock))
    ring.release(ring.acquire(), stream=None)
    ring.acquire()  # waits; the step then fails before its replay, so nothing is recorded
    ring.acquire()
    assert [what for what, _, _ in log] == ["new", "record", "wait"]


def test_ring_without_fences_only_rotates():
    ring = ShadowRing(2, None)
    assert not ring.fenced
    assert [ring.acquire() for _ in range(3)] == [0, 1, 0]
    ring.release(0, stream=None)  # nothing to record on a CPU device


def test_each_step_writes_the_next_shadow_slot():
    runner, _ = _runner(GraphPoolManager("cpu"), shadow_slots=3)
    sent = [torch.full((2, HIDDEN), float(k)) for k in range(4)]
    for k, x in enumerate(sent):
        runner.run_eager(2, x=x, pos=torch.zeros(2))
        assert torch.equal(runner.shadows["x"][:2], x)
    # Slot 0 was reused by step 3; slots 1 and 2 still hold steps 1 and 2.
    assert [runner.shadows_at(s)["x"][0, 0].item() for s in range(3)] == [3.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="shadow slot"):
        runner.shadows_at(3)


def test_shadow_bytes_count_every_slot():
    manager = GraphPoolManager("cpu")
    one, _ = _runner(manager, "one", shadow_slots=1)
    four, _ = _runner(manager, "four", shadow_slots=4)
    assert one.shadow_nbytes == one.static_nbytes == 8 * HIDDEN * 4 + 8 * 4
    assert four.shadow_nbytes == 4 * one.shadow_nbytes
    assert four.static_nbytes == one.static_nbytes  # device buffers are shared by the slots


def test_runner_without_host_inputs_uses_one_slot():
    runner = GraphPoolManager("cpu").runner("dev", lambda b: {"y": b["h"] * 2}, buckets=[4],
                                            inputs=[StaticInput("h", torch.float32, (), source="device")])
    assert runner.shadow_slots == 1 and runner.shadow_nbytes == 0


@pytest.mark.parametrize("slots,error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_shadow_slots_must_be_a_positive_int(slots, error):
    with pytest.raises(error, match="shadow_slots"):
        _runner(GraphPoolManager("cpu"), shadow_slots=slots)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_shadow_padding_stays_correct_when_refills_are_skipped(slots):
    # Padding is refilled only where an earlier step of the slot left rows; random sizes,
    # buckets and write paths (fast, cast, list) must still leave exactly data then padding.
    runner, _ = _runner(GraphPoolManager("cpu"), buckets=(1, 2, 4, 8, 16), shadow_slots=slots)
    gen = torch.Generator().manual_seed(slots)
    for k in range(300):
        n = int(torch.randint(1, 17, (1,), generator=gen))
        bucket = runner.bucket_for(n)
        if k % 7 == 3:
            bucket = 16
        x = torch.randn(n, HIDDEN, generator=gen)
        pos = torch.arange(n, dtype=torch.float32) + k
        if k % 5 == 1:
            pos = pos.to(torch.int32)  # cast: the general write path
        elif k % 11 == 2:
            pos = pos.tolist()
        runner.run_eager(n, bucket=bucket, x=x, pos=pos)
        shadow_x = runner.shadows["x"].reshape(-1)[: bucket * HIDDEN].view(bucket, HIDDEN)
        shadow_pos = runner.shadows["pos"][:bucket]
        assert torch.equal(shadow_x[:n], x) and torch.equal(shadow_x[n:], torch.zeros(bucket - n, HIDDEN)), k
        assert shadow_pos[:n].tolist() == [float(p) for p in range(k, k + n)], k
        assert (shadow_pos[n:] == -1).all(), (k, n, bucket, shadow_pos.tolist())
        assert torch.equal(runner.view("pos", bucket), shadow_pos)


def test_device_input_padding_is_refilled_after_in_place_writes():
    manager = GraphPoolManager("cpu")
    inputs = [StaticInput("x", torch.float32, ()), StaticInput("scale", torch.float32, (), source="device", pad_value=0)]
    runner = manager.runner("scaled", lambda b: {"y": b["x"] * b["scale"]}, buckets=[4], inputs=inputs)
    runner.run_eager(2, x=torch.ones(2), scale=torch.full((2,), 3.0))
    runner.inputs["scale"].fill_(7.0)  # a caller's in-place write reaches the padded rows too
    out = runner.run_eager(2, x=torch.ones(2), scale=torch.full((2,), 3.0))
    assert out["y"].tolist() == [3.0, 3.0]
    assert runner.view("scale", 4).tolist() == [3.0, 3.0, 0.0, 0.0]


# -- outputs kept in the pool -------------------------------------------------------------

def test_outputs_kept_in_the_pool_need_an_owned_pool():
    manager = GraphPoolManager("cpu")
    with pytest.raises(ValueError, match="needs pool='own', got pool='shared'"):
        _runner(manager, last_outputs="in_pool")
    manager.ledger.register(POOL_B, "handed in", auto_release=False)
    with pytest.raises(ValueError, match="needs pool='own', got a handed-in pool"):
        _runner(manager, pool=POOL_B, last_outputs="in_pool")
    with pytest.raises(ValueError, match="'copy' or 'in_pool'"):
        _runner(manager, last_outputs="keep")


def test_outputs_kept_in_the_pool_need_a_captured_last_piece():
    with pytest.raises(ValueError, match="captured last piece.*'tail'"):
        def tail(b):
            return None
        GraphPoolManager("cpu").runner("bad", [lambda b: {"y": b["x"]}, EagerPiece(tail)], buckets=[2],
                                       inputs=[StaticInput("x", torch.float32, ())], pool="own",
                                       last_outputs="in_pool")


def test_last_piece_outputs_kept_in_the_pool_have_no_static_buffer():
    manager = GraphPoolManager("cpu")

    def first(b):
        return {"h": b["x"] + 1}

    def second(b):
        return {"y": b["h"] * 2}

    runner = manager.runner("kept", [first, second], buckets=[2, 4], pool="own", last_outputs="in_pool",
                            inputs=[StaticInput("x", torch.float32, ())])
    out = runner.run_eager(3, x=torch.tensor([1.0, 2.0, 3.0]))
    assert out["h"].tolist() == [2.0, 3.0, 4.0] and out["y"].tolist() == [4.0, 6.0, 8.0]
    # h (not the last piece) is static; y is not, so it has no view and costs no static bytes.
    assert list(runner.outputs) == ["h"]
    assert runner.static_nbytes == 4 * 4 + 4 * 4
    assert runner.view("h", 4).shape == (4,)
    with pytest.raises(ValueError, match="'y' is kept in the graph pool.*step\\(\\)"):
        runner.view("y", 4)


# -- pool ownership ---------------------------------------------------------------------

POOL_A = (0, 101)
POOL_B = (0, 102)


def test_ledger_records_which_graphs_hold_a_pool():
    ledger = PoolLedger()
    ledger.register(POOL_A, "manager", auto_release=True)
    ledger.acquire(POOL_A, ("decode", 8, 0))
    ledger.acquire(POOL_A, ("decode", 4, 0))
    assert ledger.holders(POOL_A) == (("decode", 4, 0), ("decode", 8, 0))
    assert ledger.pools() == {POOL_A: (("decode", 4, 0), ("decode", 8, 0))}


def test_releasing_a_pool_still_held_raises_naming_the_holders():
    ledger = PoolLedger()
    ledger.register(POOL_A, "manager", auto_release=False)
    ledger.acquire(POOL_A, ("decode", 8, 1))
    with pytest.raises(PoolInUseError, match="runner 'decode' bucket 8 piece 1"):
        ledger.release(POOL_A)
    assert not ledger.is_released(POOL_A)


def test_owned_pool_is_released_when_its_last_graph_goes():
    ledger = PoolLedger()
    ledger.register(POOL_A, "manager", auto_release=True)
    ledger.acquire(POOL_A, ("decode", 8, 0))
    ledger.acquire(POOL_A, ("prefill", 64, 0))
    ledger.drop(POOL_A, ("decode", 8, 0))
    assert not ledger.is_released(POOL_A)
    ledger.drop(POOL_A, ("prefill", 64, 0))
    assert ledger.is_released(POOL_A) and ledger.pools() == {}


def test_handed_in_pool_stays_usable_until_released_explicitly():
    ledger = PoolLedger()
    ledger.register(POOL_B, "handed in", auto_release=False)
    ledger.acquire(POOL_B, ("decode", 8, 0))
    ledger.drop(POOL_B, ("decode", 8, 0))
    assert not ledger.is_released(POOL_B)
    ledger.acquire(POOL_B, ("decode", 8, 0))
    ledger.drop(POOL_B, ("decode", 8, 0))
    ledger.release(POOL_B)
    assert ledger.is_released(POOL_B)


def test_capturing_into_a_released_pool_raises():
    ledger = PoolLedger()
    ledger.register(POOL_A, "manager", auto_release=False)
    ledger.release(POOL_A)
    with pytest.raises(PoolReleasedError, match=r"\(0, 101\) was released"):
        ledger.acquire(POOL_A, ("decode", 8, 0))
    with pytest.raises(PoolReleasedError):
        ledger.register(POOL_A, "again", auto_release=True)


def test_dropping_a_graph_that_does_not_hold_the_pool_raises():
    ledger = PoolLedger()
    ledger.register(POOL_A, "manager", auto_release=True)
    with pytest.raises(ValueError, match="does not hold"):
        ledger.drop(POOL_A, ("decode", 8, 0))


def test_runner_with_released_handed_in_pool_is_refused():
    manager = GraphPoolManager("cpu")
    manager.ledger.register(POOL_B, "handed in", auto_release=False)
    manager.release_pool(POOL_B)
    with pytest.raises(PoolReleasedError, match=r"\(0, 102\)"):
        _runner(manager, pool=POOL_B)


@pytest.mark.parametrize("pool,error", [("mine", ValueError), ((1, 2, 3), ValueError), (("a", "b"), TypeError),
                                        (7, TypeError)])
def test_runner_rejects_a_bad_pool_spec(pool, error):
    with pytest.raises(error, match="pool"):
        _runner(GraphPoolManager("cpu"), pool=pool)


# -- agreement without distributed -----------------------------------------------------

def test_agree_without_distributed_returns_the_local_choice():
    manager = GraphPoolManager("cpu")
    assert manager.agree(16, "piecewise") == (16, "piecewise")
    assert manager.agree(None, 0) == (None, 0)


def test_agree_with_a_runner_pads_the_choice_to_the_runners_buckets():
    manager = GraphPoolManager("cpu")
    runner, _ = _runner(manager)
    assert manager.agree(3, "full", runner=runner) == (4, "full")
    assert manager.agree(9, "full", runner=runner) == (None, "full")  # above its largest bucket: eager
    other, _ = _runner(GraphPoolManager("cpu"))
    with pytest.raises(ValueError, match="an open runner of this manager"):
        manager.agree(3, "full", runner=other)


def test_agree_over_nccl_exchanges_on_the_managers_device_not_the_current_one(monkeypatch):
    # A rank whose graphs live on cuda:1 and whose current device is still 0 (it never called
    # set_device) sent its choice from cuda:0: NCCL saw two ranks on one device, or the wrong
    # communicator. The NCCL group and every device tensor are stood in for: no GPU is needed.
    import torch.distributed as dist

    used = []
    real_tensor = torch.tensor

    def tensor(data, *, dtype=None, device=None):
        used.append(torch.device(device))
        return real_tensor(data, dtype=dtype)  # on the host, for the stand-in collectives

    def all_gather(out, mine, group=None):
        for i, t in enumerate(out):
            t.copy_(mine)
            if i == 1:
                t[0] = 16  # the other rank chose bucket 16

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_gather", all_gather)
    manager = GraphPoolManager("cuda:1")
    assert manager.agree(8, "full") == (16, "full")  # the larger choice, as every rank's rows fit it
    assert used and all(d == torch.device("cuda", 1) for d in used), used


def test_agree_rejects_unknown_tier_and_bad_bucket():
    manager = GraphPoolManager("cpu")
    with pytest.raises(ValueError, match="'turbo'"):
        manager.agree(16, "turbo")
    with pytest.raises(ValueError, match="tier code 3 is past"):
        manager.agree(16, 3)
    with pytest.raises(ValueError, match="bucket"):
        manager.agree(0, "full")


def test_graphs_module_imports_without_touching_cuda(fresh):
    out = fresh("""
        import torch
        import torch_budget.graphs
        print(torch.cuda.is_initialized())
    """)
    assert out.strip() == "False"


def test_an_out_of_memory_error_allocating_a_static_output_leaves_the_next_step_to_allocate_it(monkeypatch):
    import torch_budget.graphs.outputs as outputs

    class RefusingOnce:
        refused = False

        def __getattr__(self, name):
            return getattr(torch, name)

        def zeros(self, *args, **kwargs):
            if not RefusingOnce.refused:
                RefusingOnce.refused = True
                raise torch.OutOfMemoryError("out of memory (refused once)")
            return torch.zeros(*args, **kwargs)

    monkeypatch.setattr(outputs, "torch", RefusingOnce())
    runner, weight = _runner(GraphPoolManager("cpu"), buckets=(2, 4))
    x, pos = torch.ones(2, HIDDEN), torch.zeros(2)
    with pytest.raises(torch.OutOfMemoryError):
        runner.run_eager(2, x=x, pos=pos)
    out = runner.run_eager(2, x=x, pos=pos)  # it raised KeyError: the output was recorded, its buffer not
    assert torch.allclose(out["y"], x @ weight)


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: a capture runs its pieces once, a replay does nothing."""

    def replay(self):
        pass

    def reset(self):
        pass


class _FakeStream:
    def wait_stream(self, other):
        pass


def _fake_cuda(monkeypatch, manager, *runners):
    """Lets `runners` warm up, capture and step on the CPU: the device reads as cuda:0, and torch's
    streams, graphs and pool handles are stand-ins (a fresh pool id per handle, as torch gives).
    Warm-up and capture_bucket are the real ones, so the pool ledger is the real one too. Returns
    an object whose `now` is True while a capture runs."""
    import contextlib
    import itertools
    import types

    import torch_budget.graphs.manager as manager_module

    cuda = torch.device("cuda", 0)
    manager.device = cuda
    for runner in runners:
        object.__setattr__(runner, "device", cuda)
    ids = itertools.count(1000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(ids)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    capturing = types.SimpleNamespace(now=False)

    @contextlib.contextmanager
    def graph(graph, pool=None, stream=None):
        capturing.now = True
        try:
            yield
        finally:
            capturing.now = False

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(manager_module, "_CAPTURE_STREAMS", {})
    return capturing


@pytest.mark.parametrize("pool", ["shared", "own"])
def test_a_bucket_whose_second_piece_fails_to_capture_leaves_the_smaller_buckets_captured(monkeypatch, pool):
    # The failed bucket's undo dropped the holder of its first piece, the pool's only one: the pool released
    # itself, and every smaller bucket then failed capturing into a released pool (captured was ()).
    def first(b):
        return {"h": b["x"] + 1}

    def second(b):
        if capturing.now and b.bucket == 8:
            raise torch.OutOfMemoryError("out of memory capturing bucket 8")
        return {"y": b["h"] * 2}

    manager = GraphPoolManager("cpu")
    runner = manager.runner("g", [first, second], buckets=(2, 4, 8), pool=pool,
                            inputs=[StaticInput("x", torch.float32, ())])
    capturing = _fake_cuda(monkeypatch, manager, runner)
    with pytest.raises(torch.OutOfMemoryError) as e:
        runner.capture()
    assert "bucket(s) [8] not captured (captured: (2, 4))" in "".join(getattr(e.value, "__notes__", ()))
    assert runner.captured == (2, 4) and not manager.ledger.is_released(runner.pool)
    assert manager.ledger.holders(runner.pool) == tuple(("g", b, p) for b in (2, 4) for p in (0, 1))
    runner.close()
    assert manager.pools() == {}


def test_steps_at_explicit_buckets_keep_the_staging_and_result_caches_bounded(monkeypatch):
    # Both caches kept an entry per (bucket, rows) seen; with buckets agreed between ranks the rows can be
    # anything up to the bucket: about 40,000 pairs at BucketRule(1024), each holding views of the buffers.
    import random

    from torch_budget.graphs.staging import STEP_CACHE_ENTRIES

    manager = GraphPoolManager("cpu")
    runner = manager.runner("g", lambda b: {"y": b["x"] * 2}, buckets=BucketRule(1024),
                            inputs=[StaticInput("x", torch.float32, ())])
    _fake_cuda(monkeypatch, manager, runner)
    runner.capture()
    rng = random.Random(0)
    for _ in range(2000):
        bucket = rng.choice(runner.buckets)
        n = rng.randint(1, bucket)
        assert runner.run_eager(n, bucket=bucket, x=torch.ones(n))["y"].shape == (n,)
        assert runner.step(n, bucket=bucket, x=torch.ones(n))["y"].shape == (n,)
    assert STEP_CACHE_ENTRIES <= 1024
    assert len(runner._ins._copies_cache) <= STEP_CACHE_ENTRIES
    assert len(runner._result_cache) <= STEP_CACHE_ENTRIES


def test_a_bucket_that_fails_to_capture_leaves_the_others_captured_and_serves_no_step(monkeypatch):
    import torch_budget.graphs.runner as runner_module

    manager = GraphPoolManager("cpu")
    runner, _ = _runner(manager, buckets=(2, 4, 8))
    manager.device = torch.device("cuda", 0)  # capture's path, with the device faked
    object.__setattr__(runner, "device", manager.device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # The stand-in captures hold no pool, so each capture() ends by releasing its pool: a fresh id per handle,
    # as torch gives.
    ids = iter(range(99, 200))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(ids)))
    monkeypatch.setattr(manager, "capture_stream", lambda: None)
    monkeypatch.setattr(runner, "_warm_up", lambda bucket, stream: None)
    refuse = {8}

    def capture_bucket(bucket, *args, **kwargs):
        if bucket in refuse:
            raise torch.OutOfMemoryError(f"out of memory capturing bucket {bucket}")
        return object()

    monkeypatch.setattr(runner_module, "capture_bucket", capture_bucket)
    with pytest.raises(torch.OutOfMemoryError) as e:
        runner.capture()  # the largest went first and failed: none was captured, none could be released
    assert "bucket(s) [8] not captured (captured: (2, 4))" in "".join(getattr(e.value, "__notes__", ()))
    assert runner.captured == (2, 4) and runner.buckets == (2, 4)
    assert runner.bucket_for(3) == 4 and runner.bucket_for(7) is None  # above the largest captured: eager
    refuse.clear()
    runner.capture()  # tries the failed one again
    assert runner.captured == (2, 4, 8) and runner.bucket_for(7) == 8


def test_a_warm_up_whose_piece_raises_still_joins_the_capture_stream(monkeypatch):
    import contextlib

    joins = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            joins.append((self.name, other.name))

    def failing(buffers):
        raise RuntimeError("piece failed")

    runner, _ = _runner(GraphPoolManager("cpu"), buckets=(2,), pieces=failing)
    current = Stream("current")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="piece failed"):
        runner._warm_up(2, Stream("capture"))
    # the next step's writes on the current stream wait for what the warm-up queued
    assert joins == [("capture", "current"), ("current", "capture")]


def test_a_runners_own_pool_is_refused_to_another_runner(monkeypatch):
    # Captured into, a's close raised PoolInUseError and left it half closed, and the manager's close stopped there.
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 77))
    manager = GraphPoolManager("cpu")
    a, _ = _runner(manager, name="a", pool="own")
    a._pool = manager.capture_pool(a)  # what a's first capture does
    with pytest.raises(ValueError, match=r"graph pool \(0, 77\) is graph runner 'a''s own \(pool='own'\)"):
        _runner(manager, name="b", pool=a.pool)
    _runner(manager, name="c", pool="shared")
    manager.close()
    assert manager.runners == {} and a.closed


def test_a_fixed_dimension_shorter_than_declared_is_refused_not_padded():
    runner, _ = _runner(GraphPoolManager("cpu"), buckets=(2,))
    with pytest.raises(ValueError, match=r"dimension\(s\) \[1\] are declared fixed \(\(8,\)\), so they must be \[8\]"):
        runner.run_eager(2, x=torch.ones(2, HIDDEN - 1), pos=torch.zeros(2))  # it was padded with zeros
    symbolic, _ = _runner(GraphPoolManager("cpu"), buckets=(2,), axes={"seq": 4},
                          inputs=[StaticInput("x", torch.float32, ("seq",))], pieces=lambda b: {"y": b["x"] * 1})
    assert symbolic.run_eager(2, x=torch.ones(2, 3))["y"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]  # padded


def test_an_output_a_piece_stops_returning_is_refused_not_returned_stale():
    def piece(buffers):
        out = {"y": buffers["x"] * 2}
        if buffers["x"][0, 0] > 0:
            out["aux"] = buffers["x"] + 100
        return out

    runner, _ = _runner(GraphPoolManager("cpu"), buckets=(2,), pieces=piece)
    runner.run_eager(2, x=torch.ones(2, HIDDEN), pos=torch.zeros(2))
    with pytest.raises(ValueError, match=r"did not return \['aux'\], which it returned before"):
        runner.run_eager(2, x=-torch.ones(2, HIDDEN), pos=torch.zeros(2))  # it returned the last step's aux


def test_a_single_static_input_not_in_a_list_is_refused_naming_what_inputs_takes():
    with pytest.raises(ValueError, match="inputs must be a list of StaticInput declarations"):
        _runner(GraphPoolManager("cpu"), inputs=StaticInput("x", torch.float32, (HIDDEN,)))


def test_managers_on_two_threads_get_one_capture_stream_per_device(monkeypatch):
    import threading
    import time

    import torch_budget.graphs.manager as manager_module

    class SlowStream:
        def __init__(self, device=None):
            time.sleep(0.05)  # the window in which a second thread made a stream of its own

    monkeypatch.setattr(torch.cuda, "Stream", SlowStream)
    monkeypatch.setattr(manager_module, "_CAPTURE_STREAMS", {})
    got = []
    threads = [threading.Thread(target=lambda: got.append(manager_module._capture_stream(torch.device("cuda", 5))))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] is got[1]


def test_runners_on_two_threads_capture_on_the_shared_stream_one_at_a_time(monkeypatch):
    # Every manager of a device captures on one stream, and nothing kept two threads from warming up or
    # capturing on it at once: each capture would have taken in the other's work.
    import threading
    import time

    guard = threading.Lock()
    running = {"now": 0, "most": 0}

    def piece(b):
        with guard:
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
        time.sleep(0.01)
        with guard:
            running["now"] -= 1
        return {"y": b["x"] * 2}

    managers = [GraphPoolManager("cpu") for _ in range(2)]
    runners = [m.runner("g", piece, buckets=(2, 4), inputs=[StaticInput("x", torch.float32, ())]) for m in managers]
    for manager, runner in zip(managers, runners):
        _fake_cuda(monkeypatch, manager, runner)
    threads = [threading.Thread(target=runner.capture) for runner in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.captured for r in runners] == [(2, 4), (2, 4)]
    assert running["most"] == 1


def test_a_capture_inside_another_runners_capture_is_refused_and_one_with_nothing_to_capture_returns(monkeypatch):
    # The device's capture lock is not reentrant: a piece whose warm-up called another runner's capture()
    # waited for ever on the lock its own thread held.
    manager = GraphPoolManager("cpu")
    refused = []

    def piece(b):
        done.capture()  # nothing pending: returns at once, without the lock
        try:
            later.capture()
        except StateError as e:
            refused.append(str(e))
        return {"y": b["x"] * 2}

    x = [StaticInput("x", torch.float32, ())]
    done = manager.runner("done", lambda b: {"y": b["x"] + 1}, buckets=(2,), inputs=x)
    later = manager.runner("later", lambda b: {"y": b["x"] + 2}, buckets=(2,), inputs=x)
    outer = manager.runner("outer", piece, buckets=(2,), inputs=x)
    _fake_cuda(monkeypatch, manager, done, later, outer)
    done.capture()  # captured: a later capture() has nothing to do
    outer.capture()
    assert outer.captured == (2,) and refused
    assert "inside the warm-up or capture of" in refused[0] and "'outer'" in refused[0]
    later.capture()  # on its own, it captures
    assert later.captured == (2,)


def test_a_step_while_a_tag_is_released_checks_the_static_outputs_too(monkeypatch):
    # Only the pool and the static inputs were checked: a replay writing an output buffer of a released tag
    # would have faulted the context instead of naming the tag.
    import torch_budget.graphs.runner as runner_module

    manager = GraphPoolManager("cpu")
    runner, _ = _runner(manager, buckets=(2, 4))
    _fake_cuda(monkeypatch, manager, runner)
    runner.capture()
    checked = []
    monkeypatch.setattr(runner_module, "any_released", lambda: True)
    monkeypatch.setattr(runner_module, "check_awake", lambda device, pool, tensors: checked.extend(tensors))
    runner.step(3, x=torch.ones(3, HIDDEN), pos=torch.zeros(3))
    storages = {t.untyped_storage().data_ptr() for t in checked}
    buffers = [*runner.inputs.values(), *runner.outputs.values()]
    assert list(runner.outputs) == ["y"]
    assert all(b.untyped_storage().data_ptr() in storages for b in buffers)


def _runner_failing_to_capture(monkeypatch, failing):
    """A runner of buckets 2, 4 and 8 on the CPU whose capture of the buckets in `failing` runs out
    of memory; capture() was called (and raised)."""
    def piece(b):
        if capturing.now and b.bucket in failing:
            raise torch.OutOfMemoryError(f"out of memory capturing bucket {b.bucket}")
        return {"y": b["x"] * 2}

    manager = GraphPoolManager("cpu")
    runner = manager.runner("g", piece, buckets=(2, 4, 8), inputs=[StaticInput("x", torch.float32, ())])
    capturing = _fake_cuda(monkeypatch, manager, runner)
    with pytest.raises(torch.OutOfMemoryError):
        runner.capture()
    return runner


def test_a_runner_whose_buckets_all_failed_to_capture_says_so_not_largest_bucket_none(monkeypatch):
    runner = _runner_failing_to_capture(monkeypatch, (2, 4, 8))
    with pytest.raises(ValueError, match=r"no bucket is captured: buckets \[2, 4, 8\] failed to capture; "
                                         r"capture\(\) again.*or run this step eagerly") as e:
        runner.step(3, x=torch.ones(3))
    assert "largest bucket None" not in str(e.value)  # what it said
    with pytest.raises(ValueError, match=r"no bucket is captured.*call the pieces' forward without the runner"):
        runner.run_eager(3, x=torch.ones(3))


def test_naming_a_bucket_that_failed_or_was_released_says_so_not_that_it_cannot_hold_the_rows(monkeypatch):
    runner = _runner_failing_to_capture(monkeypatch, (8,))
    runner.release(2)
    # it said "bucket 8 cannot hold 3 rows"
    with pytest.raises(ValueError, match=r"bucket 8 failed to capture.*capture\(\) again"):
        runner.step(3, bucket=8, x=torch.ones(3))
    with pytest.raises(ValueError, match=r"bucket 8 failed to capture"):
        runner.run_eager(3, bucket=8, x=torch.ones(3))
    with pytest.raises(ValueError, match=r"bucket 2 was released.*capture\(\) again"):
        runner.step(1, bucket=2, x=torch.ones(1))
    with pytest.raises(ValueError, match=r"16 is not one of its buckets \(2, 4, 8\)"):
        runner.step(3, bucket=16, x=torch.ones(3))
    with pytest.raises(ValueError, match=r"bucket 4 cannot hold 5 rows"):
        runner.step(5, bucket=4, x=torch.ones(5))
