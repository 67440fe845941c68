"""Allocation traces without a GPU: both file formats, torch's memory history, the built-in
mixes, bad files named with what is wrong, and `torch-budget replay` saying why it stops."""
import gzip
import os
import types
import pickle
import sys

import pytest

from torch_budget import cli
from torch_budget.replay import TraceError, from_snapshot, load
from torch_budget.replay.mixes import SERVING_CLASSES, mix
from torch_budget.replay.trace import Trace

MiB = 1 << 20


def history(events):
    return {"segments": [], "device_traces": [events]}


def test_memory_history_becomes_operations_on_tensor_ids():
    snap = history([
        {"action": "free_requested", "addr": 4096, "size": 512, "stream": 0},  # allocated before recording
        {"action": "alloc", "addr": 1 << 20, "size": 1000, "stream": 7},
        {"action": "alloc", "addr": 2 << 20, "size": 3 * MiB, "stream": 9},
        {"action": "free_requested", "addr": 1 << 20, "size": 1000, "stream": 7},
        {"action": "free_completed", "addr": 1 << 20, "size": 1000, "stream": 7},
        {"action": "alloc", "addr": 1 << 20, "size": 2000, "stream": 7},  # the address again: a new tensor
        {"action": "segment_alloc", "addr": 0, "size": 20 * MiB, "stream": 7},
    ])
    t = from_snapshot(snap, "h", history_only=True).check()  # (the block freed first: test_replay_before_recording)
    assert list(t.ids) == [0, 1, 0, 2]
    assert list(t.sizes) == [1000, 3 * MiB, 0, 2000]
    assert list(t.streams) == [0, 1, 0, 0]  # streams renumbered in order of first use
    assert t.peak_live() == 3 * MiB + 2048  # tensor 0 was freed first; sizes rounded up to 512 bytes
    assert any("dropped" in c for c in t.comments)


def test_a_history_with_only_completed_frees_uses_them():
    snap = history([{"action": "alloc", "addr": 10, "size": 8, "stream": 0},
                    {"action": "free_completed", "addr": 10, "size": 8, "stream": 0}])
    assert list(from_snapshot(snap).sizes) == [8, 0]


def test_an_older_torchs_free_action_frees_the_tensor():
    # torch's first memory histories wrote 'free' (its viewer still reads it as a free); these were
    # ignored, so each tensor stayed live until its address came back: twice the peak, the last never freed
    snap = history([{"action": "alloc", "addr": 1, "size": MiB, "stream": 0},
                    {"action": "free", "addr": 1, "size": MiB, "stream": 0},
                    {"action": "alloc", "addr": 2, "size": MiB, "stream": 0},
                    {"action": "free", "addr": 2, "size": MiB, "stream": 0},
                    {"action": "alloc", "addr": 1, "size": MiB, "stream": 0},
                    {"action": "free", "addr": 1, "size": MiB, "stream": 0}])
    t = from_snapshot(snap).check()
    assert list(t.sizes) == [MiB, 0, MiB, 0, MiB, 0] and t.peak_live() == MiB
    with pytest.raises(TraceError, match="event 1 of device 0"):
        from_snapshot(history([{"action": "alloc", "addr": 1, "size": 5}, {"action": "free", "addr": "1"}]))


def test_a_history_says_what_it_made_up_or_left_out_and_how_many_bytes():
    # an allocation at an address still live was freed first without a word (its free was not
    # recorded: the replay moves that free later than the workload's), and the frees dropped as
    # "allocated before recording" did not say how much memory the replay leaves out
    snap = history([{"action": "free_requested", "addr": 9, "size": 3 * MiB, "stream": 0},
                    {"action": "alloc", "addr": 1, "size": MiB, "stream": 0},
                    {"action": "alloc", "addr": 1, "size": 2 * MiB, "stream": 0},
                    {"action": "free_requested", "addr": 1, "size": 2 * MiB, "stream": 0},
                    {"action": "free_requested", "addr": 9, "size": 3 * MiB, "stream": 0}])
    t = from_snapshot(snap, history_only=True).check()
    assert list(t.sizes) == [MiB, 0, 2 * MiB, 0]
    notes = "\n".join(t.comments)
    assert "1 free(s) of addresses the history never allocated (3.0 MiB" in notes
    assert "1 allocation(s) at an address still live" in notes
    assert "1 free(s) of addresses already freed were dropped" in notes
    # by default the block freed first is allocated first, and its second free is the one dropped
    t = from_snapshot(snap).check()
    assert list(t.sizes) == [3 * MiB, 0, MiB, 0, 2 * MiB, 0]
    notes = "\n".join(t.comments)
    assert "1 block(s) (3.0 MiB) were live when recording started" in notes and "never allocated" not in notes
    assert "1 free(s) of addresses already freed were dropped" in notes


