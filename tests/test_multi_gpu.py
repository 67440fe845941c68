"""Two GPUs under install(): current device, peer access, NCCL, sharing tensors of the second
device, memory history per device and torch.compile on the second device.

Each test runs in a fresh process and skips when fewer than two devices are visible.
"""
import pytest
import torch  # importing touches no device: each body calls install() before its first allocation

import torch_budget
from _sharing import share_with_consumer
from torch_budget.units import MiB

pytestmark = pytest.mark.gpu

ROUTES = ("vmm", "pool", "sync")


def _two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


# A string, so that pytest asks at setup: the bodies' processes import this module, and
# nothing may query CUDA there before install().
needs_two = pytest.mark.skipif("not _two_gpus()", reason="needs two CUDA devices")


@needs_two
@pytest.mark.parametrize("route", ROUTES)
def test_current_device_stays_put_whatever_happens_on_the_other_device(fresh, route):
    fresh(current_device_stays_put_whatever_happens_on_the_other_device, route)


def current_device_stays_put_whatever_happens_on_the_other_device(route):
    torch_budget.install(route=route)
    torch.cuda.set_device(0)
    def same(what):
        assert torch.cuda.current_device() == 0, what
        y = torch.empty(10, device="cuda")
        assert y.device.index == 0, (what, y.device)
    a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda:1")
    same("allocation on cuda:1")
    s1 = torch.cuda.Stream(device=1)
    a.record_stream(s1)
    same("record_stream on a cuda:1 stream")
    b = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda:0")
    b.record_stream(s1)                                # a cuda:0 block used by a cuda:1 stream
    same("record_stream across devices")
    del a, b
    same("free")
    torch.cuda.empty_cache()
    same("empty_cache")
    with torch.cuda.device(1):
        c = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        assert c.device.index == 1
    del c
    torch.cuda.synchronize(1)
    torch.empty(1, device="cuda:1")
    same("free from a cuda:1 scope")
    assert torch_budget.stats(1)["allocated"] == torch.cuda.memory_allocated(1)


PEER_KERNEL = r'''
extern "C" __global__ void sum_remote(const float* x, float* out, long long n) {
  float acc = 0.f;
  for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) acc += x[i];
  atomicAdd(out, acc);
}
'''


@needs_two
@pytest.mark.parametrize("route", ROUTES)
def test_copies_both_ways_and_a_kernel_reading_the_peers_memory_are_correct(fresh, route):
    fresh(copies_both_ways_and_a_kernel_reading_the_peers_memory_are_correct, route)


def copies_both_ways_and_a_kernel_reading_the_peers_memory_are_correct(route):
    torch_budget.install(route=route)
    n = 6 * MiB
    x1 = torch.arange(n, device="cuda:1", dtype=torch.float32) % 7
    x0 = x1.to("cuda:0")                               # device 1 -> 0 (enables peer access)
    assert torch.equal(x0.cpu(), x1.cpu())
    back = (x0 * 2).to("cuda:1")                       # device 0 -> 1
    assert torch.equal(back, x1 * 2)
    late = torch.full((n,), 3.0, device="cuda:1")      # mapped after peer access was enabled
    try:
        import cupy as cp
    except ImportError:
        print("no cupy: kernel check skipped")
    else:
        with cp.cuda.Device(0):
            kernel = cp.RawKernel(PEER_KERNEL, "sum_remote")
            for src, expect in ((x1, float(x1.double().sum())), (late, 3.0 * n)):
                out = torch.zeros(1, device="cuda:0")
                torch.cuda.synchronize(1)
                kernel((132,), (256,), (cp.uint64(src.data_ptr()), cp.uint64(out.data_ptr()), cp.int64(n)))
                cp.cuda.Device(0).synchronize()
                assert abs(float(out) - expect) <= 1e-3 * expect, (float(out), expect)
    print("peer ok")


