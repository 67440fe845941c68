"""Sleep and wake on a CUDA device: tagged memory goes back to the driver and returns intact.

Each test runs in a fresh process: install() must precede the first CUDA allocation. Tests
that compare device-wide free memory (torch.cuda.mem_get_info) are marked `exclusive`.
"""
import pytest
import torch  # importing touches no device: each body calls install() before its first allocation
import torch_budget
from torch_budget.units import MiB

pytestmark = pytest.mark.gpu


def make(sizes, tag, seed):
    # Tensors of `sizes` bytes under `tag` (None: untagged), filled with random bytes.
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch_budget.region(tag):
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    for t in tensors:
        t.random_(generator=gen)
    torch.cuda.synchronize()
    return tensors


def snapshot(tensors):
    return [t.cpu() for t in tensors]


def assert_same(tensors, refs, what):
    bad = [i for i, (t, r) in enumerate(zip(tensors, refs)) if not torch.equal(t.cpu(), r)]
    assert not bad, f"{what}: tensors {bad} (of {len(refs)}) differ from their expected bytes"


def state(tag):
    return torch_budget.sleep.tag_states()[tag]


def free_bytes():
    return torch.cuda.mem_get_info()[0]


def reserved():
    return torch_budget.stats()["reserved"]


WEIGHT_SIZES = [1000, 2 * MiB, 3 * MiB + 4096, 8 * MiB, 17 * MiB + 8, 64 * MiB, 5 * MiB]


def test_twenty_cycles_keep_pinned_weights_bitwise_and_zero_memset_kv(fresh):
    out = fresh(twenty_cycles_keep_pinned_weights_bitwise_and_zero_memset_kv)
    assert "CYCLES 20" in out


def twenty_cycles_keep_pinned_weights_bitwise_and_zero_memset_kv():
    torch_budget.install()
    assert torch_budget.release is torch_budget.sleep.release
    W_SIZES = WEIGHT_SIZES
    weights = make(W_SIZES, "weights", 1)
    kv = make([32 * MiB, 48 * MiB + 4096], "kv", 2)
    other = make([4 * MiB, 3000], None, 3)            # untagged: never released
    ref, other_ref = snapshot(weights), snapshot(other)
    w_resident, kv_resident = state("weights")["resident"], state("kv")["resident"]
    assert w_resident >= sum(W_SIZES), (w_resident, sum(W_SIZES))
    assert torch_budget.sleep.reserve_host_pool(w_resident) >= w_resident
    for cycle in range(20):
        kv_backup = ("none", "memset")[cycle % 2]
        for t in kv:
            t.fill_(cycle + 1)                         # non-zero, so zeros after memset mean something
        r = torch_budget.release("weights", backup="pinned")
        assert r["tags"] == ["weights"] and r["bytes"] == w_resident, (cycle, r, w_resident)
        assert sum(W_SIZES) <= r["backup_bytes"] <= w_resident, (cycle, r)
        w_backup = r["backup_bytes"]
        r = torch_budget.release(["kv"], backup=kv_backup)
        assert r["bytes"] == kv_resident and r["backup_bytes"] == 0, (cycle, kv_backup, r, kv_resident)
        st = torch_budget.sleep.tag_states(device=0)
        expect_w = {"state": "released", "resident": 0, "released": w_resident, "backup": "pinned",
                    "backup_bytes": w_backup, "retained": False}
        assert st["weights"] == expect_w, (cycle, st["weights"], expect_w)
        expect_kv = {"state": "released", "resident": 0, "released": kv_resident, "backup": kv_backup,
                     "backup_bytes": 0, "retained": False}
        assert st["kv"] == expect_kv, (cycle, st["kv"], expect_kv)
        assert torch_budget.sleep.released_tags() == {"weights": "pinned", "kv": kv_backup}
        assert torch_budget.sleep.host_pool_stats()["used"] >= w_backup, torch_budget.sleep.host_pool_stats()
        assert_same(other, other_ref, f"cycle {cycle}: untagged memory while the tags sleep")
        other[0].add_(1); other_ref[0].add_(1)          # and it stays usable
        r = torch_budget.restore(["weights", "kv"])
        assert r["bytes"] == w_resident + kv_resident, (cycle, r)
        st = torch_budget.sleep.tag_states()
        for tag, resident in (("weights", w_resident), ("kv", kv_resident)):
            got = {k: st[tag][k] for k in ("state", "resident", "released", "backup_bytes")}
            assert got == {"state": "live", "resident": resident, "released": 0, "backup_bytes": 0}, (cycle, tag, st[tag])
        assert torch_budget.sleep.released_tags() == {}
        assert_same(weights, ref, f"cycle {cycle}: weights after the pinned restore")
        if kv_backup == "memset":
            largest = [int(t.max()) for t in kv]
            assert largest == [0, 0], (cycle, "kv not zeroed by memset: largest bytes", largest)
        # Still usable: new contents must be what the next cycle's backup carries.
        for t, r_ in zip(weights, ref):
            t[cycle::97].add_(cycle + 1)
            r_[cycle::97].add_(cycle + 1)
        assert_same(weights, ref, f"cycle {cycle}: weights written after restore")
        for t in kv:
            t.fill_(7)
        assert all(bool((t == 7).all()) for t in kv), cycle
    pool = torch_budget.sleep.host_pool_stats()
    assert pool["pinned_at_release"] == 0, ("the reserved pool was too small", pool)
    assert pool["used"] == 0, ("restores must give their backups back to the pool", pool)
    assert_same(other, other_ref, "untagged memory at the end")
    print("CYCLES", cycle + 1)