def test_both_files_round_trip(tmp_path):
    t = mix("serving:3000:5")
    for name in ("a.tbtrace", "a.tbtrace.gz"):
        t.save(str(tmp_path / name))
        back = load(str(tmp_path / name))
        assert (list(back.ids), list(back.sizes), list(back.streams)) == (list(t.ids), list(t.sizes), list(t.streams))
    pkl = tmp_path / "snap.pickle"
    pkl.write_bytes(pickle.dumps(history([{"action": "alloc", "addr": 1, "size": 5, "stream": 0}])))
    assert list(load(str(pkl)).sizes) == [5]


def _damaged_gzip():
    """A gzip file whose inflate stream is corrupt (not cut short): zlib's own error."""
    data = bytearray(gzip.compress(b"# torch_budget trace 1\n" + b"a 0 10 0\nf 0\n" * 200, mtime=0))
    data[12] ^= 0xFF
    data[13] ^= 0xFF
    return bytes(data)


def _deep_pickle():
    """An event nested deeper than any recursion limit, written opcode by opcode: pickling it
    would recurse (Python 3.12 bounds that below its recursion limit), unpickling does not."""
    def text(value):
        raw = value.encode()
        return b"X" + len(raw).to_bytes(4, "little") + raw  # BINUNICODE

    depth = 5000
    level = b"}(" + text("action") + text("alloc") + text("addr")  # EMPTY_DICT, MARK, two items' worth
    inner = level + b"K\x01" + text("size") + b"K\x05u"  # addr 1, size 5, SETITEMS
    deep = level * depth + inner + b"u" * depth  # each outer dict's addr is the dict inside it
    stub = pickle.dumps(history(["placeholder event"]), protocol=2)  # no frames: bytes may be spliced
    assert stub.count(text("placeholder event")) == 1
    return stub.replace(text("placeholder event"), deep)


@pytest.mark.parametrize("content,match", [
    (b"hello", "neither a memory snapshot"),
    (b"# torch_budget trace 1\na 0 10 0\nf 1\n", "free of tensor 1, which is not live"),
    (b"# torch_budget trace 1\na 0 10 0\na 0 10 0\n", "allocated while still live"),
    (b"# torch_budget trace 1\nx 0\n", "line 2: expected"),
    (b"# torch_budget trace 1\na 0 -5 0\n", "sizes must be positive"),
    (pickle.dumps({"no": "traces"}), "not a memory snapshot"),
    (pickle.dumps(history([])), "no allocation history"),
    (gzip.compress(b"# torch_budget trace 1\n", mtime=0)[:-6], "damaged gzip"),
    # these were tracebacks (KeyError, AttributeError, TypeError)
    (pickle.dumps(history([{"action": "alloc"}])), "event 0 of device 0 is not one of torch's memory history"),
    (pickle.dumps(history(["x"])), "event 0 of device 0 is not one of"),
    (pickle.dumps({"device_traces": [{"action": "alloc", "addr": 1, "size": 5}]}), "is not a list of events"),
    (pickle.dumps(history([{"action": "alloc", "addr": 1, "size": 5}, {"action": "free_completed", "addr": [1]}])),
     "event 1 of device 0 is not one of"),
    # these were tracebacks too (zlib.error, TypeError, OverflowError, RecursionError)
    (_damaged_gzip(), "damaged gzip"),
    (pickle.dumps(history([{"action": "alloc", "addr": 1, "size": 10, "stream": [1]}])), "event 0 of device 0"),
    (pickle.dumps({"device_traces": [None, [{"action": "alloc", "addr": 1, "size": 5}]]}), "device 0 is not a list"),
    (pickle.dumps(history([{"action": "alloc", "addr": 1, "size": 2**70}])), "below 2\\*\\*63"),
    (pickle.dumps(history([{"action": "alloc", "addr": 1, "size": True}])), "event 0 of device 0"),
    # named "allocation 1", the loader's own numbering of the tensors, not where the file holds it
    (pickle.dumps(history([{"action": "alloc", "addr": 1, "size": 5}, {"action": "alloc", "addr": 2, "size": 0}])),
     "event 1 of device 0"),
    (_deep_pickle(), "event 0 of device 0|nested too deep"),
    # and these were read as fine, to fail on a GPU
    (b"# torch_budget trace 1\n# nothing\n", "allocates nothing"),
    (b"# torch_budget trace 1\na 0 10 -1\nf 0\n", "line 2: stream -1: streams are whole numbers from 0"),
    (b"# torch_budget trace 1\n" + b"".join(b"a %d 10 %d\n" % (i, i) for i in range(129)),
     "line 130: more than 128 streams"),
    (b"# torch_budget trace 10\na 0 10 0\n", "neither a memory snapshot"),
])
def test_bad_trace_files_are_refused_with_the_reason(tmp_path, content, match):
    # (the parameters above use _damaged_gzip and _deep_pickle, defined before them)
    p = tmp_path / "bad"
    p.write_bytes(content)
    with pytest.raises(TraceError, match=match):
        load(str(p))


