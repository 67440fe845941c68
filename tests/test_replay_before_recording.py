"""A memory history recorded mid-run: blocks allocated before recording started (freed during it, or
live to the end, as weights are) are allocated first, from the frees that name them and from the
snapshot's segments, as torch's viewer shows them; `history_only` leaves them out. No GPU needed."""
import pickle

import pytest

from torch_budget.replay import TraceError, from_snapshot, load

KiB, MiB = 1 << 10, 1 << 20
SIDE, OTHER = 0x7F00_1000, 0x7F00_2000  # CUDA stream handles, as torch writes them


def event(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 0, "frames": []}


def segment(address, blocks, stream=0, device=0, pool=(0, 0), with_addresses=True):
    """A segment as torch.cuda.memory._snapshot() writes it; `blocks` are (size, state[, requested])."""
    out, addr = [], address
    for size, state, *requested in blocks:
        b = {"size": size, "requested_size": requested[0] if requested else size, "state": state, "frames": []}
        if with_addresses:
            b["address"] = addr
        out.append(b)
        addr += size
    total = addr - address
    active = sum(b["size"] for b in out if b["state"] != "inactive")
    allocated = sum(b["size"] for b in out if b["state"] == "active_allocated")
    return {"device": device, "address": address, "total_size": total, "allocated_size": allocated,
            "active_size": active, "requested_size": sum(b["requested_size"] for b in out if b["state"] != "inactive"),
            "stream": stream, "segment_type": "large" if total > MiB else "small", "segment_pool_id": pool,
            "is_expandable": False, "frames": [], "blocks": out}


def snapshot(events, segments, devices=1):
    return {"segments": segments, "device_traces": [events] + [[] for _ in range(devices - 1)],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None}}


def ops(t):
    return [(tid, size, s) if size else ("f", tid) for tid, size, s in zip(t.ids, t.sizes, t.streams)]


W, A = 1 << 32, 1 << 33  # the weights' segment, the activations'


def recorded_after_loading():
    """Two weights (4 and 2 MiB) never in the history; an activation of 3 MiB allocated before
    recording and freed during it; X allocated and freed, Y (100 bytes) allocated and still live."""
    segs = [segment(W, [(4 * MiB, "active_allocated"), (2 * MiB, "active_allocated"), (2 * MiB, "inactive")]),
            segment(A, [(3 * MiB, "inactive"), (512, "active_allocated", 100), (MiB - 512, "inactive")])]
    events = [event("free_requested", A, 3 * MiB), event("free_completed", A, 3 * MiB),
              event("alloc", W + 6 * MiB, 2 * MiB), event("alloc", A + 3 * MiB, 100),
              event("free_requested", W + 6 * MiB, 2 * MiB), event("free_completed", W + 6 * MiB, 2 * MiB)]
    return snapshot(events, segs)


def test_blocks_live_before_recording_are_allocated_first_in_address_order():
    # the loader dropped the activation's free and never saw the weights: peak live 2 MiB + 512 B,
    # a lighter program than the one recorded, which held 9 MiB at the start
    t = from_snapshot(recorded_after_loading(), "s").check()
    assert ops(t) == [(0, 4 * MiB, 0), (1, 2 * MiB, 0), (2, 3 * MiB, 0),  # weights, then the activation
                      ("f", 2), (3, 2 * MiB, 0), (4, 100, 0), ("f", 3)]  # Y is allocated once, by the history
    assert t.peak_live() == 9 * MiB
    notes = "\n".join(t.comments)
    assert "3 block(s) (9.0 MiB) were live when recording started" in notes
    assert "1 freed during the recording, 2 still live at the snapshot" in notes
    assert "peak live 2.0 MiB without them" in notes and "--history-only leaves them out" in notes
    assert "dropped" not in notes


def test_history_only_replays_what_the_history_shows(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(recorded_after_loading()))
    t = load(str(path), history_only=True)
    assert ops(t) == [(0, 2 * MiB, 0), (1, 100, 0), ("f", 0)] and t.peak_live() == 2 * MiB + 512
    notes = "\n".join(t.comments)
    assert "1 free(s) of addresses the history never allocated (3.0 MiB" in notes
    assert "history only" in notes and "live before recording" not in notes
    assert t.peak_live() < load(str(path)).peak_live() == 9 * MiB


def test_pending_frees_other_devices_and_graph_pools():
    R = A + 8 * MiB
    segs = [segment(A, [(MiB, "active_allocated"), (MiB, "inactive")], pool=(1, 0)),  # a graph's static output
            segment(A + 4 * MiB, [(2 * MiB, "active_pending_free")]),  # freed before recording, awaiting a stream
            segment(R, [(512 * KiB, "active_pending_free")], stream=SIDE),  # freed during it, awaiting a stream
            segment(A, [(8 * MiB, "active_allocated")], device=1)]  # another device's
    events = [event("alloc", W, MiB), event("free_requested", R, 512 * KiB, SIDE), event("free_requested", W, MiB)]
    t = from_snapshot(snapshot(events, segs, devices=2), "s").check()
    # the graph pool's live block and R (once, from its free) come first; the pending and device 1's do not
    assert ops(t) == [(0, MiB, 0), (1, 512 * KiB, 1), (2, MiB, 0), ("f", 1), ("f", 2)]
    notes = "\n".join(t.comments)
    assert "2 block(s) (1.5 MiB) were live when recording started" in notes
    assert "1 of them (1.0 MiB) in graph pools" in notes


