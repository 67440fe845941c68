"""Two GPUs in one process under install(): current device, peer access, NCCL.

Each test runs in a fresh process and skips when fewer than two devices are visible.
"""
import pytest

pytestmark = pytest.mark.gpu

ROUTES = ("vmm", "pool", "sync")


def _two_gpus():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


needs_two = pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices")

PRELUDE = """
import torch, torch_budget
MiB = 1 << 20
"""


@needs_two
@pytest.mark.parametrize("route", ROUTES)
def test_current_device_stays_put_whatever_happens_on_the_other_device(fresh, route):
    fresh(PRELUDE + f"""
torch_budget.install(route="{route}")
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
""")


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
    fresh(PRELUDE + f"""
torch_budget.install(route="{route}")
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
        kernel = cp.RawKernel({PEER_KERNEL!r}, "sum_remote")
        for src, expect in ((x1, float(x1.double().sum())), (late, 3.0 * n)):
            out = torch.zeros(1, device="cuda:0")
            torch.cuda.synchronize(1)
            kernel((132,), (256,), (cp.uint64(src.data_ptr()), cp.uint64(out.data_ptr()), cp.int64(n)))
            cp.cuda.Device(0).synchronize()
            assert abs(float(out) - expect) <= 1e-3 * expect, (float(out), expect)
print("peer ok")
""")


@needs_two
def test_nccl_all_reduce_across_two_processes_under_install(ranks):
    outs = ranks("""
import os, torch, torch_budget
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
""", 2, timeout=300)
    assert all(f"rank {r} ok" in out for r, out in enumerate(outs)), outs
