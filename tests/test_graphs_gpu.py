"""GraphPoolManager on a CUDA device: capture, replay, pools, release, shadows.

Each test captures graphs, so each runs in a fresh process (the `fresh` fixture). The
`installed` variants first swap torch's allocator for the compiled shim with
torch_budget.install() and run the same checks; they skip, saying why, when the shim is
not importable or not built.
"""

import sys

import pytest
import torch  # importing touches no device: set_up() in the child makes the first allocation

import torch_budget
from torch_budget.graphs import (EagerPiece, GraphPoolManager, PoolInUseError, PoolReleasedError,
                                 StaticBufferRebindError, StaticInput)
from torch_budget.units import MiB

pytestmark = pytest.mark.gpu

H = 64
# The device and the model's weights, made by set_up() in the child (they live on the device).
DEV = W1 = W2 = None


def set_up(install):
    """What every body runs first: install() for the `installed` variants, then the weights."""
    global DEV, W1, W2
    if install:
        try:
            torch_budget.install()
        except ImportError as exc:
            print(f"SKIP: the compiled allocator extension is not built ({exc})")
            sys.exit(0)
        backend = torch.cuda.get_allocator_backend()
        assert backend != "native", f"install() left torch's allocator in place ({backend})"

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    DEV = torch.device("cuda", torch.cuda.current_device())
    W1 = torch.randn(H, 4 * H, device=DEV) / H ** 0.5
    W2 = torch.randn(4 * H, H, device=DEV) / (4 * H) ** 0.5


def reference(x, pos):
    # Row-wise, so padded rows of a bucket cannot leak into real rows.
    return torch.nn.functional.gelu((x + pos.unsqueeze(-1).to(x.dtype)) @ W1) @ W2


CALLS = [0]


def mlp(buffers):
    CALLS[0] += 1
    return {"y": reference(buffers["x"], buffers["pos"])}


def mlp_inputs():
    return [StaticInput("x", torch.float32, (H,)), StaticInput("pos", torch.int64, ())]


def host_batch(n, gen=None):
    return torch.randn(n, H, generator=gen), torch.randint(0, 1000, (n,), generator=gen)


def check(got, x, pos):
    torch.testing.assert_close(got, reference(x.to(DEV), pos.to(DEV)), rtol=1e-4, atol=1e-4)


def in_child(body, install):
    set_up(install)
    body()
    print("DONE")


def _run(fresh, body, install=False):
    out = fresh(in_child, body, bool(install))
    if out.startswith("SKIP:"):
        pytest.skip(out.strip()[len("SKIP:"):].strip())
    assert out.rstrip().endswith("DONE"), out
    return out


ALLOCATORS = pytest.mark.parametrize("install", [False, True], ids=["native", "installed"])


@ALLOCATORS
def test_replay_matches_eager_for_several_buckets_with_changing_data(fresh, install):
    _run(fresh, replay_matches_eager_for_several_buckets_with_changing_data, install)


def replay_matches_eager_for_several_buckets_with_changing_data():
    manager = GraphPoolManager()
    runner = manager.runner("mlp", mlp, buckets=[1, 2, 4, 8, 16, 32], inputs=mlp_inputs())
    runner.capture()
    assert runner.captured == (1, 2, 4, 8, 16, 32), runner.captured
    calls_after_capture = CALLS[0]

    for n in [1, 3, 8, 17, 32, 5, 2, 32, 9, 16]:
        x, pos = host_batch(n)
        got = runner.step(n, x=x, pos=pos)["y"].clone()
        assert got.shape == (n, H), got.shape
        check(got, x, pos)
        # The same padding through the eager path gives the same rows.
        eager = runner.run_eager(n, x=x, pos=pos)["y"].clone()
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    calls_after_steps = CALLS[0]

    # Replay does not call the Python piece and allocates nothing on the device.
    for n in [7, 30, 1]:
        x, pos = host_batch(n)
        runner.step(n, x=x, pos=pos)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for n in [7, 30, 1, 32, 4]:
        x, pos = host_batch(n)
        runner.step(n, x=x, pos=pos)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    eager_calls = calls_after_steps - calls_after_capture
    assert CALLS[0] - calls_after_steps == 0, "step() ran the piece instead of replaying"
    assert eager_calls == 10, eager_calls

    assert runner.bucket_for(33) is None
    manager.close()
    assert manager.pools() == {}