def test_leading_blocks_go_stream_by_stream_in_the_order_the_history_uses_the_streams():
    segs = [segment(300 * MiB, [(MiB, "active_allocated")]),
            segment(100 * MiB, [(2 * MiB, "active_allocated")], stream=SIDE),
            segment(50 * MiB, [(3 * MiB, "active_allocated")], stream=OTHER),  # a stream the history never uses
            segment(200 * MiB, [(4 * MiB, "active_allocated")]),
            segment(MiB, [(512, "inactive"), (512, "inactive")])]
    events = [event("alloc", MiB, 512), event("alloc", MiB + 512, 512, SIDE),
              event("free_requested", MiB, 512), event("free_requested", MiB + 512, 512, SIDE)]
    t = from_snapshot(snapshot(events, segs), "s").check()
    assert [(size, s) for size, s in zip(t.sizes, t.streams)][:4] == [
        (4 * MiB, 0), (MiB, 0), (2 * MiB, 1), (3 * MiB, 2)]  # 200 MiB, 300 MiB; then SIDE; then OTHER
    assert t.num_streams == 3 and t.peak_live() == 10 * MiB + 1024


def test_an_older_snapshots_blocks_are_placed_by_their_segments_address_and_offsets():
    # blocks without 'address': each lies at its segment's address plus the sizes before it
    segs = [segment(10 * MiB, [(3 * MiB, "active_allocated")], with_addresses=False),
            segment(0, [(MiB, "inactive"), (2 * MiB, "active_allocated", 2 * MiB - 100)], with_addresses=False)]
    events = [event("alloc", 10 * MiB + 3 * MiB, 512), event("free_requested", 10 * MiB + 3 * MiB, 512)]
    t = from_snapshot(snapshot(events, segs), "s").check()
    assert ops(t)[:2] == [(0, 2 * MiB - 100, 0), (1, 3 * MiB, 0)]  # its requested size, as the history records


def test_a_block_live_at_an_address_the_history_freed_last_is_not_replayed():
    # its allocation was not recorded, so it did not live through the recording
    segs = [segment(W, [(MiB, "active_allocated")])]
    events = [event("alloc", W, 2 * MiB), event("free_requested", W, 2 * MiB), event("alloc", A, 512)]
    t = from_snapshot(snapshot(events, segs), "s").check()
    assert ops(t) == [(0, 2 * MiB, 0), ("f", 0), (1, 512, 0)]
    assert any("1 block(s) live in the snapshot at an address the history freed last" in c for c in t.comments)


@pytest.mark.parametrize("segments,match", [
    ("nope", "the snapshot's 'segments' is not a list"),
    ([{"address": "0", "blocks": []}], "segment 0 of the snapshot is not one of torch's"),
    ([segment(0, [(MiB, "active_allocated")]) | {"blocks": [{"size": -1, "state": "inactive"}]}],
     "block 0 of segment 0"),
])
def test_segments_that_are_not_torchs_are_refused_unless_only_the_history_is_read(tmp_path, segments, match):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [[event("alloc", 1, 5)]]}))
    with pytest.raises(TraceError, match=f"s.pickle: {match}.*--history-only"):
        load(str(path))
    assert list(load(str(path), history_only=True).sizes) == [5]


def test_segments_naming_no_device_are_left_out_and_said_so():
    segs = [{k: v for k, v in segment(W, [(MiB, "active_allocated")]).items() if k != "device"}]
    t = from_snapshot(snapshot([event("alloc", A, 512)], segs), "s").check()
    assert list(t.sizes) == [512]
    assert any("1 segment(s) of the snapshot name no device" in c for c in t.comments)


def test_replay_prints_what_was_live_before_recording_and_history_only_leaves_it_out(capsys, monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    from torch_budget import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(recorded_after_loading()))
    assert cli.main(["replay", str(path)]) == 1
    err = capsys.readouterr().err
    assert "s.pickle: 7 operations, 5 allocations on 1 stream(s), peak live 9.0 MiB" in err
    assert "3 block(s) (9.0 MiB) were live when recording started" in err
    assert cli.main(["replay", str(path), "--history-only"]) == 1
    err = capsys.readouterr().err
    assert "s.pickle: 3 operations, 2 allocations on 1 stream(s), peak live 2.0 MiB" in err
    assert "history only" in err and "live when recording started" not in err


def test_history_only_reaches_every_process_that_replays_the_trace(monkeypatch, tmp_path):
    from torch_budget.replay import child, compare

    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(recorded_after_loading()))
    assert len(child.read_trace(str(path), history_only=True)) == 3 and len(child.read_trace(str(path))) == 7
    cmd, _ = compare._child("native", [str(path)], False, 1, False, history_only=True)
    assert "--history-only" in cmd
    assert "--history-only" not in compare._child("native", [str(path)], False, 1, False)[0]
    asked = []
    monkeypatch.setattr(compare, "run_child", lambda *a, **k: asked.append(("child", a, k)) or [{"error": "x"}])
    monkeypatch.setattr(compare, "run_lockstep", lambda *a, **k: asked.append(("lockstep", a, k)) or
                        {c: [{"error": "x"}] for c in a[0]})
    for in_lockstep in (True, False):
        compare.compare([str(path)], ["native"], rounds=1, pinning=(True,), in_lockstep=in_lockstep, history_only=True)
    assert [(how, k.get("history_only")) for how, _, k in asked] == [("lockstep", True), ("child", True)]
