"""Allocation traces: what a workload asked of the allocator, in order, replayable anywhere.

A trace is a list of operations on tensor ids: allocate `size` bytes on stream `s`, or free
tensor `id`. Addresses are not kept (they belong to the allocator that served the recording);
streams are renumbered 0, 1, ... in order of first use, 0 being the first stream seen.

Two sources:
  - torch's memory history: the pickle `torch.cuda.memory._dump_snapshot()` writes (or the
    dict `_snapshot()` returns). Its `alloc` and `free_requested` events become operations
    (a `free_completed` later than its request is the allocator honouring record_stream, not
    the workload); `free_completed` without a request (torch versions that record only that),
    or the `free` of torch's first histories, counts as the free. The blocks live when recording
    started are allocated first: those the history frees without allocating them, and those the
    snapshot's `segments` hold live at its end that the history never names (the weights, when
    recording starts after the model is loaded); the trace's comments say how many blocks and
    bytes, and the peak live without them (Note [Blocks live before recording]).
    `history_only` (`--history-only` on the command line) leaves them out: frees of blocks
    allocated before recording are then dropped, as frees of addresses already freed always
    are, and the comments say how many of each. A snapshot of several devices gives the busiest
    device's history unless one is named (`load(path, device)`, or `PATH@N` on the command
    line), and says so.
  - our own text format, optionally gzip-compressed:

        # torch_budget trace 1
        # any comment line
        a <id> <bytes> <stream>
        f <id>
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import reprlib
import zlib
from array import array
from dataclasses import dataclass, field

from torch_budget.replay.segments import SegmentsError, live_blocks
from torch_budget.units import format_bytes

HEADER = "# torch_budget trace 1"
MAX_STREAMS = 128  # Trace.streams holds signed bytes


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file and what is wrong."""


@dataclass
class Trace:
    """Operations in order: `sizes[i] > 0` allocates tensor `ids[i]` on `streams[i]`,
    `sizes[i] == 0` frees tensor `ids[i]`."""

    name: str
    ids: array = field(default_factory=lambda: array("q"))
    sizes: array = field(default_factory=lambda: array("q"))
    streams: array = field(default_factory=lambda: array("b"))
    comments: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def alloc(self, tid: int, size: int, stream: int = 0) -> None:
        problem = _alloc_problem(tid, size, stream)
        if problem:
            raise TraceError(f"{self.name}: {problem}")
        self.ids.append(tid)
        self.sizes.append(size)
        self.streams.append(stream)

    def free(self, tid: int) -> None:
        self.ids.append(tid)
        self.sizes.append(0)
        self.streams.append(0)

    @property
    def num_streams(self) -> int:
        return (max(self.streams) + 1) if len(self) else 0

    @property
    def num_tensors(self) -> int:
        return (max(self.ids) + 1) if len(self) else 0

    def check(self) -> "Trace":
        """Every free names a live tensor, no id is allocated twice while live, and the trace
        allocates something. Ids past the number of allocations (a replay keeps a slot for every
        id up to the largest) are numbered again densely, in order of allocation."""
        if not self.allocations():
            raise TraceError(f"{self.name}: the trace allocates nothing: there is nothing to replay")
        live = set()
        for i, (tid, size) in enumerate(zip(self.ids, self.sizes)):
            if tid < 0:
                raise TraceError(f"{self.name}: operation {i}: negative tensor id {tid}")
            if size:
                if tid in live:
                    raise TraceError(f"{self.name}: operation {i}: tensor {tid} allocated while still live")
                live.add(tid)
            else:
                if tid not in live:
                    raise TraceError(f"{self.name}: operation {i}: free of tensor {tid}, which is not live")
                live.discard(tid)
        if self.num_tensors > self.allocations():
            renamed: dict = {}
            allocated = 0
            for i, (tid, size) in enumerate(zip(self.ids, self.sizes)):
                if size:
                    renamed[tid] = allocated
                    allocated += 1
                self.ids[i] = renamed[tid] if size else renamed.pop(tid)
        return self

    def peak_live(self, granule: int = 512) -> int:
        """The largest sum of live bytes at once, each request rounded up to `granule` bytes
        (512: the least any CUDA caching allocator hands out, torch's and ours alike)."""
        live, cur, peak = {}, 0, 0
        for tid, size in zip(self.ids, self.sizes):
            if size:
                size = -(-size // granule) * granule
                live[tid] = size
                cur += size
                peak = max(peak, cur)
            else:
                cur -= live.pop(tid)
        return peak

    def allocations(self) -> int:
        return sum(1 for s in self.sizes if s)

    def save(self, path: str) -> None:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "wt") as f:
            f.write(HEADER + "\n")
            for c in self.comments:
                f.write(f"# {c}\n")
            for tid, size, s in zip(self.ids, self.sizes, self.streams):
                f.write(f"a {tid} {size} {s}\n" if size else f"f {tid}\n")