@needs_two
def test_nccl_all_reduce_across_two_processes_under_install(ranks):
    outs = ranks(nccl_all_reduce_across_two_processes_under_install, 2, timeout=300)
    assert all(f"rank {r} ok" in out for r, out in enumerate(outs)), outs


def nccl_all_reduce_across_two_processes_under_install():
    import os
    rank = int(os.environ["RANK"])
    torch_budget.install()
    torch.cuda.set_device(rank)
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=os.environ["TB_INIT_METHOD"], rank=rank, world_size=2)
    x = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    assert float(x[0]) == 3.0 and float(x[-1]) == 3.0, float(x[0])
    dist.barrier()
    dist.destroy_process_group()
    assert torch.cuda.get_allocator_backend() == "torch_budget"
    print("rank", rank, "ok")


@needs_two
def test_tensors_on_the_second_device_are_shared_with_a_consumer_process(fresh):
    out = fresh(tensors_on_the_second_device_are_shared_with_a_consumer_process, timeout=600)
    assert "ipc ok" in out


def tensors_on_the_second_device_are_shared_with_a_consumer_process():
    torch_budget.install()

    def make():
        tensors = {"vmm": torch.full((5 * MiB + 3,), 4, dtype=torch.uint8, device="cuda:1")}
        with torch_budget.region(route="sync"):
            tensors["sync"] = torch.full((4096,), 6, dtype=torch.int32, device="cuda:1")
        fills = {"vmm": 4, "sync": 6}
        return tensors, fills

    def extra():
        assert torch.cuda.current_device() == 0

    share_with_consumer(1, True, make, extra)


@needs_two
def test_history_keeps_a_trace_per_device_and_the_snapshot_names_each_segments_device(fresh):
    out = fresh(history_keeps_a_trace_per_device_and_the_snapshot_names_each_segments_device)
    assert "history per device ok" in out


def history_keeps_a_trace_per_device_and_the_snapshot_names_each_segments_device():
    torch_budget.install()
    torch.cuda.memory._record_memory_history(max_entries=10000)
    a = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda:0")  # noqa: F841  (live in the snapshot)
    b = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda:1")  # noqa: F841
    c = torch.empty(7 * MiB, dtype=torch.uint8, device="cuda:1")
    del c
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap["device_traces"]
    assert len(traces) >= 2, len(traces)
    allocs = [{e["size"] for e in traces[d] if e["action"] == "alloc"} for d in (0, 1)]
    assert 3 * MiB in allocs[0] and 3 * MiB not in allocs[1], allocs
    assert {5 * MiB, 7 * MiB} <= allocs[1] and 5 * MiB not in allocs[0], allocs
    assert any(e["action"] == "free_completed" and e["size"] == 7 * MiB for e in traces[1])
    live = {(s["device"], blk["size"]) for s in snap["segments"] for blk in s["blocks"]
            if blk["state"] == "active_allocated"}
    assert (0, 3 * MiB) in live and (1, 5 * MiB) in live, live
    frames = [blk.get("frames") for s in snap["segments"] if s["device"] == 1 for blk in s["blocks"]
              if blk["state"] == "active_allocated" and blk["size"] == 5 * MiB]
    assert frames and frames[0], "the cuda:1 block has no stack"
    print("history per device ok")


@needs_two
@pytest.mark.graph_trees
def test_reduce_overhead_on_the_second_device_matches_eager(fresh):
    out = fresh(reduce_overhead_on_the_second_device_matches_eager, timeout=600)
    assert "compile on cuda:1 ok" in out


def reduce_overhead_on_the_second_device_matches_eager():
    torch_budget.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128)).to("cuda:1")
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for step in range(12):
            n = (8, 24)[step % 2]
            x = torch.randn(n, 128, device="cuda:1", generator=torch.Generator("cuda:1").manual_seed(step))
            out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
            assert out.device.index == 1 and torch.cuda.current_device() == 0
            out = out.clone()
    pools = {s["device"] for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] != (0, 0)}
    assert pools == {1}, pools                          # the tree's pool lives on the model's device
    print("compile on cuda:1 ok")