@pytest.mark.parametrize("content,match", [
    # each named a tensor or an operation's index, not the line (comments and blank lines apart)
    (b"# torch_budget trace 1\n# c\n# c\na 0 -5 0\n", "bad: line 4: allocation 0 of -5 bytes"),
    (b"# torch_budget trace 1\na 0 99999999999999999999999 0\n", "bad: line 2: allocation 0 of"),
    (b"# torch_budget trace 1\na -3 5 0\n", "bad: line 2: tensor id -3"),
    (b"# torch_budget trace 1\n# c\n\na 0 5 0\nf 0\nf 0\n", "bad: line 6: free of tensor 0, which is not live"),
    (b"# torch_budget trace 1\n# c\na 0 5 0\n\na 0 5 0\n", "bad: line 5: tensor 0 allocated while still live"),
])
def test_a_bad_line_of_a_text_trace_is_named_by_its_number(tmp_path, content, match):
    p = tmp_path / "bad"
    p.write_bytes(content)
    with pytest.raises(TraceError, match=match):
        load(str(p))


def test_a_pickle_with_objects_is_not_unpickled(tmp_path):
    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps(history([{"action": "alloc", "addr": 1, "size": 5, "stream": 0, "x": Trace("t")}])))
    with pytest.raises(TraceError, match="refusing to build"):
        load(str(p))


def test_the_serving_mix_has_the_sizes_and_live_set_it_describes():
    t = mix("serving:40000")
    sizes = [s for s in t.sizes if s]
    small = sum(1 for s in sizes if s <= SERVING_CLASSES[0][2]) / len(sizes)
    huge = sum(1 for s in sizes if s >= SERVING_CLASSES[2][1]) / len(sizes)
    assert 0.78 < small < 0.82 and 0.002 < huge < 0.01
    live, most = set(), 0
    for tid, size in zip(t.ids, t.sizes):
        (live.add if size else live.discard)(tid)
        most = max(most, len(live))
    assert 550 <= most <= 620
    assert mix("serving:40000").sizes == t.sizes  # deterministic
    t.check()


@pytest.mark.parametrize("spec", ["nope", "serving:0", "1MiB:x", "0B", "serving:abc", "1MiB:1e6", "1MiB:-5",
                                  "serving:10:1:2", "1MiB:10:3", "1MiB:\u00b2", "serving:5:\u00b2"])
def test_unknown_mixes_are_refused(spec):
    # "serving:abc", "1MiB:1e6" and a superscript digit were int()'s ValueError (a traceback from the CLI);
    # "1MiB:-5" an empty trace
    with pytest.raises(TraceError, match="mix"):
        mix(spec)


def test_sparse_tensor_ids_are_numbered_again_so_a_replay_keeps_no_slot_for_ids_never_used(tmp_path):
    p = tmp_path / "sparse.tbtrace"
    p.write_text("# torch_budget trace 1\na 9000000000000000000 10 0\na 7 20 0\nf 9000000000000000000\na 5 30 0\n")
    t = load(str(p))
    assert (list(t.ids), list(t.sizes)) == ([0, 1, 0, 2], [10, 20, 0, 30]) and t.num_tensors == 3