def _alloc_problem(tid: int, size: int, stream: int) -> str | None:
    """What is wrong with allocating tensor `tid` (Trace.alloc), or None."""
    if size <= 0 or size >= 1 << 63:
        return f"allocation {tid} of {size} bytes (sizes must be positive, below 2**63)"
    if not 0 <= stream < MAX_STREAMS:
        return f"allocation {tid} on stream {stream}: streams are numbered 0 to {MAX_STREAMS - 1}"
    if not 0 <= tid < 1 << 63:
        return f"tensor id {tid}: ids are whole numbers from 0, below 2**63"
    return None


def _parse_text(name: str, text: io.TextIOBase) -> Trace:
    """The text format, every problem named by its line (Trace.check finds none after it)."""
    trace = Trace(name)
    streams: dict = {}  # as written -> in order of first use
    live: set = set()

    def stream(text: str, lineno: int) -> int:
        written = int(text)
        if written < 0:
            raise TraceError(f"{name}: line {lineno}: stream {written}: streams are whole numbers from 0")
        s = streams.setdefault(written, len(streams))
        if s >= MAX_STREAMS:
            raise TraceError(f"{name}: line {lineno}: more than {MAX_STREAMS} streams")
        return s

    for lineno, line in enumerate(text, 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            if lineno > 1:
                trace.comments.append(line[1:].strip())
            continue
        parts = line.split()
        try:
            if parts[0] == "a" and len(parts) == 4:
                tid, size, s = int(parts[1]), int(parts[2]), stream(parts[3], lineno)
                problem = _alloc_problem(tid, size, s) or (
                    f"tensor {tid} allocated while still live" if tid in live else None)
                if problem:
                    raise TraceError(f"{name}: line {lineno}: {problem}")
                trace.alloc(tid, size, s)
                live.add(tid)
            elif parts[0] == "f" and len(parts) == 2:
                tid = int(parts[1])
                if tid not in live:
                    raise TraceError(f"{name}: line {lineno}: free of tensor {tid}, which is not live")
                trace.free(tid)
                live.discard(tid)
            else:
                raise ValueError
        except TraceError:
            raise
        except (ValueError, IndexError, OverflowError):
            raise TraceError(f"{name}: line {lineno}: expected 'a <id> <bytes> <stream>' or 'f <id>', "
                             f"got {line[:60]!r}") from None
    return trace


# Note [Blocks live before recording]
# Users start recording once their model is loaded, so a history begins mid-run: it frees blocks it
# never allocated, and the blocks live through the whole recording (the weights) appear in it not
# at all, only in the snapshot's segments at its end. Both were live when recording started, and a
# real allocator places them before anything else, so the trace allocates them first, as torch's
# viewer draws them: a block the history frees without allocating it, at the size its free gives,
# and a block live in the segments at an address the history never names (replay.segments says
# which blocks count as live), at its requested size. No block is allocated twice: one freed during
# the recording is no longer live in the segments, and one the history allocates and leaves live is
# named by the history. A block live at the end at an address whose last event is a free was
# allocated after that free, unrecorded: it did not live through the recording and is left out.
# They go stream by stream, in the order the history first uses the streams (then any other, by
# address), each stream's in address order: an allocator packs a model's weights in the order it
# loaded them, which their addresses keep.

def from_snapshot(snapshot: dict, name: str = "snapshot", device: int | None = None,
                  history_only: bool = False) -> Trace:
    """A trace of one device's history in a memory snapshot (the busiest device unless given), led
    by the blocks live when recording started (Note [Blocks live before recording]) unless
    `history_only`."""
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not isinstance(traces, list):
        raise TraceError(f"{name}: not a memory snapshot with 'device_traces' (torch.cuda.memory._snapshot())")
    for d, t in enumerate(traces):
        if not isinstance(t, list):
            raise TraceError(f"{name}: the history of device {d} is not a list of events: {_short(t)}")
    chosen = device is None
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d])) if traces else 0
    elif type(device) is not int or device < 0:
        raise TraceError(f"{name}: device {device!r}: devices are numbered from 0")
    if device >= len(traces) or not traces[device]:
        recorded = [str(d) for d, t in enumerate(traces) if t]
        raise TraceError(f"{name}: no allocation history for device {device}" + (
            f" (there is for device(s) {', '.join(recorded)})" if recorded else
            ": record it with torch.cuda.memory._record_memory_history() before the workload runs"))
    events = traces[device]

    def whole(v):
        return type(v) is int  # not a bool: torch writes plain ints

    for k, e in enumerate(events):
        action = e.get("action") if isinstance(e, dict) else None
        if action is None or (action in ("alloc", "free", "free_requested", "free_completed") and (
                not whole(e.get("addr")) or not whole(e.get("stream", 0))
                or (action == "alloc" and (not whole(e.get("size")) or not 0 < e["size"] < 1 << 63)))):
            raise TraceError(f"{name}: event {k} of device {device} is not one of torch's memory history events (an "
                             f"object with 'action', an integer 'addr' and 'stream', and a positive 'size' to allocate "
                             f"below 2**63): {_short(e)}")
    has_requests = any(e.get("action") == "free_requested" for e in events)
    # torch's viewer reads 'free' (the first histories' only free) as one too
    free_actions = ("free_requested",) if has_requests else ("free_completed", "free")
    trace = Trace(name)
    trace.comments.append(f"from torch's memory history, device {device}, {len(events)} events")
    others = [d for d, t in enumerate(traces) if d != device and t]
    if chosen and others:
        trace.comments.append(f"device {device} has the most events; the history of device(s) "
                              f"{', '.join(map(str, others))} is not replayed (replay one as {name}@{others[0]})")
    # The history as (tensor, bytes, stream as torch wrote it), 0 bytes freeing the tensor; tensors
    # are numbered in the order this loop meets them, and get their ids once the order is known.
    history: list = []
    stream_order: dict = {}  # streams in the order the history first uses them
    by_addr: dict = {}  # address -> the tensor live there
    freed: set = set()  # addresses freed in the history and not allocated since
    before: list = []  # (stream, address, bytes, tensor) of the blocks live when recording started
    tensors = dropped = dropped_bytes = twice = unrecorded = 0
    for e in events:
        action = e.get("action")
        if action != "alloc" and action not in free_actions:
            continue
        addr, stream = e["addr"], e.get("stream", 0)
        stream_order.setdefault(stream, len(stream_order))
        if action == "alloc":
            if addr in by_addr:  # its free was not recorded: free it here, the latest it can have been
                history.append((by_addr.pop(addr), 0, 0))
                unrecorded += 1
            history.append((tensors, e["size"], stream))
            by_addr[addr] = tensors
            freed.discard(addr)
            tensors += 1
            continue
        tid = by_addr.pop(addr, None)
        if tid is not None:
            history.append((tid, 0, 0))
        elif addr in freed:
            twice += 1
        elif history_only or not (whole(e.get("size")) and 0 < e["size"] < 1 << 63):
            dropped += 1
            dropped_bytes += e["size"] if whole(e.get("size")) and e["size"] > 0 else 0
        else:  # allocated before recording started
            before.append((stream, addr, e["size"], tensors))
            history.append((tensors, 0, 0))
            tensors += 1
        freed.add(addr)
    freed_during = len(before)
    live, no_device = (None, 0) if history_only else _live_blocks(snapshot, device, name)
    pooled = pooled_bytes = freed_last = 0
    for block in live or ():
        if block.addr in by_addr:  # allocated in the history
            continue
        if block.addr in freed:
            freed_last += 1
            continue
        before.append((block.stream, block.addr, block.size, tensors))
        tensors += 1
        if block.graph_pool:
            pooled += 1
            pooled_bytes += block.size
    for stream, *_ in sorted(before, key=lambda b: b[1]):
        stream_order.setdefault(stream, len(stream_order))
    before.sort(key=lambda b: (stream_order[b[0]], b[1]))

    ids: dict = {}  # tensor -> its id, in order of allocation
    streams: dict = {}  # stream as torch wrote it -> in order of first use
    for tid, size, stream in [(tid, size, stream) for stream, _, size, tid in before] + history:
        if not size:
            trace.free(ids[tid])
            continue
        s = streams.setdefault(stream, len(streams))
        if s >= MAX_STREAMS:
            raise TraceError(f"{name}: more than {MAX_STREAMS} streams")
        ids[tid] = len(ids)
        trace.alloc(ids[tid], size, s)
    if before:
        leading = {b[3] for b in before}
        alone = Trace(name)
        for tid, size, _ in history:
            if tid not in leading:
                alone.alloc(tid, size) if size else alone.free(tid)
        trace.comments.append(
            f"{len(before)} block(s) ({format_bytes(sum(b[2] for b in before))}) were live when recording started: "
            f"{freed_during} freed during the recording, {len(before) - freed_during} still live at the snapshot"
            + (f" ({pooled} of them ({format_bytes(pooled_bytes)}) in graph pools)" if pooled else "")
            + f"; they are allocated first (peak live {format_bytes(alone.peak_live())} without them; "
            "--history-only leaves them out)")
    if dropped and history_only:
        trace.comments.append(f"{dropped} free(s) of addresses the history never allocated "
                              f"({format_bytes(dropped_bytes)} allocated before recording started, live at its "
                              "start and not replayed) were dropped")
    elif dropped:
        trace.comments.append(f"{dropped} free(s) of addresses the history never allocated, of no size, were dropped")
    if history_only:
        trace.comments.append("history only: blocks allocated before recording started and live to its end (in "
                              "the snapshot's segments, never in the history) are not replayed")
    elif live is None:
        trace.comments.append("the snapshot lists no segments: blocks allocated before recording started and live "
                              "to its end are not known, and not replayed")
    if no_device:
        trace.comments.append(f"{no_device} segment(s) of the snapshot name no device: their blocks are not replayed")
    if freed_last:
        trace.comments.append(f"{freed_last} block(s) live in the snapshot at an address the history freed last: "
                              "their allocation was not recorded, so they are not replayed")
    if unrecorded:
        trace.comments.append(f"{unrecorded} allocation(s) at an address still live: its free was not recorded, so "
                              "the tensor there is freed just before (no earlier than the workload freed it)")
    if twice:
        trace.comments.append(f"{twice} free(s) of addresses already freed were dropped")
    if not trace.allocations():
        raise TraceError(f"{name}: the history of device {device} holds no allocations")
    return trace