@ALLOCATORS
def test_pieces_share_one_pool_and_replay_in_order_around_an_eager_piece(fresh, install):
    _run(fresh, pieces_share_one_pool_and_replay_in_order_around_an_eager_piece, install)


def pieces_share_one_pool_and_replay_in_order_around_an_eager_piece():
    def up(b):
        return {"h": torch.nn.functional.gelu((b["x"] + b["pos"].unsqueeze(-1).float()) @ W1)}

    EAGER_CALLS = []

    def sort_rows(b):
        # Stands in for an op that cannot be captured; writes in place, row by row.
        EAGER_CALLS.append(b.bucket)
        torch.sort(b["h"], dim=-1, out=(b["mixed"], b["order"]))

    def down(b):
        return {"y": b["mixed"] @ W2}

    def piecewise_reference(x, pos):
        h = torch.nn.functional.gelu((x + pos.unsqueeze(-1).float()) @ W1)
        return h.sort(dim=-1).values @ W2

    buckets = [2, 8, 32]
    inputs = mlp_inputs() + [StaticInput("mixed", torch.float32, (4 * H,), source="device"),
                             StaticInput("order", torch.int64, (4 * H,), source="device")]
    manager = GraphPoolManager()
    runner = manager.runner("pw", [up, EagerPiece(sort_rows), down], buckets=buckets, inputs=inputs)
    runner.capture()

    pools = manager.pools()
    assert list(pools) == [tuple(runner.pool)], pools
    holders = pools[tuple(runner.pool)]
    assert sorted(holders) == sorted(("pw", b, i) for b in buckets for i in (0, 2)), holders

    # A second "shared" runner joins the same pool; an "own" runner gets its own.
    other = manager.runner("mlp", mlp, buckets=[4, 16], inputs=mlp_inputs())
    other.capture()
    own = manager.runner("own", mlp, buckets=[4], inputs=mlp_inputs(), pool="own")
    own.capture()
    assert tuple(other.pool) == tuple(runner.pool)
    assert tuple(own.pool) != tuple(runner.pool)
    assert len(manager.pools()) == 2

    EAGER_CALLS.clear()
    for n in [5, 2, 32, 11, 1, 8]:
        x, pos = host_batch(n)
        got = runner.step(n, x=x, pos=pos)["y"].clone()
        torch.testing.assert_close(got, piecewise_reference(x.to(DEV), pos.to(DEV)), rtol=1e-4, atol=1e-4)
        # Interleave the runners that share the pool: replays are sequential on one stream.
        x2, pos2 = host_batch(min(n, 16))
        check(other.step(min(n, 16), x=x2, pos=pos2)["y"].clone(), x2, pos2)
        x3, pos3 = host_batch(3)
        check(own.step(3, x=x3, pos=pos3)["y"].clone(), x3, pos3)
    assert EAGER_CALLS == [8, 2, 32, 32, 2, 8], EAGER_CALLS

    # The shared pool outlives one runner and goes with the last.
    runner.close()
    assert len(manager.pools()) == 2
    x, pos = host_batch(16)
    check(other.step(16, x=x, pos=pos)["y"].clone(), x, pos)
    manager.close()
    assert manager.pools() == {}


@ALLOCATORS
def test_runner_captures_into_the_pool_of_an_existing_graph(fresh, install):
    _run(fresh, runner_captures_into_the_pool_of_an_existing_graph, install)


