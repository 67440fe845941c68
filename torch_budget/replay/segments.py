"""The blocks a memory snapshot's `segments` hold live when it was taken (torch.cuda.memory._snapshot()).

The history (`device_traces`) shows only what happened while it recorded; the segments show every
block at the end, those allocated before recording started included. replay.trace reads the ones
the history never allocated as live from the start (Note [Blocks live before recording] there).

Which blocks count as live:
  - `active_allocated`: a tensor holds it.
  - not `active_pending_free`: the workload has freed it and the allocator waits for another
    stream's use (record_stream) to end. A replay's free is the workload's request, so its tensor
    is gone; torch's viewer leaves these out too.
  - not `inactive`: cached, free.
  - blocks of a graph's private pool (a `segment_pool_id` other than (0, 0)) count like any other:
    their tensors are live (a graph's static outputs, say). A replay has no private pools, so they
    are placed like ordinary tensors, and the pool's free blocks, which only its graphs may reuse,
    are not replayed.
A block's size is its `requested_size` (what the workload asked; the history's events record the
same), or its `size` where a torch records none; its stream is its segment's; its address is its
own `address`, or (torch's older snapshots) its segment's address plus the sizes of the blocks
before it.
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_POOL = (0, 0)


class LiveBlock(NamedTuple):
    addr: int
    size: int
    stream: int  # as torch wrote it (a CUDA stream handle)
    graph_pool: bool  # in a private pool: segment_pool_id other than (0, 0)


class SegmentsError(ValueError):
    """The snapshot's segments are not torch's; the message says which and how (no file name)."""


def _whole(v) -> bool:
    return type(v) is int  # not a bool: torch writes plain ints


def _size(v) -> bool:
    return _whole(v) and 0 < v < 1 << 63


def live_blocks(snapshot: dict, device: int, describe=repr) -> tuple:
    """(the live blocks of `device`'s segments, the number of segments that name no device and so
    are left out), or (None, 0) for a snapshot without segments. `describe` makes a bounded repr for
    error messages. Raises SegmentsError for a segment or block that is not torch's."""
    segments = snapshot.get("segments")
    if segments is None:
        return None, 0
    if not isinstance(segments, list):
        raise SegmentsError(f"the snapshot's 'segments' is not a list of segments: {describe(segments)}")
    blocks, no_device = [], 0
    for k, seg in enumerate(segments):
        pool = seg.get("segment_pool_id", DEFAULT_POOL) if isinstance(seg, dict) else None
        if (not isinstance(seg, dict) or not _whole(seg.get("address")) or not _whole(seg.get("stream", 0))
                or not isinstance(seg.get("blocks"), list) or not isinstance(pool, (tuple, list))
                or (seg.get("device") is not None and not _whole(seg["device"]))):
            raise SegmentsError(f"segment {k} of the snapshot is not one of torch's (an object with an integer "
                                f"'address', 'stream' and 'device' and a list of 'blocks'): {describe(seg)}")
        if seg.get("device") is None:
            no_device += 1
            continue
        if seg["device"] != device:
            continue
        addr = seg["address"]
        for j, b in enumerate(seg["blocks"]):
            if (not isinstance(b, dict) or not _size(b.get("size")) or not isinstance(b.get("state"), str)
                    or not _whole(b.get("address", addr)) or not _whole(b.get("requested_size", 0))):
                raise SegmentsError(f"block {j} of segment {k} of the snapshot is not one of torch's (an object "
                                    f"with a positive integer 'size' and a 'state'): {describe(b)}")
            if b["state"] == "active_allocated":
                requested = b.get("requested_size", 0)
                blocks.append(LiveBlock(b.get("address", addr), requested if _size(requested) else b["size"],
                                        seg.get("stream", 0), tuple(pool) != DEFAULT_POOL))
            addr = b.get("address", addr) + b["size"]
    return blocks, no_device
