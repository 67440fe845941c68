"""Disk backups (Note [Disk backups], csrc/core/disk_backup.h), over the host stand-in: a release
writes each piece to a file of its own through one pinned staging buffer and unmaps it; the
restore reads the files back, bitwise, and deletes them; a write that fails puts back what the
release had dropped; no directory, or a bad one, is refused before anything changes."""
import os
import resource
import signal

import pytest

from _hostcore import MiB, Host, in_child, isolated
from test_core_sleep import fill
from torch_budget.errors import BackupFileError, InvalidArgumentError

pytestmark = pytest.mark.built("_host_core")

SIZES = [6 * MiB, 1000, 150 * MiB, 5 * MiB + 3]  # a multi-piece block among small ones


def files(d):
    return {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)}


@isolated
def test_a_disk_release_writes_every_piece_to_its_own_file_and_the_restore_reads_them_back(tmp_path):
    h = Host(route="vmm")
    h.set_disk_dir(tmp_path)
    blocks = fill(h, "weights", SIZES)
    resident = h.tag_info("weights")["resident"]
    used = h.device_used()
    sizes, counts = set(), []
    for cycle in range(3):
        h.release("weights", "disk")
        on_disk = files(tmp_path)
        counts.append(len(on_disk))
        # First pieces of about 64 MiB (the 150 MiB block alone is three); once restored, pieces
        # end where the restore's runs of up to 256 MiB end (Note [Restore mappings]).
        assert len(on_disk) >= (4 if cycle == 0 else 1) and max(on_disk.values()) <= 320 * MiB, on_disk
        assert sum(on_disk.values()) == resident == h.tag_info("weights")["backup_bytes"]
        assert h.device_used() == used - resident
        assert h.host_pool()["used"] == 0, "the staging buffer outlived the release"
        sizes.add(sum(on_disk.values()))
        h.restore("weights")
        assert files(tmp_path) == {}, "the restore left files behind"
        for p, data in blocks:
            assert h.peek(p, len(data)) == data, f"cycle {cycle}"
    assert sizes == {resident}
    assert counts[1] == counts[2] < counts[0], counts


@isolated
def test_without_a_directory_a_disk_release_is_refused_and_changes_nothing():
    h = Host(route="vmm")
    blocks = fill(h, "weights", [8 * MiB])
    h.release("weights", "pinned", retain=True)
    h.restore("weights")
    before = h.tag_info("weights")
    with pytest.raises(InvalidArgumentError, match="needs a directory"):
        h.release("weights", "disk")
    assert h.tag_info("weights") == before  # live, its retained backup kept
    for p, data in blocks:
        assert h.peek(p, len(data)) == data


@isolated
def test_a_bad_directory_is_refused_naming_it(tmp_path):
    h = Host(route="vmm")
    not_dir = tmp_path / "a-file"
    not_dir.write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="is not a directory"):
        h.set_disk_dir(not_dir)
    with pytest.raises(InvalidArgumentError, match="is not a directory"):
        h.set_disk_dir(tmp_path / "missing")
    with pytest.raises(InvalidArgumentError, match="only a cpu or pinned backup can be retained"):
        h.set_disk_dir(tmp_path)
        fill(h, "weights", [4 * MiB])
        h.release("weights", "disk", retain=True)


def _release_against_a_file_size_limit(d):
    # 30 MiB and 150 MiB blocks with a freed gap between them: the 30 MiB piece is written, the
    # first 64 MiB piece of the other passes the limit, after the first was dropped.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    h = Host(route="vmm")
    h.set_disk_dir(d)
    h.push("vmm", "weights")
    a, gap, c = h.malloc(30 * MiB), h.malloc(20 * MiB), h.malloc(150 * MiB)
    h.pop()
    h.free(gap)
    data = {a: os.urandom(30 * MiB), c: os.urandom(150 * MiB)}
    for p, d_ in data.items():
        assert h.poke(p, d_)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40 * MiB, resource.RLIM_INFINITY))
    try:
        h.release("weights", "disk")
    except BackupFileError as e:
        message = str(e)
    else:
        raise AssertionError("the release passed the file size limit without an error")
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert "cannot write" in message and ".bin" in message, message
    assert h.tag_info("weights")["life"] == 0, "the tag did not come back after the failed write"
    assert h.tag_info("weights")["resident"] >= 180 * MiB  # the gap's memory went back, the blocks' is there
    assert files(d) == {}, "the files of the failed release stayed"
    for p, d_ in data.items():
        assert h.peek(p, len(d_)) == d_
    return True


def test_a_write_that_fails_half_way_puts_back_what_the_release_dropped(tmp_path):
    assert in_child(_release_against_a_file_size_limit, str(tmp_path))


@isolated
def test_a_disk_backup_goes_when_its_directory_is_forgotten_only_for_new_releases(tmp_path):
    h = Host(route="vmm")
    h.set_disk_dir(tmp_path)
    blocks = fill(h, "weights", [8 * MiB])
    h.release("weights", "disk")
    h.set_disk_dir(None)  # the files already written stay where they are
    h.restore("weights")
    for p, data in blocks:
        assert h.peek(p, len(data)) == data
    with pytest.raises(InvalidArgumentError, match="needs a directory"):
        h.release("weights", "disk")