def runner_captures_into_the_pool_of_an_existing_graph():
    static_in = torch.zeros(16, H, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.relu(static_in @ W1)
    torch.cuda.current_stream().wait_stream(side)
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first, stream=side):
        static_out = torch.relu(static_in @ W1)

    manager = GraphPoolManager()
    runner = manager.runner("borrow", mlp, buckets=[4, 16], inputs=mlp_inputs(), pool=first.pool())
    runner.capture()
    assert tuple(runner.pool) == tuple(first.pool())
    assert list(manager.pools()) == [tuple(first.pool())]

    for n in [3, 16, 4, 9]:
        x, pos = host_batch(n)
        check(runner.step(n, x=x, pos=pos)["y"].clone(), x, pos)
        data = torch.randn(16, H, device=DEV)
        static_in.copy_(data)
        first.replay()
        torch.testing.assert_close(static_out, torch.relu(data @ W1), rtol=1e-4, atol=1e-4)

    try:
        manager.release_pool(first.pool())
    except PoolInUseError as exc:
        assert "'borrow'" in str(exc), exc
    else:
        raise AssertionError("releasing a pool held by graphs did not raise")

    runner.close()
    assert manager.pools() == {}, manager.pools()
    manager.release_pool(first.pool())
    try:
        manager.runner("again", mlp, buckets=[4], inputs=mlp_inputs(), pool=first.pool())
    except PoolReleasedError as exc:
        assert str(tuple(first.pool())) in str(exc), exc
    else:
        raise AssertionError("a released pool handle was accepted")

    # The graph that owns the pool in torch's eyes is untouched.
    data = torch.randn(16, H, device=DEV)
    static_in.copy_(data)
    first.replay()
    torch.testing.assert_close(static_out, torch.relu(data @ W1), rtol=1e-4, atol=1e-4)


@ALLOCATORS
def test_close_returns_graph_and_static_memory_to_the_driver(fresh, install):
    _run(fresh, close_returns_graph_and_static_memory_to_the_driver, install)