@pytest.mark.exclusive
def test_release_hands_the_resident_bytes_to_the_driver_and_restore_takes_them_back(fresh):
    out = fresh(release_hands_the_resident_bytes_to_the_driver_and_restore_takes_them_back)
    assert out.count("RELEASED") == 3, out


def release_hands_the_resident_bytes_to_the_driver_and_restore_takes_them_back():
    torch_budget.install()
    sizes = [256 * MiB] * 4 + [64 * MiB] * 8 + [2 * MiB] * 16 + [5 * MiB + 4096]
    weights = make(sizes, "weights", 1)
    ref = snapshot(weights)
    torch.cuda.empty_cache()
    for backup in ("pinned", "cpu", "none"):
        resident = state("weights")["resident"]
        assert resident >= sum(sizes), (resident, sum(sizes))
        free0, reserved0 = free_bytes(), reserved()
        report = torch_budget.release("weights", backup=backup)
        gained, dropped = free_bytes() - free0, reserved0 - reserved()
        assert report["bytes"] == resident, (backup, report, resident)
        assert gained >= 0.99 * resident, (backup, "device free rose by", gained / MiB, "MiB of", resident / MiB)
        assert dropped >= 0.99 * resident, (backup, "reserved dropped by", dropped / MiB, "MiB of", resident / MiB)
        free1 = free_bytes()
        torch_budget.restore("weights")
        taken = free1 - free_bytes()
        assert taken >= 0.99 * resident, (backup, "restore took", taken / MiB, "MiB of", resident / MiB)
        assert reserved() == reserved0, (backup, reserved(), reserved0)
        if backup != "none":
            assert_same(weights, ref, f"after the {backup} restore")
        print("RELEASED", backup, round(gained / MiB), "MiB of", round(resident / MiB))


def test_captured_graph_replays_identically_after_its_pool_and_inputs_slept(fresh):
    out = fresh(captured_graph_replays_identically_after_its_pool_and_inputs_slept)
    assert "REPLAYS OK" in out


def captured_graph_replays_identically_after_its_pool_and_inputs_slept():
    torch_budget.install()
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch_budget.region("weights"):
        w1 = torch.randn(1024, 2048, device="cuda").div_(32)    # in place: no freed block under the tag
        w2 = torch.randn(2048, 512, device="cuda").div_(45)
        static_in = torch.randn(256, 1024, device="cuda")

    def model():
        return torch.relu(static_in @ w1) @ w2 + 1

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            model()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch_budget.region("graphs"):
        # Capturing on the warmed-up stream keeps cuBLAS's per-stream workspace out of the pool.
        with torch.cuda.graph(g, stream=s):
            out = model()
    g.replay()
    torch.cuda.synchronize()
    before = out.clone()
    inputs = snapshot([w1, w2, static_in])
    graphs_resident = state("graphs")["resident"]
    assert graphs_resident >= out.numel() * out.element_size(), (graphs_resident, "the graph pool is not under its tag")
    for order in (["weights", "graphs"], ["graphs", "weights"], ["weights", "graphs"]):
        torch_budget.release("weights", backup="pinned")
        r = torch_budget.release("graphs", backup="none")
        assert r["bytes"] == graphs_resident, (r, graphs_resident)
        st = torch_budget.sleep.tag_states()
        assert st["graphs"]["state"] == st["weights"]["state"] == "released", st
        assert st["graphs"]["resident"] == 0 and st["graphs"]["released"] == graphs_resident, st["graphs"]
        torch_budget.restore(order)
        g.replay()
        torch.cuda.synchronize()
        assert_same([w1, w2, static_in], inputs, f"graph inputs after restore {order}")
        assert torch.equal(out.view(torch.int32), before.view(torch.int32)), (order, "replay after restore differs")
    static_in.copy_(torch.randn(256, 1024, device="cuda"))
    g.replay()
    torch.testing.assert_close(out, model(), rtol=1e-4, atol=1e-4)
    print("REPLAYS OK")


