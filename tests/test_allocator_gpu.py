"""torch's own memory calls and CUDA behaviour under torch_budget.install().

Each test runs in a fresh process: install() must precede the first CUDA allocation.
"""
import pytest
import torch  # importing touches no device: each body calls install() before its first allocation
import torch_budget
from torch_budget.units import GiB, MiB

pytestmark = pytest.mark.gpu


def test_torch_memory_calls_report_the_ledger(fresh):
    fresh(torch_memory_calls_report_the_ledger)


def torch_memory_calls_report_the_ledger():
    settings = torch_budget.install()
    assert settings["route"] == "vmm", settings
    x = torch.empty(10 * MiB, dtype=torch.uint8, device="cuda")
    y = torch.empty(3000, dtype=torch.uint8, device="cuda")  # noqa: F841  (stays allocated to the end)
    st = torch_budget.stats()
    assert torch.cuda.memory_allocated() == st["allocated"] == 10 * MiB + 3072
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == st["allocated"]
    assert torch.cuda.memory_stats()["requested_bytes.all.current"] == 10 * MiB + 3000
    assert torch.cuda.memory_reserved() == st["reserved"] >= st["allocated"]
    assert torch.cuda.get_allocator_backend() == "torch_budget"
    del x
    assert torch.cuda.memory_allocated() == 3072
    assert torch.cuda.max_memory_allocated() == 10 * MiB + 3072
    assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == 3072
    assert len(torch.cuda.memory_stats()) > 40
    assert torch.cuda.memory_stats()["max_split_size"] == -1  # torch's default, no limit, as native says
    a, b = (torch.empty(256 * 1024, dtype=torch.uint8, device="cuda") for _ in range(2))  # small, side by side
    del a  # a free block carved from a segment that b keeps: an inactive split of the small pool
    s = torch.cuda.memory_stats()
    assert s["inactive_split.small_pool.current"] >= 1, s
    for key in ("inactive_split", "inactive_split_bytes"):
        assert s[f"{key}.all.current"] == s[f"{key}.small_pool.current"] + s[f"{key}.large_pool.current"], s
    assert s["inactive_split_bytes.all.current"] <= torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    del b
    assert st["by_route"]["vmm"]["allocated"] == st["allocated"]


@pytest.mark.exclusive
def test_empty_cache_returns_freed_memory_to_the_device(fresh):
    fresh(empty_cache_returns_freed_memory_to_the_device)