def test_a_mix_too_long_to_replay_is_refused_before_it_is_built():
    with pytest.raises(TraceError, match="at most"):
        mix("1MiB:99999999999999")
    with pytest.raises(TraceError, match="size must be 0 or more bytes"):
        mix("-1MiB")


def test_replay_without_a_gpu_reads_the_traces_and_says_why_it_stops(capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["replay", "mix:small:2000", "--rounds", "1"]) == 1
    err = capsys.readouterr().err
    assert "mix:small:2000: " in err and " operations" in err and "needs a GPU" in err


def test_replay_names_a_bad_trace_and_exits_2(capsys, tmp_path):
    assert cli.main(["replay", str(tmp_path / "missing.pickle")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert cli.main(["replay", "mix:small", "--configs", "native,tb-quick"]) == 2
    assert "unknown configuration 'tb-quick'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    # an empty list had run every configuration, the three the default leaves out included
    (["mix:small", "--configs", ",,"], "--configs ',,' names none"),
    # a name given twice was replayed twice into one row, each round counted twice
    (["mix:small", "--configs", "native,tb-vmm,tb-vmm"], "configuration 'tb-vmm' is given twice"),
    (["mix:small", "mix:small"], "trace 'mix:small' is given twice"),
])
def test_replay_refuses_an_empty_or_repeated_list_and_exits_2(capsys, argv, message):
    assert cli.main(["replay", *argv]) == 2
    assert message in capsys.readouterr().err


def test_replay_help_names_the_default_configurations(capsys):
    from torch_budget.replay.configs import DEFAULT

    assert cli.main(["replay", "--help"]) == 0
    assert f"default: {', '.join(DEFAULT)};" in " ".join(capsys.readouterr().out.split())


def test_what_a_history_drops_and_which_device_it_replays_are_printed(capsys, monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    snap = {"segments": [], "device_traces": [
        [{"action": "alloc", "addr": 1, "size": 5, "stream": 0}],
        [{"action": "free_requested", "addr": 99, "size": 5, "stream": 0},  # allocated before recording
         {"action": "alloc", "addr": 100, "size": 5, "stream": 0},
         {"action": "free_requested", "addr": 100, "size": 5, "stream": 0},
         {"action": "free_requested", "addr": 100, "size": 5, "stream": 0}],  # freed twice
    ]}
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert cli.main(["replay", str(path)]) == 1
    err = capsys.readouterr().err
    assert "device 1 has the most events; the history of device(s) 0 is not replayed" in err
    assert "1 block(s) (0.0 MiB) were live when recording started: 1 freed during the recording" in err
    assert "1 free(s) of addresses already freed were dropped" in err


def test_a_snapshots_other_device_is_replayed_when_named_and_a_device_without_history_is_refused(
        capsys, monkeypatch, tmp_path):
    # the comment said "name one to replay it", but neither the command nor load() could name one
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [
        [{"action": "alloc", "addr": 1, "size": 5 * MiB, "stream": 0}],
        [{"action": "alloc", "addr": 1, "size": MiB, "stream": 0}, {"action": "alloc", "addr": 2, "size": MiB}],
        []]}))
    assert cli.main(["replay", str(path)]) == 1
    assert "the history of device(s) 0 is not replayed (replay one as two.pickle@0)" in capsys.readouterr().err
    assert cli.main(["replay", f"{path}@0"]) == 1
    err = capsys.readouterr().err
    assert "two.pickle@0: 1 operations" in err and "device 0, 1 events" in err and "peak live 5.0 MiB" in err
    assert list(load(str(path), device=0).sizes) == [5 * MiB]
    for device in ("2", "7"):
        assert cli.main(["replay", f"{path}@{device}"]) == 2
        assert f"no allocation history for device {device} (there is for device(s) 0, 1)" in capsys.readouterr().err
    text = tmp_path / "t.tbtrace"
    text.write_text("# torch_budget trace 1\na 0 10 0\n")
    assert cli.main(["replay", f"{text}@1"]) == 2
    assert "a device is named only for a memory snapshot" in capsys.readouterr().err
    for device in (-1, True, "1"):
        with pytest.raises(TraceError, match="device"):
            load(str(path), device=device)