@pytest.mark.exclusive
def test_restore_past_the_budget_gives_back_what_it_mapped_and_a_later_restore_works(fresh):
    out = fresh(restore_past_the_budget_gives_back_what_it_mapped_and_a_later_restore_works)
    assert "RESTORED AFTER OOM" in out


def restore_past_the_budget_gives_back_what_it_mapped_and_a_later_restore_works():
    torch_budget.install(budget="2GiB")
    weights = make([64 * MiB] * 16, "weights", 4)       # 1 GiB
    ref = snapshot(weights)
    torch_budget.release("weights", backup="pinned")
    asleep = state("weights")
    pool_used = torch_budget.sleep.host_pool_stats()["used"]
    # The budget counts resident memory only: the released GiB can be lent to another tag.
    with torch_budget.region("filler"):
        filler = torch.full((1536 * MiB,), 9, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0, reserved0 = free_bytes(), reserved()
    try:
        torch_budget.restore("weights")                  # about half of it fits
    except torch.cuda.OutOfMemoryError as e:
        print("OOM", e)
    else:
        raise AssertionError("a restore past the budget did not raise OutOfMemoryError")
    assert reserved() == reserved0, ("the failed restore kept memory", (reserved() - reserved0) / MiB, "MiB")
    assert free_bytes() >= free0 - 8 * MiB, ("the failed restore leaked", (free0 - free_bytes()) / MiB, "MiB")
    assert state("weights") == asleep, (state("weights"), asleep)
    assert torch_budget.sleep.host_pool_stats()["used"] == pool_used, "the backup must be kept"
    try:
        with torch_budget.region("weights"):
            torch.empty(4096, dtype=torch.uint8, device="cuda")
    except RuntimeError as e:
        assert "released" in str(e), e
    else:
        raise AssertionError("allocating under the still-released tag did not raise")
    assert int(filler.min()) == int(filler.max()) == 9, "the filler changed"
    del filler
    torch.cuda.empty_cache()
    torch_budget.restore("weights")
    assert state("weights")["state"] == "live"
    assert_same(weights, ref, "weights restored after the failed attempt")
    print("RESTORED AFTER OOM")


def test_restore_after_the_budget_was_lowered_raises_then_succeeds_once_raised(fresh):
    out = fresh(restore_after_the_budget_was_lowered_raises_then_succeeds_once_raised)
    assert "RESTORED" in out


def restore_after_the_budget_was_lowered_raises_then_succeeds_once_raised():
    torch_budget.install()
    weights = make([64 * MiB] * 16, "weights", 5)       # 1 GiB
    keep = make([256 * MiB], None, 6)
    ref, keep_ref = snapshot(weights), snapshot(keep)
    torch_budget.release("weights", backup="pinned")
    torch.cuda.empty_cache()
    reserved0 = reserved()
    torch_budget.set_budget(reserved0 + 256 * MiB)      # a quarter of the weights fits
    try:
        torch_budget.restore("weights")
    except torch.cuda.OutOfMemoryError:
        pass
    else:
        raise AssertionError("a restore past the lowered budget did not raise OutOfMemoryError")
    assert reserved() == reserved0, ("the failed restore kept memory", (reserved() - reserved0) / MiB, "MiB")
    assert state("weights")["state"] == "released" and state("weights")["resident"] == 0, state("weights")
    torch_budget.set_budget(torch_budget.stats()["total"])
    torch_budget.restore("weights")
    assert_same(weights, ref, "weights restored once the budget was raised")
    assert_same(keep, keep_ref, "untagged memory")
    print("RESTORED")


def test_misuse_raises_clear_errors_and_the_process_keeps_working(fresh):
    out = fresh(misuse_raises_clear_errors_and_the_process_keeps_working)
    assert "ERRORS OK" in out


def misuse_raises_clear_errors_and_the_process_keeps_working():
    from torch_budget import TagStateError, TorchBudgetError
    torch_budget.install()
    weights = make([8 * MiB, 2 * MiB], "weights", 7)
    kv = make([4 * MiB], "kv", 8)  # noqa: F841  (a live tag)
    ref = snapshot(weights)

    def raises(kind, fn, *words):
        try:
            fn()
        except kind as e:
            # Our own classes exactly; a builtin one may be met by a subclass of ours.
            assert type(e) is kind or not issubclass(kind, TorchBudgetError), (kind, type(e), e)
            for word in words:
                assert word in str(e), (word, str(e))
            return str(e)
        raise AssertionError(f"no {kind.__name__} from {fn}")

    raises(TagStateError, lambda: torch_budget.restore("weights"))               # live
    torch_budget.release("weights", backup="pinned")
    raises(TagStateError, lambda: torch_budget.release("weights"))               # released twice
    # All or nothing: weights is released already, so the call releases nothing and kv stays live.
    raises(TagStateError, lambda: torch_budget.release(["kv", "weights"], backup="memset"))
    assert state("kv")["state"] == "live" and state("kv")["resident"] > 0, state("kv")
    assert torch_budget.sleep.released_tags() == {"weights": "pinned"}
    raises(ValueError, lambda: torch_budget.release("no-such-tag"), "no-such-tag")
    raises(ValueError, lambda: torch_budget.restore(["no-such-tag"]), "no-such-tag")
    raises(ValueError, lambda: torch_budget.release("kv", backup="disk"), "disk")
    raises(TypeError, lambda: torch_budget.release("kv", backup=3))
    raises(ValueError, lambda: torch_budget.release([]))
    raises(ValueError, lambda: torch_budget.release(["kv", "kv"]))
    assert state("kv")["state"] == "live", "a rejected call must release nothing"

    def allocate_under_weights():
        with torch_budget.region("weights"):
            torch.empty(1024, device="cuda")

    raises(RuntimeError, allocate_under_weights, "weights", "released")
    # The process keeps working: other tags, untagged memory, compute.
    with torch_budget.region("kv"):
        more = torch.ones(1 << 20, device="cuda")
    x = torch.randn(512, 512, device="cuda")
    assert torch.allclose(x @ torch.eye(512, device="cuda"), x)
    assert float(more.sum()) == 1 << 20
    torch_budget.restore("weights")
    assert_same(weights, ref, "weights after the errors")
    with torch_budget.region("weights"):
        late = torch.full((1024,), 3.0, device="cuda")
    assert float(late.sum()) == 3072.0
    raises(TagStateError, lambda: torch_budget.restore("weights"))               # live again
    # Tagged memory outside the VMM route cannot be released; the error names the route.
    with torch_budget.region("side", route="pool"):
        side = torch.full((1 << 20,), 5, dtype=torch.uint8, device="cuda")
    try:
        torch_budget.release("side")
    except (ValueError, RuntimeError) as e:
        assert "pool" in str(e), e
    else:
        raise AssertionError("releasing pool-route memory did not raise")
    assert int(side.min()) == int(side.max()) == 5
    print("ERRORS OK")


def test_cpu_backup_and_sleeping_round_trip(fresh):
    out = fresh(cpu_backup_and_sleeping_round_trip)
    assert "CPU OK" in out


def cpu_backup_and_sleeping_round_trip():
    torch_budget.install()
    W_SIZES = WEIGHT_SIZES
    weights = make(W_SIZES, "weights", 9)
    ref = snapshot(weights)
    r = torch_budget.release("weights", backup="cpu", device="cuda:0")
    assert r["devices"] == [0] and r["backup_bytes"] >= sum(W_SIZES), r
    st = state("weights")
    assert st["backup"] == "cpu" and st["backup_bytes"] == r["backup_bytes"], st
    pool = torch_budget.sleep.host_pool_stats()
    assert pool["used"] == 0 and pool["pinned_at_release"] == 0, ("a cpu backup is pageable memory", pool)
    torch_budget.restore("weights")
    assert_same(weights, ref, "after the cpu restore")
    assert state("weights")["backup_bytes"] == 0, state("weights")

    with torch_budget.sleeping("weights", backup="cpu") as report:
        assert state("weights")["state"] == "released"
    assert state("weights")["state"] == "live"
    assert report["restore"]["bytes"] == report["bytes"] > 0, report
    assert_same(weights, ref, "after sleeping()")
    try:
        with torch_budget.sleeping(["weights"]):           # pinned by default
            raise KeyError("the body failed")
    except KeyError:
        pass
    else:
        raise AssertionError("sleeping() swallowed the body's exception")
    assert state("weights")["state"] == "live", "sleeping() must restore when its body raises"
    assert_same(weights, ref, "after sleeping() whose body raised")
    assert torch_budget.sleep.host_pool_stats()["pinned_at_release"] > 0, "no pool was reserved, so the release pinned"
    print("CPU OK")


def test_a_retained_backup_copies_only_the_granule_that_changed(fresh):
    out = fresh(retained_backup_copies_only_the_granule_that_changed)
    assert "retained ok" in out


def retained_backup_copies_only_the_granule_that_changed():
    torch_budget.install()
    with torch_budget.region("weights"):
        w = torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8, device="cuda")  # 32 granules
        small = torch.randint(0, 255, (1000,), dtype=torch.uint8, device="cuda")
    expected, expected_small = w.clone(), small.clone()
    resident = torch_budget.sleep.tag_states()["weights"]["resident"]
    first = torch_budget.release("weights", backup="pinned", retain=True)
    assert first["backup_bytes"] == resident
    torch_budget.restore("weights")
    assert torch_budget.sleep.tag_states()["weights"]["retained"]
    again = torch_budget.release("weights", backup="pinned", retain=True)
    assert again["backup_bytes"] == 0 and again["bytes"] == resident    # nothing changed: nothing copied
    torch_budget.restore("weights")
    assert torch.equal(w, expected) and torch.equal(small, expected_small)
    base = w.data_ptr()
    for g in range((base + w.numel() - 1) // (2 * MiB) - base // (2 * MiB) + 1):
        # One byte in granule g of the tensor changes on the device; only that granule is copied.
        i = min(max((base // (2 * MiB) + g) * 2 * MiB - base, 0) + 77 * g % 4096, w.numel() - 1)
        w[i:i + 1].add_(1)
        expected[i:i + 1].add_(1)
        rep = torch_budget.release("weights", backup="pinned", retain=True)
        assert rep["backup_bytes"] == 2 * MiB, (g, rep)
        torch_budget.restore("weights")
        assert torch.equal(w, expected), g
    assert torch.equal(small, expected_small)
    assert torch_budget.sleep.drop_backup("weights") == resident
    assert torch_budget.sleep.host_pool_stats()["used"] == 0
    print("retained ok")


@pytest.mark.exclusive
def test_discardable_parameters_go_without_a_copy_and_come_back_at_their_addresses(fresh):
    out = fresh(discardable_parameters_go_without_a_copy_and_come_back_at_their_addresses)
    assert "discardable ok" in out


def discardable_parameters_go_without_a_copy_and_come_back_at_their_addresses():
    # vLLM's level 2 (Note [Discardable blocks]): the parameters are reloaded after the wake, so
    # 1 GiB of them goes back to the driver without a copy; the buffer beside them keeps its bytes.
    torch_budget.install()
    with torch_budget.region("weights"):
        params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (64 << 20, 64 << 20, 3 << 20)]
        rotary = torch.randn(4096, device="cuda")
    expected = rotary.clone()
    loaded = [p.detach().clone() for p in params]  # what the weight update writes back
    torch.cuda.synchronize()
    resident = torch_budget.sleep.tag_states()["weights"]["resident"]
    free = free_bytes()
    rep = torch_budget.release("weights", discardable=params)
    assert rep["bytes"] == resident and rep["backup_bytes"] == 2 * MiB, rep  # the buffer's page only
    assert free_bytes() - free >= resident - 2 * MiB
    assert torch_budget.sleep.host_pool_stats()["used"] == 2 * MiB
    with pytest.raises(torch_budget.TorchBudgetError, match="does not hold"):
        torch_budget.sleep.backup_of(params[0])
    torch_budget.restore("weights")
    assert torch.equal(rotary, expected)
    with torch.no_grad():
        for p, src in zip(params, loaded):
            p.copy_(src)
    assert all(torch.equal(p, src) for p, src in zip(params, loaded))
    assert torch_budget.sleep.host_pool_stats()["used"] == 0
    ptrs = [p.data_ptr() for p in params]
    rep = torch_budget.release("weights", discardable=ptrs)  # storage addresses, as vLLM passes them
    assert rep["backup_bytes"] == 2 * MiB
    torch_budget.restore("weights")
    assert [p.data_ptr() for p in params] == ptrs and torch.equal(rotary, expected)
    print("discardable ok")
