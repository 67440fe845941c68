"""GraphRunner: one forward captured once per bucket, stepped by staging its inputs and
replaying its graphs.

The runner ties together its static inputs and shadows (staging.StaticInputs), its outputs
(outputs.StaticOutputs) and its captured buckets (capture.capture_bucket), and asks the
manager that made it for the pool to capture into (RunnerOwner).
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from .._validate import integer, positive_int
from ..errors import InvalidArgumentError, StateError, StaticBufferRebindError
from ..sleep import any_released, check_awake
from .arguments import check_inputs, check_last_outputs, check_pieces, check_pool
from .buckets import BucketRule, pad_to_bucket, resolve_buckets
from .capture import CapturedBucket, capture_bucket
from .outputs import StaticOutputs
from .pieces import EagerPiece, call_eager
from .pools import PoolHandle, PoolLedger, capture_guard, pool_key
from .staging import STEP_CACHE_ENTRIES, StaticInputs
from .static import (
    AxisSize,
    StaticBuffers,
    StaticInput,
    inputs_nbytes,
    rebind_message,
)

__all__ = ["GraphRunner", "RunnerOwner"]

# Why a bucket serves no step, said of one bucket and of several.
_FAILED = ("failed to capture", "failed to capture")
_RELEASED = ("was released", "were released")
_NOT_AVAILABLE = ("is not available", "are not available")


class RunnerOwner(Protocol):
    """What a GraphRunner asks of the manager that made it; GraphPoolManager implements it.

    Neither reads the other's private state. The manager hands the runner the pool to
    capture into (capture_pool, from the runner's public pool_mode and pool) and the
    capture stream (capture_stream) with the lock that makes captures on it take turns
    (capture_lock), and says whether another runner keeps a handed-in pool
    for itself, as its own or with its outputs in it (runner_keeping_pool); the runner reports its close
    (runner_closed). The runner records and drops its own graphs in `ledger`, and releases
    a pool of its own when it closes. See Note [Pool ownership].
    """

    device: torch.device
    ledger: PoolLedger

    def capture_pool(self, runner: GraphRunner) -> PoolHandle: ...

    def capture_stream(self) -> Any: ...

    def capture_lock(self) -> Any: ...

    def runner_keeping_pool(self, pool: PoolHandle) -> GraphRunner | None: ...

    def runner_closed(self, runner: GraphRunner) -> None: ...


# The runner whose capture() this thread is running, if any: a piece whose warm-up calls another
# runner's capture() would wait for the device's capture lock this thread holds.
_capturing = threading.local()


class GraphRunner:
    """One forward (a sequence of pieces) captured once per bucket; made by GraphPoolManager.runner().

    Public state: `name`, `buckets` (sizes a step may be padded to), `captured`,
    `pool`, `pool_mode`, `last_outputs`, `inputs` / `outputs` / `shadows` (StaticBuffers of
    the full, largest views), `shadow_slots`, `static_nbytes` / `shadow_nbytes`. A step:
    `step(n, **host_data)`; the same computation without graphs: `run_eager(n, **host_data)`.
    """

    def __init__(self, manager: RunnerOwner, name: str, pieces: Sequence[Callable | EagerPiece], *,
                 buckets: BucketRule | int | Sequence[int], inputs: Sequence[StaticInput],
                 axes: Mapping[str, AxisSize] | None, output_axes: Mapping[str, int | None] | None,
                 pool: str | PoolHandle, warmup: int, shadow_slots: int = 2, last_outputs: str = "copy"):
        self._manager = manager
        self._ledger = manager.ledger
        self._label = label = f"graph runner {name!r}"
        self.name = name
        self.device = manager.device
        self._cuda = self.device.type == "cuda"
        if self._cuda and not torch.cuda.is_available():
            raise RuntimeError(
                f"{label}: its manager is on {self.device}, but torch sees no CUDA device; "
                "use GraphPoolManager('cpu') to run pieces eagerly without graphs"
            )
        self._pieces = check_pieces(label, pieces)
        axes = dict(axes or {})
        self._warmup_iters = positive_int(warmup, f"{label}: warmup iterations")
        shadow_slots = positive_int(shadow_slots, f"{label}: shadow_slots")
        specs = check_inputs(label, inputs, axes)
        self._pool_mode, self._pool = check_pool(label, pool, self._ledger, manager.runner_keeping_pool)
        self._keep_last = check_last_outputs(label, last_outputs, self._pool_mode, self._pieces)

        self._all_buckets = resolve_buckets(buckets, cost=lambda b: inputs_nbytes(specs.values(), axes, b, label))
        self._available = list(self._all_buckets)
        # Static memory: allocated now, kept until close().
        self._ins = StaticInputs(label, specs, axes, self._all_buckets, shadow_slots, self.device)
        self._outs = StaticOutputs(label, self._pieces, self._ins.names, output_axes or {}, self._all_buckets,
                                   self._keep_last)
        self._captured_buckets: dict[int, CapturedBucket] = {}
        # Buckets taken out of _available -> why, for messages: _FAILED or _RELEASED.
        self._unavailable: dict[int, tuple[str, str]] = {}
        # Built on first use, at most STEP_CACHE_ENTRIES: (bucket, n, slot) -> the step's result views.
        self._result_cache: OrderedDict[tuple[int, int, int], dict[str, torch.Tensor]] = OrderedDict()
        self._closed = False

    def _require_open(self) -> None:
        if self._closed:
            raise StateError(f"{self._label} is closed")

    # -- public state -------------------------------------------------------------------

    @property
    def buckets(self) -> tuple[int, ...]:
        """Sizes a step may be padded to: the rule's set minus released buckets."""
        return tuple(self._available)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured_buckets))

    @property
    def pool(self) -> PoolHandle | None:
        """The pool handle this runner's graphs were captured into (None before capture)."""
        return self._pool

    @property
    def pool_mode(self) -> str:
        """"shared" (the manager's pool), "own" (a pool for this runner alone) or "external"
        (a handle handed in)."""
        return self._pool_mode

    @property
    def last_outputs(self) -> str:
        """"copy" (static output buffers) or "in_pool" (see Note [Outputs kept in the pool])."""
        return "in_pool" if self._keep_last else "copy"

    @property
    def shadow_slots(self) -> int:
        """Pinned shadow slots (Note [Shadow ring]); 1 when no input is host-sourced."""
        return self._ins.slots

    @property
    def inputs(self) -> StaticBuffers:
        self._require_open()
        return StaticBuffers(self._label, self._ins.full_views())

    @property
    def shadows(self) -> StaticBuffers:
        """The shadow slot the latest step wrote. For reading: writes would go behind the
        runner's padding bookkeeping."""
        return self.shadows_at(self._ins.last_slot)

    def shadows_at(self, slot: int) -> StaticBuffers:
        """The pinned shadows of one slot (full, largest views); for reading."""
        self._require_open()
        slot = integer(slot, f"{self._label}: shadow slot")
        if not 0 <= slot < self._ins.slots:
            raise InvalidArgumentError(f"{self._label}: shadow slot must be in [0, {self._ins.slots}), got {slot!r}")
        return StaticBuffers(self._label, self._ins.shadow_full_views(slot))

    @property
    def outputs(self) -> StaticBuffers:
        """Static outputs (full views); outputs kept in the pool are not among them."""
        self._require_open()
        return StaticBuffers(self._label, self._outs.full_views())

    @property
    def static_nbytes(self) -> int:
        """Device bytes of static inputs and outputs (graph pools not included)."""
        return self._ins.device_nbytes + self._outs.nbytes

    @property
    def shadow_nbytes(self) -> int:
        """Pinned host bytes of the shadows, all slots."""
        return self._ins.shadow_nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    def view(self, name: str, bucket: int) -> torch.Tensor:
        """The device view of static buffer `name` that the graph for `bucket` uses."""
        self._require_open()
        if bucket not in self._all_buckets:
            raise InvalidArgumentError(f"{self._label}: {bucket!r} is not one of its buckets {self._all_buckets}")
        if name in self._ins.names:
            return self._ins.bucket_views(bucket)[name]
        view = self._outs.view(name, bucket)
        if view is None:
            names = sorted(self._ins.names | set(self._outs.static_names))
            raise KeyError(f"{self._label} has no static buffer {name!r}; it has {names}")
        return view

    def bucket_for(self, n: int) -> int | None:
        """The bucket a step of n rows is padded to; None above the largest (run it eagerly)."""
        return pad_to_bucket(self._available, n)

    # Static buffers also show as attributes (runner.x), and assigning one raises.

    def _is_buffer(self, name: str) -> bool:
        state = self.__dict__
        return (("_ins" in state and name in state["_ins"].names)
                or ("_outs" in state and name in state["_outs"].static_names))

    def __getattr__(self, name: str) -> torch.Tensor:
        if name.startswith("_") or not self._is_buffer(name):
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        if self._closed:  # its buffers went with close()
            raise StateError(f"{self._label} is closed: its static buffer {name!r} is gone")
        if name in self._ins.names:
            return self._ins.full(name)
        return self._outs.full(name)

    def __setattr__(self, name: str, value: object) -> None:
        if self._is_buffer(name):
            raise StaticBufferRebindError(rebind_message(self._label, name))
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"captured={self.captured}"
        return f"GraphRunner({self.name!r}, buckets={self._all_buckets}, {state})"

    # -- choosing the bucket --------------------------------------------------------------

    def _rows(self, n: object) -> int:
        """A step's row count n as an int >= 1."""
        if type(n) is int and n >= 1:  # the common case, without building a message
            return n
        return positive_int(n, f"{self._label}: row count n")

    def _choose_bucket(self, n: int, bucket: int | None, eager: bool = False) -> int:
        """The bucket a step (run_eager when `eager`) of n rows (an int >= 1, see _rows) is padded to."""
        available = self._available
        if bucket is None:
            i = bisect.bisect_left(available, n)
            if i < len(available):
                return available[i]
            instead = ("call the pieces' forward without the runner" if eager
                       else "run this step eagerly (bucket_for(n) returns None for such steps)")
            if not available:
                raise InvalidArgumentError(
                    f"{self._label}: no bucket is captured: {self._why_unavailable(self._all_buckets)}; "
                    f"capture() again to capture them (after freeing memory, if it ran out), or {instead}"
                )
            above = self._why_unavailable([b for b in self._all_buckets if b > available[-1]])
            where = f" ({above})" if above else ""
            if eager:
                raise InvalidArgumentError(
                    f"{self._label}: {n} rows exceed its largest bucket {available[-1]}{where}: run_eager() too "
                    f"pads into the static buffers of a bucket, so {instead} for such a step"
                )
            raise InvalidArgumentError(f"{self._label}: {n} rows exceed its largest bucket {available[-1]}{where}; {instead}")
        if bucket in available and bucket >= n:
            return bucket
        if bucket not in self._all_buckets:
            raise InvalidArgumentError(f"{self._label}: {bucket!r} is not one of its buckets {self._all_buckets}")
        if bucket not in available:
            raise InvalidArgumentError(
                f"{self._label}: {self._why_unavailable([bucket])}; capture() again to capture it, or name "
                f"another bucket (buckets now: {tuple(available)})"
            )
        raise InvalidArgumentError(f"{self._label}: bucket {bucket} cannot hold {n} rows (buckets: {tuple(available)})")

    def _why_unavailable(self, buckets: Sequence[int]) -> str:
        """Which of `buckets` serve no step and why, e.g. "bucket 8 failed to capture"."""
        why: dict[tuple[str, str], list[int]] = {}
        for b in buckets:
            why.setdefault(self._unavailable.get(b, _NOT_AVAILABLE), []).append(b)
        return "; ".join(f"bucket {bs[0]} {one}" if len(bs) == 1 else f"buckets {bs} {several}"
                         for (one, several), bs in why.items())

    # -- eager runs, warm-up, capture, replay ------------------------------------------

    def _run_pieces_eagerly(self, bucket: int, slot: int) -> dict[str, torch.Tensor]:
        self._ins.copy_to_device(bucket, slot)
        self._ins.release_slot(slot)
        visible = self._ins.bucket_views(bucket)
        kept: dict[str, torch.Tensor] = {}
        for index, piece in enumerate(self._pieces):
            buffers = StaticBuffers(self._label, dict(visible), bucket)
            if isinstance(piece, EagerPiece):
                call_eager(self._label, piece, buffers)
            else:
                views, piece_kept = self._outs.store(index, bucket, piece(buffers), capturing=False)
                visible.update(views)
                kept.update(piece_kept)
        return kept

    def run_eager(self, n: int, *, bucket: int | None = None, **data: object) -> dict[str, torch.Tensor]:
        """The step's computation without graphs, through the same static buffers and padding.

        The reference for a replay, and the way to run a runner on a CPU device. As with
        step(), the outputs are detached from autograd: a replay carries no gradients.
        """
        self._require_open()
        n = self._rows(n)
        chosen = self._choose_bucket(n, bucket, eager=True)
        slot = self._ins.stage(chosen, n, data)
        kept = self._run_pieces_eagerly(chosen, slot)
        return self._outs.result(chosen, n, kept)

    def capture(self) -> None:
        """Warm up and capture every bucket not yet captured, largest first.

        Largest first: a smaller bucket's graph can then reuse blocks the larger one freed
        in the shared pool (see Note [Static outputs make pool sharing safe]). The first
        piece is captured once per shadow slot (see Note [Shadow ring]). A bucket whose warm-up
        or capture raises (out of memory, say) does not stop the others: the first error is
        raised once they were tried, and the buckets that failed serve no step (a step pads
        past them, or runs eagerly above the largest bucket captured) until a later capture()
        captures them. Captures of every manager on the device take turns (capture_lock): they
        share its capture stream.
        """
        self._require_open()
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"{self._label} lives on {self.device}; CUDA graph capture needs a CUDA device")
        if all(b in self._captured_buckets for b in self._all_buckets):
            return  # nothing to capture: no need to wait for another capture's turn
        busy = getattr(_capturing, "runner", None)
        if busy is not None:  # the lock is not reentrant, and a capture inside a capture is invalid anyway
            raise StateError(f"{self._label}.capture() was called inside the warm-up or capture of {busy} on this "
                             "thread: capture each runner on its own, before or after the other")
        with self._manager.capture_lock():  # one capture at a time on the shared capture stream
            _capturing.runner = self._label
            try:
                self._capture()
            finally:
                _capturing.runner = None

    def _capture(self) -> None:
        pending = [b for b in reversed(self._all_buckets) if b not in self._captured_buckets]
        if not pending:
            return
        pool = self._pool = self._manager.capture_pool(self)
        stream = self._manager.capture_stream()
        failed: dict[int, Exception] = {}
        # Held until every bucket was tried: a failed bucket's undo may drop the pool's last
        # graph, and a pool of the manager's would then release itself under the buckets after it.
        guard = capture_guard(self.name)
        self._ledger.acquire(pool, guard)
        try:
            for bucket in pending:
                try:
                    self._warm_up(bucket, stream)
                    self._captured_buckets[bucket] = capture_bucket(
                        bucket, self._pieces, self._ins, self._outs, owner=self._label, runner=self.name,
                        ledger=self._ledger, pool=pool, stream=stream)
                except Exception as e:  # noqa: BLE001 -- raised below, once the other buckets were tried
                    failed[bucket] = e
        finally:
            self._ledger.drop(pool, guard)  # releases a pool of the manager's only if nothing was captured
            self._available = sorted((set(self._available) | set(self._captured_buckets)) - set(failed))
            for bucket in self._captured_buckets:
                self._unavailable.pop(bucket, None)
            self._unavailable.update(dict.fromkeys(failed, _FAILED))
            self._result_cache.clear()
        if failed:
            first = next(iter(failed.values()))
            first.add_note(f"{self._label}: bucket(s) {sorted(failed)} not captured (captured: {self.captured}); "
                           "until a later capture() captures them, steps pad past them, or run eagerly above "
                           "the largest bucket captured")
            raise first

    def _warm_up(self, bucket: int, stream: Any) -> None:
        """Eager runs on the capture stream first, as torch recommends: lazy inits (cuBLAS
        workspaces, autotuning) happen outside capture, and outputs get their static buffers."""
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                for _ in range(self._warmup_iters):
                    self._run_pieces_eagerly(bucket, self._ins.acquire_slot())
        finally:  # also when a piece raised: what it queued on the capture stream is joined
            current.wait_stream(stream)

    def step(self, n: int, *, bucket: int | None = None, **data: object) -> dict[str, torch.Tensor]:
        """Stage `data` (host inputs into the next shadow slot, device inputs into their
        buffers), then replay the bucket's graphs in order with eager pieces in between.

        `bucket` overrides the padded size (e.g. the one agree(runner=...) returned). Returns the
        outputs as views narrowed to n rows, valid until the next step, run_eager() or capture()
        (its warm-up runs the pieces, writing the same buffers); the same view
        objects come back for the same (bucket, n) while it stays among the last
        STEP_CACHE_ENTRIES pairs stepped, so do not change their shape in place.
        """
        if self._closed:
            raise StateError(f"{self._label} is closed")
        n = self._rows(n)
        chosen = self._choose_bucket(n, bucket)
        captured = self._captured_buckets.get(chosen)
        if captured is None:
            raise StateError(f"{self._label}: bucket {chosen} is not captured; call capture() first")
        if any_released():
            # A replay into released memory would fault the context: say which tag instead.
            check_awake(self.device, self._pool and pool_key(self._pool),
                        self._ins.device_buffers() + self._outs.device_buffers())
        slot = self._ins.stage(chosen, n, data)
        plan = captured.plans[slot]
        plan.first.replay()
        self._ins.release_slot(slot)
        for run in plan.rest:
            run()
        key = (chosen, n, slot)
        cache = self._result_cache
        result = cache.get(key)
        if result is not None:
            cache.move_to_end(key)
        else:
            if len(cache) >= STEP_CACHE_ENTRIES:
                cache.popitem(last=False)
            result = cache[key] = self._outs.result(chosen, n, plan.kept)
        return dict(result)

    # -- teardown -----------------------------------------------------------------------

    def _synchronize(self) -> None:
        # A graph or buffer must not be freed while queued work may still use it.
        if self._cuda and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)

    def _drop_plan(self, bucket: int) -> None:
        self._captured_buckets.pop(bucket).destroy(self._ledger, self._pool)
        self._result_cache = OrderedDict((k, v) for k, v in self._result_cache.items() if k[0] != bucket)

    def release(self, bucket: int) -> None:
        """Destroy the graphs of one bucket; steps of that size then pad to the next bucket.

        Static buffers stay (the remaining graphs read them). Pool memory comes back once
        no graph holds the pool and empty_cache runs.
        """
        self._require_open()
        if bucket not in self._captured_buckets:
            raise InvalidArgumentError(f"{self._label}: bucket {bucket!r} is not captured (captured: {self.captured})")
        self._synchronize()
        self._drop_plan(bucket)
        self._available.remove(bucket)
        self._unavailable[bucket] = _RELEASED

    def close(self) -> None:
        """Destroy every graph and drop every static buffer and shadow; idempotent.

        The device memory returns to the allocator; torch.cuda.empty_cache() hands it
        back to the driver. A pool of the runner's own is released; the manager is told
        (RunnerOwner.runner_closed).
        """
        if self._closed:
            return
        self._synchronize()
        for bucket in list(self._captured_buckets):
            self._drop_plan(bucket)
        if self._pool_mode == "own" and self._pool is not None and not self._ledger.is_released(self._pool):
            self._ledger.release(self._pool)
        self._ins.close()
        self._outs.close()
        self._result_cache.clear()
        self._available = []
        self._closed = True
        self._manager.runner_closed(self)