def test_the_text_format_numbers_streams_in_order_of_first_use(tmp_path):
    path = tmp_path / "t.tbtrace"
    path.write_text("# torch_budget trace 1\na 0 512 5\na 1 512 300\na 2 512 5\n")
    t = load(str(path))
    assert list(t.streams) == [0, 1, 0] and t.num_streams == 2
    path.write_text("# torch_budget trace 1\na 0 512 -1\n")
    with pytest.raises(TraceError, match="line 2: stream -1"):
        load(str(path))


def test_a_comparison_names_a_trace_it_cannot_read_before_it_starts_a_process(monkeypatch, tmp_path):
    from torch_budget.replay import compare

    started = []
    monkeypatch.setattr(compare, "run_child", lambda *a, **k: started.append(a) or [])
    monkeypatch.setattr(compare, "run_lockstep", lambda *a, **k: started.append(a) or {})
    missing = str(tmp_path / "decode_graphs")
    for in_lockstep in (True, False):
        with pytest.raises(TraceError, match="decode_graphs: cannot read it"):
            compare.compare(["mix:small", missing], ["native", "tb-vmm"], rounds=1, in_lockstep=in_lockstep)
    assert started == []


@pytest.mark.parametrize("argv,in_lockstep", [([], True), (["--sequential"], False)])
def test_replay_runs_a_rounds_configurations_in_lockstep_unless_asked_one_after_another(monkeypatch, capsys, argv,
                                                                                       in_lockstep):
    torch = pytest.importorskip("torch")
    from torch_budget.replay import compare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = {}

    def fake_compare(traces, configs, rounds, pinning, passes, touch, progress=None, in_lockstep=None,
                     history_only=None):
        asked.update(traces=traces, configs=configs, in_lockstep=in_lockstep)
        assert history_only is False
        return []

    monkeypatch.setattr(compare, "compare", fake_compare)
    assert cli.main(["replay", "mix:small:2000", "--configs", "native,tb-vmm", *argv]) == 0
    assert asked == {"traces": ["mix:small:2000"], "configs": ["native", "tb-vmm"], "in_lockstep": in_lockstep}


def test_the_comparison_times_the_grown_cache_apart_from_the_first_pass():
    from torch_budget.replay.compare import Run, summarise, table

    def child(first, later):
        return {"us_per_op": [first] + later, "device_calls": [10, 0], "ops": 1000, "peak_live": 1 << 20,
                "reserved_over_live": 1.0}

    # Round by round, native then torch_budget: the first pass costs torch_budget twice native's
    # time (it grows its cache in more pieces); once grown it runs at 0.9x.
    native = Run("t", "native", True, rounds=[child(2.0, [1.0, 1.2]), child(3.0, [2.0, 2.0])])
    tb = Run("t", "tb-vmm", True, rounds=[child(4.0, [0.9, 1.08]), child(6.0, [1.8, 1.8])])
    rows = {r["config"]: r for r in summarise([native, tb])}
    assert rows["tb-vmm"]["x_native"] == pytest.approx(0.9)  # the passes after the first
    assert rows["tb-vmm"]["wins"] == 2
    assert rows["tb-vmm"]["x_native_first"] == pytest.approx(2.0)
    assert rows["native"]["us_per_op"] == pytest.approx((1.1 + 2.0) / 2)
    text = table(list(rows.values()))
    assert "1st pass" in text.splitlines()[0] and "2.00x" in text and "0.90x" in text
    # One pass: it is all there is to time, and no first-pass ratio is shown.
    one = summarise([Run("t", "native", True, rounds=[child(2.0, [])]),
                     Run("t", "tb-vmm", True, rounds=[child(1.0, [])])])
    assert one[1]["x_native"] == pytest.approx(0.5) and "x_native_first" not in one[1]