def empty_cache_returns_freed_memory_to_the_device():
    torch_budget.install()
    chunks = [torch.empty(1 * GiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    del chunks
    before, _ = torch.cuda.mem_get_info()
    torch.cuda.empty_cache()
    after, _ = torch.cuda.mem_get_info()
    gained = after - before
    assert gained >= 0.99 * 8 * GiB, gained / GiB
    assert torch.cuda.memory_reserved() < 8 * MiB


def test_budget_exceeded_raises_out_of_memory_then_allocation_works_again(fresh):
    fresh(budget_exceeded_raises_out_of_memory_then_allocation_works_again)


def budget_exceeded_raises_out_of_memory_then_allocation_works_again():
    torch_budget.install(budget="2GiB")
    a = torch.empty(1536 * MiB, dtype=torch.uint8, device="cuda")
    try:
        torch.empty(1 * GiB, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        msg = str(e)
    else:
        raise AssertionError("no OutOfMemoryError")
    for part in ("Tried to allocate 1024.00 MiB", "budget of 2.00 GiB", "Allocated 1.50 GiB", "device free", "set_per_process_memory_fraction"):
        assert part in msg, (part, msg)
    assert torch.cuda.memory_stats()["num_ooms"] == 1
    del a
    b = torch.empty(1 * GiB, dtype=torch.uint8, device="cuda")
    b.fill_(3)
    assert int(b[-1]) == 3
    assert torch.cuda.max_memory_reserved() <= 2 * GiB


def test_memory_fraction_becomes_the_budget(fresh):
    fresh(memory_fraction_becomes_the_budget)


def memory_fraction_becomes_the_budget():
    torch_budget.install()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.05)
    assert abs(torch_budget.stats()["budget"] - 0.05 * total) < 2 * MiB
    try:
        torch.empty(int(0.06 * total), dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        pass
    else:
        raise AssertionError("fraction not enforced")
    x = torch.empty(int(0.04 * total), dtype=torch.uint8, device="cuda")  # noqa: F841


def test_block_freed_on_one_stream_is_not_reused_while_another_stream_reads_it(fresh):
    fresh(block_freed_on_one_stream_is_not_reused_while_another_stream_reads_it)


def block_freed_on_one_stream_is_not_reused_while_another_stream_reads_it():
    torch_budget.install()
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    n = 64 * MiB // 4
    for trial in range(5):
        with torch.cuda.stream(producer):
            x = torch.full((n,), float(trial + 1), device="cuda")
        ready = torch.cuda.Event()
        ready.record(producer)
        with torch.cuda.stream(consumer):
            consumer.wait_event(ready)
            torch.cuda._sleep(50_000_000)          # the consumer is slow
            total = x.sum()
        x.record_stream(consumer)
        del x                                        # freed on the producer side right away
        with torch.cuda.stream(producer):
            y = torch.full((n,), -7.0, device="cuda")  # must not land on x's memory yet
        torch.cuda.synchronize()
        assert float(total) == float(trial + 1) * n, (trial, float(total))
        del y


def test_every_route_serves_torch(fresh):
    for route in ("vmm", "pool", "sync"):
        fresh(every_route_serves_torch, route)


def every_route_serves_torch(route):
    torch_budget.install(route=route)
    xs = [torch.randn(s, device="cuda") for s in (10, 1000, 300_000, 5_000_000)]
    ys = [x * 2 for x in xs]
    assert all(torch.equal(y, x + x) for x, y in zip(xs, ys))
    st = torch_budget.stats()
    assert st["by_route"][route]["allocated"] == st["allocated"] > 0, st["by_route"]
    with torch_budget.region("side", route="sync"):
        z = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    st = torch_budget.stats()
    assert st["by_tag"]["side"]["allocated"] == 4 * MiB
    del xs, ys, z
    torch.cuda.empty_cache()
    assert torch_budget.stats()["allocated"] == 0


def test_cudnn_benchmark_convolution_works(fresh):
    fresh(cudnn_benchmark_convolution_works)


def cudnn_benchmark_convolution_works():
    torch_budget.install(budget=4 * GiB)
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(16, 32, 3).cuda()
    x = torch.randn(8, 16, 64, 64, device="cuda")
    cached = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    del cached  # something cached, far less than the budget's room
    out = conv(x)
    # cacheInfo told cuDNN what one allocation gets within the budget (Note [What cacheInfo tells]):
    # the workspace it then allocated for its plans never failed.
    assert torch.cuda.memory_stats()["num_ooms"] == 0 and torch.cuda.memory_stats()["num_alloc_retries"] == 0
    torch.backends.cudnn.enabled = False
    ref = conv(x)
    assert torch.allclose(out, ref, rtol=1e-2, atol=1e-2)


def test_memory_snapshot_describes_our_segments(fresh):
    fresh(memory_snapshot_describes_our_segments)


def memory_snapshot_describes_our_segments():
    torch_budget.install()
    xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 5 * MiB, 40 * MiB)]  # noqa: F841  (live in the snapshot)
    snap = torch.cuda.memory_snapshot()
    assert snap and all("total_size" in s and "blocks" in s for s in snap)
    assert sum(b["size"] for s in snap for b in s["blocks"] if b["state"] == "active_allocated") == torch.cuda.memory_allocated()


def test_graph_capture_and_replay_under_install(fresh):
    fresh(graph_capture_and_replay_under_install)


def graph_capture_and_replay_under_install():
    torch_budget.install()
    static_in = torch.randn(256, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            (static_in @ w).relu()
    torch.cuda.current_stream().wait_stream(s)
    g1 = torch.cuda.CUDAGraph()
    # Capturing on the warmed-up stream keeps cuBLAS's per-stream workspace out of the pool.
    with torch.cuda.graph(g1, stream=s):
        out1 = (static_in @ w).relu() + 1
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=g1.pool(), stream=s):
        out2 = out1 * 2
    assert torch_budget.stats()["graph_pools"] > 0
    for _ in range(3):
        static_in.copy_(torch.randn(256, 256, device="cuda"))
        g1.replay(); g2.replay()
        ref = ((static_in @ w).relu() + 1) * 2
        torch.cuda.synchronize()
        assert torch.allclose(out2, ref, rtol=1e-3, atol=1e-3)
    del out1, out2
    g1.reset(); g2.reset()
    assert torch_budget.stats()["graph_pools"] == 0, torch_budget.stats()["graph_pools"]


def test_install_after_cuda_was_used_says_to_call_it_first(fresh):
    fresh(install_after_cuda_was_used_says_to_call_it_first)


def install_after_cuda_was_used_says_to_call_it_first():
    torch.zeros(1, device="cuda")
    try:
        torch_budget.install()
    except RuntimeError as e:
        assert "call torch_budget.install() at process start" in str(e), e
    else:
        raise AssertionError("install() after CUDA init did not raise")


def test_a_failure_in_the_compiled_allocator_arrives_as_a_python_exception(fresh):
    fresh(a_failure_in_the_compiled_allocator_arrives_as_a_python_exception)


def a_failure_in_the_compiled_allocator_arrives_as_a_python_exception():
    torch_budget.install()
    x = torch.empty(1024, device="cuda")
    lib = torch_budget._native.load()
    import ctypes
    try:
        torch_budget._native.check(lib, lib.tb_free_checked(ctypes.c_void_p(x.data_ptr() + 4096 * 1024)))
    except ValueError as e:
        assert "not allocated by torch_budget" in str(e)
    else:
        raise AssertionError("no exception")
    try:
        torch.cuda.caching_allocator_delete(x.data_ptr() + 512)
    except RuntimeError as e:
        assert "not allocated by torch_budget" in str(e), e
    else:
        raise AssertionError("no exception from raw_delete")
    torch.cuda.synchronize()
    assert float(x.fill_(1).sum()) == 1024


def test_torch_mempool_allocations_land_in_a_private_pool_and_return(fresh):
    fresh(torch_mempool_allocations_land_in_a_private_pool_and_return)


def torch_mempool_allocations_land_in_a_private_pool_and_return():
    torch_budget.install()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(24 * MiB, dtype=torch.uint8, device="cuda")
    y = torch.empty(24 * MiB, dtype=torch.uint8, device="cuda")
    owners = {tuple(s["pool"]) for s in torch_budget.diagnostics.segments() if s["allocated_size"]}
    assert len(owners) == 2 and (0, 0) in owners, owners
    assert torch_budget.stats()["graph_pools"] >= 24 * MiB
    assert pool.use_count() == 1
    del x
    del pool
    assert torch_budget.stats()["graph_pools"] == 0
    del y


def test_absurd_raw_allocation_sizes_raise_and_the_process_lives_on(fresh):
    fresh(absurd_raw_allocation_sizes_raise_and_the_process_lives_on)


def absurd_raw_allocation_sizes_raise_and_the_process_lives_on():
    torch_budget.install()
    for size in (-1, 1 << 62, (1 << 63) - 1):
        try:
            torch.cuda.caching_allocator_alloc(size)
        except Exception as e:  # torch's OutOfMemoryError, or an overflow in its argument parsing
            print(size, type(e).__name__)
        else:
            raise AssertionError(f"caching_allocator_alloc({size}) returned")
    try:
        torch.empty(1 << 62, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        assert "Tried to allocate" in str(e), e
    x = torch.ones(1000, device="cuda")
    assert float(x.sum()) == 1000


@pytest.mark.timeout(1200)
def test_eight_threads_alloc_free_with_record_stream_across_their_streams(fresh):
    for route, iters in (("vmm", 100_000), ("pool", 20_000), ("sync", 20_000)):
        out = fresh(eight_threads_alloc_free_with_record_stream_across_their_streams, route, iters, timeout=600)
        print(out)
        assert f"ROUTE {route} ok" in out


def eight_threads_alloc_free_with_record_stream_across_their_streams(route, iters):
    import faulthandler, random, threading, time
    faulthandler.dump_traceback_later(500, exit=True)   # a hang shows every thread's stack
    start = time.perf_counter()
    torch_budget.install(route=route)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    streams = [torch.cuda.Stream() for _ in range(8)]
    errors, peak_violations, done = [], [], threading.Event()

    def worker(i):
        rng = random.Random(i)
        mine, other = streams[i], streams[(i + 1) % 8]
        try:
            with torch.cuda.stream(mine):
                keep = []
                for k in range(iters):
                    x = torch.empty(rng.choice((512, 4096, 300_000, 2 << 20)), dtype=torch.uint8, device="cuda")
                    if k % 7 == 0:
                        x.record_stream(other)       # the neighbour's stream uses it too
                    if k % 50 == 0:
                        x.fill_(1)
                    keep.append(x)
                    if len(keep) > 16:
                        keep.pop(rng.randrange(len(keep)))
        except BaseException as e:
            errors.append(repr(e))

    def resetter():
        while not done.is_set():
            torch.cuda.reset_peak_memory_stats()
            st = torch.cuda.memory_stats()
            if st["allocated_bytes.all.peak"] < st["allocated_bytes.all.current"]:
                peak_violations.append((st["allocated_bytes.all.peak"], st["allocated_bytes.all.current"]))
            time.sleep(0.0005)  # a pure-Python loop holding the GIL would starve the workers

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    r = threading.Thread(target=resetter)
    r.start()
    [t.start() for t in threads]
    [t.join() for t in threads]
    done.set(); r.join()
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")                    # processes completed record_stream events
    st = torch.cuda.memory_stats()
    assert not errors, errors[:3]
    assert torch.cuda.memory_allocated() == base, (torch.cuda.memory_allocated(), base)
    assert st["active_bytes.all.current"] == st["allocated_bytes.all.current"], st["active_bytes.all.current"]
    assert not peak_violations, peak_violations[:3]
    print(f"ROUTE {route} ok", torch_budget.stats()["by_route"][route]["count"], "allocations in",
          round(time.perf_counter() - start, 1), "s")