def close_returns_graph_and_static_memory_to_the_driver():
    HB, FF = 1024, 8192
    W1b = torch.randn(HB, FF, device=DEV) / HB ** 0.5
    W2b = torch.randn(FF, HB, device=DEV) / FF ** 0.5

    def big(b):
        return {"y": torch.nn.functional.gelu(b["x"] @ W1b) @ W2b}

    manager = GraphPoolManager()

    def captured(name):
        r = manager.runner(name, big, buckets=[128, 256, 512], pool="own",
                           inputs=[StaticInput("x", torch.float32, (HB,))])
        r.capture()
        return r

    # A first cycle, and a matmul on this stream, leave behind what outlives any runner
    # (cuBLAS workspaces per stream); measure from there.
    captured("first").close()
    big({"x": torch.randn(8, HB, device=DEV)})
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()

    runner = captured("big")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved() - base
    # The 512-row intermediates (512 x 8192 fp32 = 16 MiB) live in the pool, plus statics.
    assert runner.static_nbytes == 2 * 512 * HB * 4, runner.static_nbytes
    assert held >= 16 * MiB + runner.static_nbytes, held

    # Releasing one bucket leaves the others working; steps of its size pad further up or go eager.
    runner.release(512)
    assert runner.captured == (128, 256) and runner.bucket_for(300) is None
    x = torch.randn(200, HB)
    got = runner.step(200, x=x)["y"].clone()
    torch.testing.assert_close(got, big({"x": x.to(DEV)})["y"], rtol=1e-4, atol=1e-4)
    del got

    runner.close()
    assert manager.pools() == {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_reserved() - base
    assert left <= 2 * MiB, f"held {held / MiB:.1f} MiB while captured, {left / MiB:.1f} MiB left after close"
    print(f"held={held / MiB:.1f}MiB left={left / MiB:.1f}MiB")


@ALLOCATORS
def test_managers_created_captured_and_closed_five_times_leave_reserved_memory_flat(fresh, install):
    _run(fresh, managers_created_captured_and_closed_five_times_leave_reserved_memory_flat, install)


def managers_created_captured_and_closed_five_times_leave_reserved_memory_flat():
    def cycle():
        manager = GraphPoolManager()
        runner = manager.runner("mlp", mlp, buckets=[1, 8, 32], inputs=mlp_inputs())
        runner.capture()
        x, pos = host_batch(5)
        check(runner.step(5, x=x, pos=pos)["y"], x, pos)
        manager.close()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    first = cycle()
    after = [cycle() for _ in range(5)]
    grown = max(after) - first
    assert grown <= 2 * MiB, f"reserved grew by {grown / MiB:.1f} MiB over five manager cycles: {after}"
    print(f"reserved after each cycle: {[round(a / MiB, 1) for a in [first] + after]} MiB")


@ALLOCATORS
def test_rebinding_a_captured_buffer_raises_and_in_place_writes_are_replayed(fresh, install):
    _run(fresh, rebinding_a_captured_buffer_raises_and_in_place_writes_are_replayed, install)


def rebinding_a_captured_buffer_raises_and_in_place_writes_are_replayed():
    def with_bias(b):
        return {"y": reference(b["x"], b["pos"]) + b["bias"]}

    inputs = mlp_inputs() + [StaticInput("bias", torch.float32, (H,), source="device")]
    manager = GraphPoolManager()
    runner = manager.runner("biased", with_bias, buckets=[4, 8], inputs=inputs)
    runner.capture()

    for rebind in (lambda: runner.inputs.__setitem__("bias", torch.ones(8, H, device=DEV)),
                   lambda: setattr(runner, "bias", torch.ones(8, H, device=DEV)),
                   lambda: setattr(runner.inputs, "x", torch.ones(8, H, device=DEV)),
                   lambda: runner.outputs.__setitem__("y", torch.ones(8, H, device=DEV))):
        try:
            rebind()
        except StaticBufferRebindError as exc:
            assert any(f"'{name}'" in str(exc) for name in ("bias", "x", "y")), exc
        else:
            raise AssertionError("rebinding a graph buffer did not raise")

    runner.inputs["bias"].fill_(5.0)
    x, pos = host_batch(6)
    got = runner.step(6, x=x, pos=pos)["y"].clone()
    torch.testing.assert_close(got, reference(x.to(DEV), pos.to(DEV)) + 5.0, rtol=1e-4, atol=1e-4)

    bias = torch.randn(3, H, device=DEV)
    x, pos = host_batch(3)
    got = runner.step(3, x=x, pos=pos, bias=bias)["y"].clone()
    torch.testing.assert_close(got, reference(x.to(DEV), pos.to(DEV)) + bias, rtol=1e-4, atol=1e-4)
    manager.close()


@ALLOCATORS
def test_shadow_ring_is_never_overwritten_under_back_to_back_replays_with_changing_data(fresh, install):
    _run(fresh, shadow_ring_is_never_overwritten_under_back_to_back_replays_with_changing_data, install)


def shadow_ring_is_never_overwritten_under_back_to_back_replays_with_changing_data():
    manager = GraphPoolManager()
    for slots in (1, 2, 3):
        runner = manager.runner(f"ring{slots}", mlp, buckets=[1, 2, 4, 8, 16, 32, 64], inputs=mlp_inputs(),
                                shadow_slots=slots)
        runner.capture()
        assert runner.shadow_slots == slots
        gen = torch.Generator().manual_seed(slots)
        sent, results, ahead, previous = [], [], 0, None
        for k in range(120):
            n = int(torch.randint(1, 65, (1,), generator=gen))
            x, pos = host_batch(n, gen)
            if k % 10 == 0:
                # The device sleeps ~50 ms, far longer than the host takes to stage ten steps:
                # the steps behind it are staged while earlier ones are still queued, so
                # without the ring's fences a pinned shadow would be overwritten before an
                # earlier replay's captured copy read it.
                torch.cuda._sleep(100_000_000)
            # Every tenth step runs eagerly: its non-blocking copies read a slot too.
            out = runner.run_eager(n, x=x, pos=pos) if k % 10 == 9 else runner.step(n, x=x, pos=pos)
            results.append(out["y"].clone())
            sent.append((x, pos))
            # Was the previous step still queued when this one had written its slot?
            if previous is not None and not previous.query():
                ahead += 1
            elif slots > 1 and k % 10 == 1:
                raise AssertionError(f"shadow_slots={slots}: step {k} was staged after the device caught up")
            previous = torch.cuda.Event()
            previous.record()
        torch.cuda.synchronize()
        for i, ((x, pos), got) in enumerate(zip(sent, results)):
            try:
                check(got, x, pos)
            except AssertionError as exc:
                raise AssertionError(f"shadow_slots={slots}: step {i} computed on other data than it was given") from exc
        print(f"shadow_slots={slots}: host ahead of the device on {ahead} of 119 steps")
        runner.close()
    manager.close()
    assert manager.pools() == {}


@ALLOCATORS
def test_outputs_kept_in_an_owned_pool_match_eager_and_stay_apart_from_other_runners(fresh, install):
    _run(fresh, outputs_kept_in_an_owned_pool_match_eager_and_stay_apart_from_other_runners, install)


def outputs_kept_in_an_owned_pool_match_eager_and_stay_apart_from_other_runners():
    def up(b):
        return {"h": torch.nn.functional.gelu((b["x"] + b["pos"].unsqueeze(-1).to(b["x"].dtype)) @ W1)}

    def down(b):
        return {"y": b["h"] @ W2}

    buckets = [4, 16, 64]
    manager = GraphPoolManager()
    single = manager.runner("single", mlp, buckets=buckets, inputs=mlp_inputs(), pool="own",
                            last_outputs="in_pool")
    split = manager.runner("split", [up, down], buckets=buckets, inputs=mlp_inputs(), pool="own",
                           last_outputs="in_pool", shadow_slots=3)
    copied = manager.runner("copied", mlp, buckets=buckets, inputs=mlp_inputs())
    for runner in (single, split, copied):
        runner.capture()
    assert list(single.outputs) == [] and list(split.outputs) == ["h"] and list(copied.outputs) == ["y"]
    assert len({tuple(single.pool), tuple(split.pool), tuple(copied.pool)}) == 3

    # No other runner may capture into a pool that keeps outputs.
    try:
        manager.runner("intruder", mlp, buckets=[4], inputs=mlp_inputs(), pool=single.pool)
    except ValueError as exc:
        assert "'single'" in str(exc), exc
    else:
        raise AssertionError("a runner was allowed into a pool whose outputs are kept there")

    statics = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
               for r in (single, split, copied) for t in list(r.outputs.values()) + list(r.inputs.values())]
    gen = torch.Generator().manual_seed(5)
    busy = torch.randn(1024, 1024, device=DEV)
    addresses = {"single": {}, "split": {}}
    sent, results = [], []
    for k in range(120):
        n = int(torch.randint(1, 65, (1,), generator=gen))
        x, pos = host_batch(n, gen)
        busy @ busy
        # Three runners in turn; each one's outputs must survive the others' replays.
        a = single.step(n, x=x, pos=pos)["y"]
        b = split.step(n, x=x, pos=pos)["y"]
        c = copied.step(n, x=x, pos=pos)["y"]
        results.append((a.clone(), b.clone(), c.clone()))
        sent.append((x, pos))
        bucket = single.bucket_for(n)
        addresses["single"].setdefault(bucket, set()).add(a.data_ptr())
        addresses["split"].setdefault(bucket, set()).add(b.data_ptr())
        for ptr in (a.data_ptr(), b.data_ptr()):
            assert not any(lo <= ptr < hi for lo, hi in statics), "a kept output lies in a static buffer"
    torch.cuda.synchronize()
    for i, ((x, pos), outs) in enumerate(zip(sent, results)):
        for name, got in zip(("single", "split", "copied"), outs):
            try:
                check(got, x, pos)
            except AssertionError as exc:
                raise AssertionError(f"runner {name}: step {i} is wrong") from exc
    # A single-piece runner keeps its outputs once per bucket and slot; the last piece of a
    # split runner is captured once per bucket, whatever the slot.
    assert all(1 <= len(p) <= 2 for p in addresses["single"].values()), addresses["single"]
    assert all(len(p) == 1 for p in addresses["split"].values()), addresses["split"]

    # Replays allocate nothing, kept outputs included.
    allocated = torch.cuda.memory_allocated()
    for n in [3, 64, 17, 4, 40, 1, 16, 64]:
        x, pos = host_batch(n)
        for runner in (single, split, copied):
            runner.step(n, x=x, pos=pos)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated, "steps allocated device memory"

    manager.close()
    assert manager.pools() == {}