def test_a_short_trace_runs_more_passes_until_its_grown_passes_add_up():
    from torch_budget.replay.child import wants_another_pass

    # Every requested pass runs, however long it took.
    assert wants_another_pass(0, 3, 0.0) and wants_another_pass(2, 3, 10.0)
    # Past them, a long trace stops; a short one runs on until its grown passes time 0.25 s...
    assert not wants_another_pass(3, 3, 0.8)
    assert wants_another_pass(3, 3, 0.02) and not wants_another_pass(20, 3, 0.26)
    # ...but never past the cap, and 0 asks for exactly the requested passes.
    assert not wants_another_pass(64, 3, 0.0) and wants_another_pass(63, 3, 0.0)
    assert not wants_another_pass(3, 3, 0.0, min_grown_seconds=0.0)
    assert wants_another_pass(70, 80, 5.0) and not wants_another_pass(80, 80, 0.0)


def test_the_calibrated_ratio_divides_out_each_processs_own_speed():
    from torch_budget.replay.compare import Run, summarise, table

    def child(us, cal):
        return {"us_per_op": [us * 2] + [us, us], "calibration_us": [cal] * 3, "device_calls": [0, 0, 0],
                "ops": 1000, "peak_live": 1 << 20, "reserved_over_live": 1.0}

    # Round 1: torch_budget's process landed on a core twice as slow (its calibration says so);
    # round 2: native's did. Raw ratios 2.0 and 0.5; calibrated, 1.0 both times.
    native = Run("t", "native", True, rounds=[child(1.0, 1.0), child(2.0, 2.0)])
    tb = Run("t", "tb-vmm", True, rounds=[child(2.0, 2.0), child(1.0, 1.0)])
    rows = {r["config"]: r for r in summarise([native, tb])}
    assert rows["tb-vmm"]["x_native_calibrated"] == pytest.approx(1.0)
    assert rows["tb-vmm"]["x_native"] == pytest.approx(1.25)  # the raw pairs, 2.0 and 0.5
    assert "x cal" in table(list(rows.values())).splitlines()[0]
    # A child without calibrations (an older one) gives no calibrated ratio.
    old = {"us_per_op": [2.0, 1.0], "device_calls": [0, 0], "ops": 1000, "peak_live": 1 << 20,
           "reserved_over_live": 1.0}
    rows = summarise([Run("t", "native", True, rounds=[old]), Run("t", "tb-vmm", True, rounds=[old])])
    assert "x_native_calibrated" not in rows[1]


def test_the_floor_is_the_peak_live_bytes_in_whole_granules():
    from torch_budget.replay.compare import Run, reserved_floor, summarise, table

    assert reserved_floor(4 << 20) == 1.0
    assert reserved_floor(4096) == 512.0  # one 2 MiB granule for 4 KiB
    # The small-only mix's peak: 20.24 granules live, so 21 at least: 1.037, above a 1.02 line.
    assert reserved_floor(42450432) == pytest.approx(21 * (2 << 20) / 42450432)
    res = {"us_per_op": [1.0, 1.0], "device_calls": [0, 0], "ops": 10, "peak_live": 3 << 20,
           "reserved_over_live": 1.5}
    rows = summarise([Run("t", "native", True, rounds=[res])])
    assert rows[0]["reserved_floor"] == pytest.approx(4 / 3)
    header, line = table(rows).splitlines()
    assert "floor" in header and "1.333" in line


def test_the_share_of_time_spent_backing_allocations_is_shown_for_torch_budget():
    from torch_budget.replay.compare import Run, summarise, table

    def child(backing):
        # 1000 operations of 2 µs a pass: 2 ms; the grown passes spent 0.5 ms of it mapping
        return {"us_per_op": [4.0, 2.0, 2.0], "device_calls": [0, 0, 0], "ops": 1000, "peak_live": 1 << 21,
                "reserved_over_live": 1.0, "backing_ns": backing}

    native = Run("t", "native", True, rounds=[child([(0, 0)] * 3)])
    tb = Run("t", "tb-vmm", True, rounds=[child([(9_000_000, 0), (500_000, 400_000), (500_000, 0)])])
    rows = {r["config"]: r for r in summarise([native, tb])}
    assert rows["tb-vmm"]["backing_share"] == pytest.approx(0.25)
    assert "backing_share" not in rows["native"]  # nothing reported: no column value
    lines = table(list(rows.values())).splitlines()
    assert lines[0].endswith("map %") and lines[2].endswith("25.0") and lines[1].endswith("-")


