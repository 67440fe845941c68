"""The ledger's names on torch's memory snapshot (torch_budget.snapshot.annotate): pure data, no device;
and dump_snapshot's care for the file it replaces."""
import pytest

import torch_budget
from torch_budget import snapshot
from torch_budget.snapshot import annotate

MiB = 1 << 20


def test_segments_get_their_route_and_live_blocks_their_tag():
    base = 0x7F0000000000
    snap = {"segments": [
        # a VMM run inside the arena at `base`: one live block, one free tail
        {"device": 0, "address": base + 4 * MiB, "total_size": 4 * MiB,
         "blocks": [{"size": 1 * MiB, "state": "active_allocated"}, {"size": 3 * MiB, "state": "inactive"}]},
        # a synchronous segment with a block waiting on a recorded stream
        {"device": 0, "address": 0x1000000, "total_size": 2 * MiB,
         "blocks": [{"size": 2 * MiB, "state": "active_pending_free"}]},
        # memory on another device that torch_budget does not hold
        {"device": 1, "address": 0x5000000, "total_size": 2 * MiB, "blocks": [{"size": 2 * MiB, "state": "inactive"}]},
    ]}
    ours = {0: [(base, 64 * MiB, "vmm"), (0x1000000, 2 * MiB, "sync")], 1: []}
    tags = {base + 4 * MiB: 3, 0x1000000: 0}
    annotate(snap, ours, {0: "untagged", 3: "kv"}, lambda a: tags.get(a, -1))
    vmm, sync, other = snap["segments"]
    assert vmm["route"] == "vmm" and [b.get("tag") for b in vmm["blocks"]] == ["kv", None]
    assert all(b["route"] == "vmm" for b in vmm["blocks"])
    assert sync["route"] == "sync" and sync["blocks"][0]["tag"] == "untagged"
    assert other["route"] is None and "tag" not in other["blocks"][0]


def test_an_address_past_every_segment_of_ours_has_no_route():
    snap = {"segments": [{"device": 0, "address": 100 * MiB, "total_size": MiB,
                          "blocks": [{"size": MiB, "state": "active_allocated"}]}]}
    annotate(snap, {0: [(0, 10 * MiB, "sync")]}, {}, lambda a: -1)
    assert snap["segments"][0]["route"] is None and snap["segments"][0]["blocks"][0]["tag"] is None


def test_a_dump_that_fails_leaves_the_file_it_would_replace(tmp_path):
    # The file was opened for writing first: a dump without install() left yesterday's at 0 bytes.
    path = tmp_path / "snap.pickle"
    path.write_bytes(b"yesterday's snapshot")
    with pytest.raises(torch_budget.NotInstalledError):
        snapshot.dump_snapshot(str(path))
    assert path.read_bytes() == b"yesterday's snapshot"