def _live_blocks(snapshot: dict, device: int, name: str) -> tuple:
    """replay.segments.live_blocks, its errors as TraceError naming the file."""
    try:
        return live_blocks(snapshot, device, _short)
    except SegmentsError as e:
        raise TraceError(f"{name}: {e} (--history-only reads the history alone)") from None


def _short(value) -> str:
    """A bounded repr of what a file held, however deep it nests."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, 80, 80
    return short.repr(value)[:200]


class _PlainUnpickler(pickle.Unpickler):
    """A snapshot holds only dicts, lists, strings and numbers: nothing else is built."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to build {module}.{name}: a memory snapshot has no objects")


def split_device(spec: str) -> tuple:
    """`PATH@N` (the command line's TRACE) as (PATH, N): device N's history of the snapshot at
    PATH; (spec, None) for anything else, a file whose own name ends in `@N` included."""
    path, at, device = spec.rpartition("@")
    if at and path and device.isascii() and device.isdigit() and not os.path.exists(spec):
        return path, int(device)
    return spec, None


def load(path: str, device: int | None = None, history_only: bool = False) -> Trace:
    """A trace from a file of either format (see the module's docstring); `device` picks one
    device's history of a memory snapshot (default: the busiest); `history_only` leaves out the
    blocks a snapshot shows live before recording started (from_snapshot), and means nothing for a
    torch_budget trace, which holds whatever the loader that wrote it replayed."""
    name = os.path.basename(path)
    if device is not None and (type(device) is not int or device < 0):
        raise TraceError(f"{path}: device {device!r}: devices are numbered from 0")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read it ({e.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"{path}: a damaged gzip file ({e})") from None
    if raw.startswith(HEADER.encode()) and raw[len(HEADER):len(HEADER) + 1] in (b"", b"\n", b"\r"):
        if device is not None:
            raise TraceError(f"{path}: a torch_budget trace, not a memory snapshot: a device is named only for a "
                             "memory snapshot (a trace holds one device's operations)")
        return _parse_text(name, io.StringIO(raw.decode("utf-8", errors="replace"))).check()
    if raw[:1] == b"\x80":  # a pickle
        try:
            snap = _PlainUnpickler(io.BytesIO(raw)).load()
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise TraceError(f"{path}: a pickle that is not a memory snapshot ({type(e).__name__}: {e})") from None
        try:
            return from_snapshot(snap, name, device, history_only).check()
        except RecursionError:
            raise TraceError(f"{path}: a pickle nested too deep to be a memory snapshot") from None
    raise TraceError(f"{path}: neither a memory snapshot pickle (torch.cuda.memory._dump_snapshot) nor a "
                     f"torch_budget trace (first line {HEADER!r})")