class _FakeCuda:
    """What replay() calls of torch.cuda, with no device: a stand-in that counts."""

    def __init__(self):
        self.streams_set = 0

    def current_device(self):
        return 0

    def current_stream(self):
        return "s0"

    def Stream(self):  # noqa: N802  (torch's name)
        return "s1"

    def set_stream(self, stream):
        self.streams_set += 1

    def synchronize(self):
        pass

    def empty_cache(self):
        pass

    def reset_peak_memory_stats(self):
        pass

    def memory_reserved(self):
        return 0

    def max_memory_reserved(self):
        return 64 << 20

    def memory_stats(self):
        return {"num_device_alloc": 0, "num_device_free": 0}

    backend = "native"

    def get_allocator_backend(self):
        return self.backend


class _FakeTorch:
    uint8 = "uint8"

    def __init__(self):
        self.cuda = _FakeCuda()
        self.allocations = 0

    def device(self, kind, index):
        return (kind, index)

    def zeros(self, *args, device=None):
        return self.empty(1, device=device)

    def empty(self, size, dtype=None, device=None):
        self.allocations += 1 if device is not None else 0
        return types.SimpleNamespace(add_=lambda x: None)


def _fake_torch(monkeypatch):
    """A _FakeTorch as `torch`, and torch_budget not installed, whatever an earlier test of this
    worker process did (an install() over the host stand-in leaves it installed)."""
    import torch_budget

    fake = _FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(torch_budget, "installed", lambda: False)
    return fake


def test_a_replay_times_every_pass_with_its_calibration_and_runs_a_short_trace_longer(monkeypatch):
    from torch_budget.replay import child
    from torch_budget.replay.mixes import mix

    fake = _fake_torch(monkeypatch)
    trace = mix("small:2000")
    out = child.replay(trace, passes=3, min_grown_seconds=0.05)
    n = len(out["us_per_op"])
    assert 3 <= n <= child.MAX_PASSES
    assert n > 3 or sum(out["us_per_op"][1:]) * len(trace.ids) / 1e6 >= 0.05  # more passes only while short
    assert len(out["calibration_us"]) == len(out["device_calls"]) == len(out["backing_ns"]) == n
    assert all(c > 0 for c in out["calibration_us"])
    assert out["backing_ns"] == [(0, 0)] * n  # not installed: torch_budget spent nothing
    allocated = sum(1 for s in trace.sizes if s)
    assert fake.allocations == 1 + n * allocated  # the warm-up, then every pass allocates what the trace does
    assert out["ops"] == len(trace.ids) and out["peak_live"] == trace.peak_live()
    exactly = child.replay(trace, passes=3, min_grown_seconds=0.0)
    assert len(exactly["us_per_op"]) == 3


def test_a_backend_that_counts_no_driver_calls_reports_none_rather_than_zero(monkeypatch):
    # torch's cudaMallocAsync backend leaves num_device_alloc/free at 0: the table printed 0.0 per 1000 ops
    from torch_budget.replay import child
    from torch_budget.replay.mixes import mix

    fake = _fake_torch(monkeypatch)
    fake.cuda.backend = "cudaMallocAsync"
    assert child.replay(mix("small:2000"), passes=2, min_grown_seconds=0.0)["device_calls"] == []


def test_touching_each_tensor_keeps_no_freed_one_alive(monkeypatch):
    # The touch kept the last tensor in a local until the next allocation: two live where the trace had one.
    import weakref

    from torch_budget.replay import child
    from torch_budget.replay.mixes import mix

    fake = _fake_torch(monkeypatch)
    live, most = set(), [0]

    class Tensor:
        def __init__(self):
            live.add(id(self))
            most[0] = max(most[0], len(live))
            weakref.finalize(self, live.discard, id(self))

        def __getitem__(self, key):
            return self

        def fill_(self, value):
            return self

        def add_(self, value):
            return self

    fake.empty = lambda size, dtype=None, device=None: Tensor()
    trace = mix("1MiB:50")  # one tensor live at a time
    child.replay(trace, passes=2, min_grown_seconds=0.0, touch=True)
    assert most[0] == 1


def test_a_replays_reserved_peak_covers_every_pass_and_the_first_is_kept_beside_it(monkeypatch):
    # A cache that packs its first pass tightly and grows in later ones: the figure is the later peak.
    from torch_budget.replay import child
    from torch_budget.replay.mixes import mix

    fake = _fake_torch(monkeypatch)
    fake.cuda.max_memory_reserved = lambda: fake.allocations << 20  # grows with every pass
    trace = mix("small:2000")
    out = child.replay(trace, passes=3, min_grown_seconds=0.0)
    allocated = sum(1 for s in trace.sizes if s)
    assert out["peak_reserved"] == (1 + 3 * allocated) << 20
    assert out["reserved_over_live"] == pytest.approx(((1 + 3 * allocated) << 20) / trace.peak_live())
    assert out["first_pass_reserved_over_live"] == pytest.approx(((1 + allocated) << 20) / trace.peak_live())


def test_the_table_shows_the_first_passs_reserved_peak_where_children_report_it():
    from torch_budget.replay.compare import Run, summarise, table

    res = {"us_per_op": [1.0, 1.0], "device_calls": [0, 0], "ops": 10, "peak_live": 4 << 20,
           "reserved_over_live": 1.5, "first_pass_reserved_over_live": 1.25}
    old = {k: v for k, v in res.items() if k != "first_pass_reserved_over_live"}
    rows = summarise([Run("t", "native", True, rounds=[res]), Run("t", "tb-vmm", True, rounds=[old])])
    assert rows[0]["first_pass_reserved_over_live"] == 1.25 and "first_pass_reserved_over_live" not in rows[1]
    header, new, older = table(rows).splitlines()
    assert "rsv 1st" in header
    assert "1.500" in new and "1.250" in new and "1.250" not in older


def test_each_round_is_one_sample_however_many_passes_it_ran():
    from torch_budget.replay.compare import Run, summarise

    def child(passes, us):
        return {"us_per_op": [2 * us] + [us] * passes, "device_calls": [0] * (passes + 1), "ops": 1000,
                "peak_live": 1 << 20, "reserved_over_live": 1.0, "lockstep": True}

    # Unpinned, round 1 put torch_budget on a slow core for all its seven passes; rounds 2 and 3
    # ran two passes each, both under native. Pooled pass by pass, round 1 would decide (1.5x).
    native = Run("t", "native", False, rounds=[child(7, 1.0), child(2, 1.0), child(2, 1.0)])
    tb = Run("t", "tb-vmm", False, rounds=[child(7, 1.5), child(2, 0.9), child(2, 0.95)])
    row = {r["config"]: r for r in summarise([native, tb])}["tb-vmm"]
    assert row["x_native"] == pytest.approx(0.95)
    assert (row["wins"], row["pairs"]) == (2, 3)


def test_every_configuration_starts_without_the_callers_allocator_settings(monkeypatch):
    # expandable_segments:True left in a shell had made "native" (and every tb- one) expandable segments
    from torch_budget.replay.configs import CONFIGS, environment

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6")
    for name in CONFIGS:
        env = {**os.environ, **environment(name)}
        want = {"expandable": "expandable_segments:True", "cudaMallocAsync": "backend:cudaMallocAsync"}.get(name, "")
        assert (env["PYTORCH_CUDA_ALLOC_CONF"], env["PYTORCH_ALLOC_CONF"]) == (want, ""), name


def test_the_median_interval_is_the_binomial_order_statistics_and_holds_the_median_as_often_as_it_says():
    import random

    from torch_budget.replay.compare import median_interval

    assert median_interval(range(16, 0, -1)) == (4, 13)      # the textbook 4th and 13th of 16
    assert median_interval(range(1, 101)) == (40, 61)
    assert median_interval([3, 1, 2, 5, 4, 6]) == (1, 6)     # six: only the extremes
    assert median_interval([1, 2, 3, 4, 5]) is None          # five cannot give 95 %
    assert median_interval([1, 2, 3, 4, 5], confidence=0.9) == (1, 5)
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError, match="confidence"):
            median_interval([1.0] * 10, confidence=bad)
    rng = random.Random(5)
    held = 0
    for _ in range(2000):                                    # lognormal draws, true median 1.0
        lo, hi = median_interval([rng.lognormvariate(0, 0.05) for _ in range(16)])
        held += lo <= 1.0 <= hi
    assert 0.95 <= held / 2000 <= 0.995                      # 0.979 by the binomial, within sampling
