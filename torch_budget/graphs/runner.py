"""GraphRunner: one forward captured once per bucket, stepped by staging inputs and replaying."""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from .._validate import integer, positive_int
from .buckets import BucketRule, pad_to_bucket, resolve_buckets
from .pools import PoolHandle, PoolLedger, pool_key
from .shadows import ShadowRing
from .static import AxisSize, BufferLayout, StaticBufferRebindError, StaticBuffers, StaticInput, rebind_message

__all__ = ["EagerPiece", "GraphRunner", "RunnerOwner"]

# ---------------------------------------------------------------------------------------
# Runner
# ---------------------------------------------------------------------------------------

# Note [Static outputs make pool sharing safe]
# A piece's outputs are copied, inside its graph, into static output buffers allocated
# outside any pool, and the piece's own result tensors are dropped after capture. So no
# pool block is live between replays, and graphs of all buckets, all pieces, all slots and
# all runners that share one pool may reuse each other's blocks (capturing the largest
# bucket first lets the smaller ones fit in its blocks). What that needs: replays that share
# a pool run one after another on one stream. A runner that replays concurrently with
# another on a second stream must own its pool (pool="own"). The extra copy is one small
# kernel per output inside the graph, no extra launch; last_outputs="in_pool" drops it for
# the last piece (see Note [Outputs kept in the pool]).

# Note [Outputs kept in the pool]
# With last_outputs="in_pool" the outputs of the last piece are not copied into static
# buffers: step() returns the tensors the capture produced, which each replay rewrites in
# place. That saves one copy kernel per output per step. Why it is safe:
# - A captured tensor that the runner keeps alive holds its pool block, so no later capture
#   is given that block. Graphs captured earlier into the same pool may have used it for
#   temporaries, though, and replaying one of them overwrites the output.
# - So the pool must hold only this runner's graphs: pool="own" is required, and no other
#   runner of the manager may capture into that handle. This runner replays nothing between
#   one step and the next, and within a step the last piece's graph replays last (the last
#   piece must be captured, not eager).
# - The next step may overwrite them: the contract step() has for static outputs (valid
#   until the next step; work queued on the same stream before it reads them in time).
# Cost: the outputs live in the pool once per bucket, and once per slot as well when the
# last piece is also the first (see Note [Shadow ring]), instead of one static buffer of
# the largest bucket. Cheap for token ids or a hidden state; weigh it for logits. They have
# no single address, so runner.view() and runner.outputs do not show them; use step()'s
# result. Do not hand the runner's pool to a raw torch capture either.


class EagerPiece:
    """A part of the forward that cannot be captured; it runs eagerly between graphs.

    `fn(buffers)` receives the bucket's StaticBuffers and must write its results in place
    (into a device input or an earlier piece's output) and return None: a tensor it
    returned would be new memory that the next graph cannot see.
    """

    def __init__(self, fn: Callable[[StaticBuffers], None]):
        if not callable(fn):
            raise ValueError(f"EagerPiece needs a callable, got {fn!r}")
        self.fn = fn

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


def _piece_name(piece: object) -> str:
    if isinstance(piece, EagerPiece):
        return piece.name
    return getattr(piece, "__name__", repr(piece))


class _InputCopy:
    """How a step of n rows at one bucket writes one input: built once per (bucket, n).

    `data[s]` / `pad[s]`: the views of slot s's shadow (host inputs; one entry, the device
    buffer, for device inputs) that receive the rows and the padding (pad is None when the
    bucket has no padding). `track`: the rows are the flat prefix [0, data_end) of the
    shadow (batch axis first) and the padding the rest of the bucket, up to view_end, so a
    step may skip refilling padding no earlier step wrote (GraphRunner._dirty).
    """

    __slots__ = ("index", "name", "spec", "shape", "data", "pad", "track", "data_end", "view_end")

    def __init__(self, index: int, name: str, spec: StaticInput, shape: tuple, data: tuple,
                 pad: tuple | None, track: bool, data_end: int, view_end: int):
        self.index = index
        self.name = name
        self.spec = spec
        self.shape = torch.Size(shape)
        self.data = data
        self.pad = pad
        self.track = track
        self.data_end = data_end
        self.view_end = view_end


class _Plan:
    """What a step of one (bucket, slot) replays: the slot's first graph (it holds the
    shadow -> device copies), then the shared later pieces; `kept` are the outputs kept in
    the pool (Note [Outputs kept in the pool])."""

    __slots__ = ("first", "rest", "kept")

    def __init__(self, first: Any, rest: tuple, kept: dict[str, torch.Tensor]):
        self.first = first
        self.rest = rest
        self.kept = kept


class _Captured:
    """One bucket's graphs: a plan per slot, every graph (for reset) and the ledger holders."""

    __slots__ = ("plans", "graphs", "holders")

    def __init__(self, plans: tuple, graphs: list, holders: list):
        self.plans = plans
        self.graphs = graphs
        self.holders = holders


class RunnerOwner(Protocol):
    """What a GraphRunner asks of the manager that made it; GraphPoolManager implements it.

    The runner reads no private state of its manager and the manager none of the runner's:
    the manager hands out the pool to capture into (capture_pool), and the runner reports
    its close (runner_closed). The runner records and drops its graphs in `ledger` itself.
    See Note [Pool ownership].
    """

    device: torch.device
    ledger: PoolLedger

    def capture_pool(self, runner: GraphRunner) -> PoolHandle: ...

    def capture_stream(self) -> Any: ...

    def runner_keeping_outputs_in(self, pool: PoolHandle) -> GraphRunner | None: ...

    def runner_closed(self, runner: GraphRunner) -> None: ...


class GraphRunner:
    """One forward (a sequence of pieces) captured once per bucket; made by GraphPoolManager.runner().

    Public state: `name`, `buckets` (sizes a step may be padded to), `captured`,
    `pool`, `inputs` / `outputs` / `shadows` (StaticBuffers of the full, largest views),
    `shadow_slots`, `static_nbytes` / `shadow_nbytes`. A step: `step(n, **host_data)`; the
    same computation without graphs: `run_eager(n, **host_data)`.
    """

    def __init__(self, manager: RunnerOwner, name: str, pieces: Sequence[Callable | EagerPiece], *,
                 buckets: BucketRule | int | Sequence[int], inputs: Sequence[StaticInput],
                 axes: Mapping[str, AxisSize] | None, output_axes: Mapping[str, int | None] | None,
                 pool: str | PoolHandle, warmup: int, shadow_slots: int = 2, last_outputs: str = "copy"):
        self._buffer_names: set[str] = set()
        self._manager = manager
        self._label = f"graph runner {name!r}"
        self.name = name
        self.device = manager.device
        self._cuda = self.device.type == "cuda"
        if self._cuda and not torch.cuda.is_available():
            raise RuntimeError(
                f"{self._label}: its manager is on {self.device}, but torch sees no CUDA device; "
                "use GraphPoolManager('cpu') to run pieces eagerly without graphs"
            )
        self._pieces = self._check_pieces(pieces)
        self._axes = dict(axes or {})
        self._output_axes = dict(output_axes or {})
        self._warmup_iters = positive_int(warmup, f"{self._label}: warmup iterations")
        shadow_slots = positive_int(shadow_slots, f"{self._label}: shadow_slots")

        self._specs: dict[str, StaticInput] = {}
        for spec in inputs:
            if not isinstance(spec, StaticInput):
                raise ValueError(f"{self._label}: inputs must be StaticInput declarations, got {spec!r}")
            if spec.name in self._specs:
                raise ValueError(f"{self._label}: static input {spec.name!r} is declared twice")
            self._specs[spec.name] = spec
        for spec in self._specs.values():
            for dim in spec.shape:
                if isinstance(dim, str) and dim not in self._axes:
                    raise ValueError(
                        f"{self._label}: static input {spec.name!r} uses symbolic axis {dim!r}, "
                        f"which axes= does not size (declared: {sorted(self._axes)})"
                    )
        self._spec_names = frozenset(self._specs)
        self._host_names = frozenset(n for n, s in self._specs.items() if s.source == "host")
        self._pool_mode, self._pool = self._check_pool(pool)
        self._keep_last = self._check_last_outputs(last_outputs)

        self._all_buckets = resolve_buckets(buckets, cost=self._input_nbytes)
        self._available = list(self._all_buckets)
        self._in_layouts = {
            name: BufferLayout({b: self._input_shape(spec, b) for b in self._all_buckets})
            for name, spec in self._specs.items()
        }

        # Static memory: allocated now, kept until close(). See Note [Static buffer layout]
        # and Note [Shadow ring]: one pinned allocation per host input holds every slot.
        self._slots = shadow_slots if self._host_names else 1
        self._in_flat: dict[str, torch.Tensor] = {}
        self._shadow_flat: dict[str, torch.Tensor] = {}
        slot_flats: list[dict[str, torch.Tensor]] = [{} for _ in range(self._slots)]
        for name, spec in self._specs.items():
            numel = self._in_layouts[name].numel
            self._in_flat[name] = torch.full((numel,), spec.pad_value, dtype=spec.dtype, device=self.device)
            if spec.source == "host":
                shadow = torch.empty((self._slots * numel,), dtype=spec.dtype, pin_memory=self._cuda)
                self._shadow_flat[name] = shadow.fill_(spec.pad_value)
                for slot in range(self._slots):
                    slot_flats[slot][name] = shadow[slot * numel:(slot + 1) * numel]
        self._slot_flat = slot_flats
        self._in_views = {b: {n: self._in_layouts[n].view(f, b) for n, f in self._in_flat.items()}
                          for b in self._all_buckets}
        # _shadow_views[slot][bucket][name]; _copy_pairs[slot][bucket]: (device view, shadow view).
        self._shadow_views = [{b: {n: self._in_layouts[n].view(f, b) for n, f in flats.items()}
                               for b in self._all_buckets} for flats in slot_flats]
        self._copy_pairs = [{b: tuple((self._in_views[b][n], v) for n, v in views[b].items())
                             for b in self._all_buckets} for views in self._shadow_views]
        # _dirty[slot][input index]: shadow elements from here on hold the pad value (tracked
        # inputs only; see _InputCopy). Shadows start filled with it.
        self._dirty = [[0] * len(self._specs) for _ in range(self._slots)]
        self._ring = self._new_ring()
        self._out_layouts: dict[str, BufferLayout] = {}
        self._out_flat: dict[str, torch.Tensor] = {}
        self._out_meta: dict[str, tuple[torch.dtype, torch.device]] = {}
        self._out_axis: dict[str, int | None] = {}
        self._out_producer: dict[str, int] = {}
        self._out_names: list[str] = []
        self._out_kept: set[str] = set()  # see Note [Outputs kept in the pool]
        self._buffer_names.update(self._specs)

        self._captured_buckets: dict[int, _Captured] = {}
        # Hot-path caches, built on first use: (bucket, n) -> (host copies, device copies);
        # (bucket, n, slot) -> the step's result views.
        self._staging_cache: dict[tuple[int, int], tuple[tuple, tuple]] = {}
        self._result_cache: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self._closed = False

    # -- validation ---------------------------------------------------------------------

    def _check_pieces(self, pieces: Sequence) -> list:
        if callable(pieces) or isinstance(pieces, EagerPiece):
            pieces = [pieces]
        pieces = list(pieces)
        for piece in pieces:
            if not (callable(piece) or isinstance(piece, EagerPiece)):
                raise ValueError(f"{self._label}: a piece must be callable or an EagerPiece, got {piece!r}")
        if not pieces or isinstance(pieces[0], EagerPiece):
            first = _piece_name(pieces[0]) if pieces else None
            raise ValueError(
                f"{self._label}: the first piece must be captured (got {first!r}): host inputs are "
                "copied to the device inside the first graph, so an eager piece before it would read stale inputs"
            )
        return pieces

    def _check_pool(self, pool: object) -> tuple[str, PoolHandle | None]:
        if pool in ("shared", "own"):
            return pool, None
        if not isinstance(pool, tuple):
            problem = ValueError if isinstance(pool, str) else TypeError
            raise problem(
                f"{self._label}: pool must be 'shared', 'own' or a handle from "
                f"torch.cuda.graph_pool_handle() / CUDAGraph.pool(), got {pool!r}"
            )
        key = pool_key(pool)
        self._manager.ledger.check_usable(key)
        other = self._manager.runner_keeping_outputs_in(key)
        if other is not None:
            raise ValueError(
                f"{self._label}: graph pool {tuple(key)} belongs to graph runner {other.name!r}, which keeps its "
                "outputs in it (last_outputs='in_pool'); graphs captured into it could overwrite them. "
                "See Note [Outputs kept in the pool]"
            )
        return "external", pool

    def _check_last_outputs(self, last_outputs: object) -> bool:
        if last_outputs not in ("copy", "in_pool"):
            raise ValueError(f"{self._label}: last_outputs must be 'copy' or 'in_pool', got {last_outputs!r}")
        if last_outputs == "copy":
            return False
        if self._pool_mode != "own":
            given = "a handed-in pool" if self._pool_mode == "external" else "pool='shared'"
            raise ValueError(
                f"{self._label}: last_outputs='in_pool' needs pool='own', got {given}: another "
                "runner's replays in a shared pool could overwrite outputs kept there"
            )
        if isinstance(self._pieces[-1], EagerPiece):
            raise ValueError(
                f"{self._label}: last_outputs='in_pool' needs a captured last piece, got eager piece "
                f"{self._pieces[-1].name!r}"
            )
        return True

    def _axis_size(self, axis: str, bucket: int) -> int:
        size = self._axes[axis]
        value = size(bucket) if callable(size) else size
        return positive_int(value, f"{self._label}: size of symbolic axis {axis!r} at bucket {bucket}")

    def _input_shape(self, spec: StaticInput, bucket: int) -> tuple[int, ...]:
        dims = [self._axis_size(d, bucket) if isinstance(d, str) else d for d in spec.shape]
        if spec.batch_axis is not None:
            dims.insert(spec.batch_axis, bucket)
        return tuple(dims)

    def _input_nbytes(self, bucket: int) -> int:
        """Device bytes of the static inputs if `bucket` were the largest (BucketRule.memory_limit)."""
        return sum(math.prod(self._input_shape(s, bucket)) * s.dtype.itemsize for s in self._specs.values())

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._label} is closed")

    def _new_ring(self) -> ShadowRing:
        fenced = self._cuda and bool(self._host_names)
        return ShadowRing(self._slots, torch.cuda.Event if fenced else None)

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
        return self._slots

    @property
    def inputs(self) -> StaticBuffers:
        self._require_open()
        return StaticBuffers(self._label, {n: self._in_layouts[n].full(f) for n, f in self._in_flat.items()})

    @property
    def shadows(self) -> StaticBuffers:
        """The shadow slot the latest step wrote. For reading: writes would go behind the
        runner's padding bookkeeping."""
        return self.shadows_at(self._ring.last)

    def shadows_at(self, slot: int) -> StaticBuffers:
        """The pinned shadows of one slot (full, largest views); for reading."""
        self._require_open()
        slot = integer(slot, f"{self._label}: shadow slot")
        if not 0 <= slot < self._slots:
            raise ValueError(f"{self._label}: shadow slot must be in [0, {self._slots}), got {slot!r}")
        flats = self._slot_flat[slot]
        return StaticBuffers(self._label, {n: self._in_layouts[n].full(f) for n, f in flats.items()})

    @property
    def outputs(self) -> StaticBuffers:
        """Static outputs (full views); outputs kept in the pool are not among them."""
        self._require_open()
        return StaticBuffers(self._label, {n: self._out_layouts[n].full(f) for n, f in self._out_flat.items()})

    @property
    def static_nbytes(self) -> int:
        """Device bytes of static inputs and outputs (graph pools not included)."""
        flats = list(self._in_flat.values()) + list(self._out_flat.values())
        return sum(t.numel() * t.element_size() for t in flats)

    @property
    def shadow_nbytes(self) -> int:
        """Pinned host bytes of the shadows, all slots."""
        return sum(t.numel() * t.element_size() for t in self._shadow_flat.values())

    @property
    def closed(self) -> bool:
        return self._closed

    def view(self, name: str, bucket: int) -> torch.Tensor:
        """The device view of static buffer `name` that the graph for `bucket` uses."""
        self._require_open()
        if bucket not in self._in_views:
            raise ValueError(f"{self._label}: {bucket!r} is not one of its buckets {self._all_buckets}")
        if name in self._in_views[bucket]:
            return self._in_views[bucket][name]
        if name in self._out_flat:
            return self._out_layouts[name].view(self._out_flat[name], bucket)
        if name in self._out_kept:
            raise ValueError(
                f"{self._label}: output {name!r} is kept in the graph pool (last_outputs='in_pool'), "
                "at an address per bucket and slot; take it from step()'s result"
            )
        raise KeyError(f"{self._label} has no static buffer {name!r}; it has {sorted(self._buffer_names)}")

    def bucket_for(self, n: int) -> int | None:
        """The bucket a step of n rows is padded to; None above the largest (run it eagerly)."""
        return pad_to_bucket(self._available, n)

    def __getattr__(self, name: str) -> torch.Tensor:
        if name.startswith("_") or name not in self.__dict__.get("_buffer_names", ()):
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        if name in self._in_flat:
            return self._in_layouts[name].full(self._in_flat[name])
        return self._out_layouts[name].full(self._out_flat[name])

    def __setattr__(self, name: str, value: object) -> None:
        if name in self.__dict__.get("_buffer_names", ()):
            raise StaticBufferRebindError(rebind_message(self._label, name))
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"captured={self.captured}"
        return f"GraphRunner({self.name!r}, buckets={self._all_buckets}, {state})"

    # -- staging ------------------------------------------------------------------------

    def _rows(self, n: object) -> int:
        """A step's row count n as an int >= 1."""
        if type(n) is int and n >= 1:  # the common case, without building a message
            return n
        return positive_int(n, f"{self._label}: row count n")

    def _choose_bucket(self, n: int, bucket: int | None) -> int:
        """The bucket a step of n rows (an int >= 1, see _rows) is padded to."""
        if bucket is None:
            available = self._available
            i = bisect.bisect_left(available, n)
            if i == len(available):
                top = available[-1] if available else None
                raise ValueError(
                    f"{self._label}: {n} rows exceed its largest bucket {top}; run this step "
                    "eagerly (bucket_for(n) returns None for such steps)"
                )
            return available[i]
        if bucket not in self._available or bucket < n:
            raise ValueError(
                f"{self._label}: bucket {bucket!r} cannot hold {n} rows "
                f"(buckets: {tuple(self._available)})"
            )
        return bucket

    def _staging(self, bucket: int, n: int) -> tuple[tuple, tuple]:
        """(host copies, device copies) for a step of n rows at `bucket`; cached."""
        key = (bucket, n)
        staging = self._staging_cache.get(key)
        if staging is None:
            host, device = [], []
            for index, (name, spec) in enumerate(self._specs.items()):
                cap = self._in_layouts[name].shapes[bucket]
                axis = spec.batch_axis
                shape = cap if axis is None else cap[:axis] + (n,) + cap[axis + 1:]
                if spec.source == "host":
                    targets = [self._shadow_views[s][bucket][name] for s in range(self._slots)]
                else:
                    targets = [self._in_views[bucket][name]]
                data = tuple(t if axis is None else t.narrow(axis, 0, n) for t in targets)
                pad = None
                if axis is not None and n < cap[axis]:
                    pad = tuple(t.narrow(axis, n, cap[axis] - n) for t in targets)
                copy = _InputCopy(index, name, spec, shape, data, pad, track=spec.source == "host" and axis == 0,
                                  data_end=math.prod(shape), view_end=math.prod(cap))
                (host if spec.source == "host" else device).append(copy)
            staging = self._staging_cache[key] = (tuple(host), tuple(device))
        return staging

    def _stage(self, bucket: int, n: int, data: Mapping[str, object]) -> int:
        """Write a step's data: host inputs into the next shadow slot, device inputs into
        their static buffers; returns the slot. See Note [Shadow ring]."""
        keys = data.keys()
        if not (keys <= self._spec_names and self._host_names <= keys):
            self._reject_names(data)
        host, device = self._staging(bucket, n)
        slot = self._ring.acquire()
        dirty = self._dirty[slot]
        for copy in host:
            value = data[copy.name]
            if (type(value) is torch.Tensor and value.shape == copy.shape
                    and value.dtype == copy.spec.dtype and value.is_cpu):
                if copy.track:
                    # Refill padding only where an earlier step of this slot left rows, and
                    # then all of them, so that smaller steps after it find clean padding.
                    end = dirty[copy.index]
                    if end > copy.data_end:
                        if end <= copy.view_end:
                            copy.pad[slot].fill_(copy.spec.pad_value)
                        else:
                            self._slot_flat[slot][copy.name][copy.data_end:end].fill_(copy.spec.pad_value)
                    dirty[copy.index] = copy.data_end
                elif copy.pad is not None:
                    copy.pad[slot].fill_(copy.spec.pad_value)
                copy.data[slot].copy_(value)
            else:
                self._write(copy.spec, self._shadow_views[slot][bucket][copy.name], value, n, bucket)
                dirty[copy.index] = max(dirty[copy.index], copy.view_end)
        for copy in device:
            if copy.name not in data:
                continue
            value = data[copy.name]
            if type(value) is torch.Tensor and value.shape == copy.shape and value.dtype == copy.spec.dtype:
                # Callers may write device buffers in place, so their padding is always refilled.
                if copy.pad is not None:
                    copy.pad[0].fill_(copy.spec.pad_value)
                copy.data[0].copy_(value)
            else:
                self._write(copy.spec, self._in_views[bucket][copy.name], value, n, bucket)
        return slot

    def _reject_names(self, data: Mapping[str, object]) -> None:
        unknown = set(data) - self._spec_names
        if unknown:
            raise ValueError(f"{self._label}: unknown static input(s) {sorted(unknown)}; declared: {sorted(self._specs)}")
        missing = [name for name in self._specs if name in self._host_names and name not in data]
        raise ValueError(
            f"{self._label}: host input(s) {missing} missing; every host-sourced input is "
            "copied by the graph each step, so each step must provide it"
        )

    def _write(self, spec: StaticInput, target: torch.Tensor, value: object, n: int, bucket: int) -> None:
        """Copy `value` into the leading corner of `target` and pad the rest (any shape or dtype)."""
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        where = f"{self._label}: input {spec.name!r}"
        if spec.source == "host" and value.device.type != "cpu":
            raise ValueError(
                f"{where} is host-sourced but got a tensor on {value.device}; pass a CPU tensor "
                "(reading a device tensor back would synchronise) or declare source='device'"
            )
        if not torch.can_cast(value.dtype, spec.dtype):
            raise TypeError(f"{where} has dtype {spec.dtype}; got {value.dtype}, which does not cast safely")
        shape, cap = tuple(value.shape), tuple(target.shape)
        if len(shape) != len(cap):
            raise ValueError(f"{where} expects {len(cap)} dims like {cap} at bucket {bucket}, got shape {shape}")
        axis = spec.batch_axis
        if axis is not None and shape[axis] != n:
            raise ValueError(f"{where} has {shape[axis]} rows on batch axis {axis}, but the step has n={n}")
        if any(s > c for s, c in zip(shape, cap)):
            raise ValueError(f"{where} has shape {shape}, larger than its static buffer {cap} at bucket {bucket}")
        if shape == cap:
            target.copy_(value)
            return
        differs = [d for d in range(len(cap)) if shape[d] != cap[d]]
        if differs == [axis]:
            target.narrow(axis, n, cap[axis] - n).fill_(spec.pad_value)
            target.narrow(axis, 0, n).copy_(value)
        else:
            target.fill_(spec.pad_value)
            target[tuple(slice(0, s) for s in shape)].copy_(value)

    def _copy_inputs(self, bucket: int, slot: int) -> None:
        """Shadow slot -> device static copies; captured into the slot's first graph of each bucket."""
        for static, shadow in self._copy_pairs[slot][bucket]:
            static.copy_(shadow, non_blocking=True)

    def _release_slot(self, slot: int) -> None:
        # See Note [Shadow ring]: after the work reading the slot has been queued.
        if self._ring.fenced:
            self._ring.release(slot, torch.cuda.current_stream(self.device))

    # -- outputs ------------------------------------------------------------------------

    def _store_outputs(self, index: int, bucket: int, result: object,
                       capturing: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Copy a piece's results into static outputs; returns (static views, outputs kept
        as they are). See Note [Static outputs make pool sharing safe]."""
        pname = _piece_name(self._pieces[index])
        if result is None:
            return {}, {}
        if not isinstance(result, Mapping):
            raise TypeError(
                f"{self._label}: piece {pname!r} returned {type(result).__name__}; a piece returns "
                "a dict of named output tensors, or None"
            )
        views, kept = {}, {}
        for name, tensor in result.items():
            where = f"{self._label}: output {name!r} of piece {pname!r}"
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{where} is a {type(tensor).__name__}, not a tensor")
            if name not in self._out_layouts:
                if capturing:
                    raise RuntimeError(f"{where} appeared during capture but not during warm-up; pieces must be deterministic")
                self._add_output(index, name, tensor, bucket, where)
            elif self._out_producer[name] != index:
                other = _piece_name(self._pieces[self._out_producer[name]])
                raise ValueError(f"{where}: piece {other!r} already produces an output of that name")
            expected = self._out_layouts[name].shapes[bucket]
            dtype, device = self._out_meta[name]
            if tuple(tensor.shape) != expected or tensor.dtype != dtype or tensor.device != device:
                raise ValueError(
                    f"{where} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} at bucket {bucket}; "
                    f"expected {expected} {dtype} on {device} (only its batch axis "
                    f"{self._out_axis[name]} may follow the bucket)"
                )
            if name in self._out_kept:
                kept[name] = tensor
                continue
            view = self._out_layouts[name].view(self._out_flat[name], bucket)
            view.copy_(tensor)
            views[name] = view
        return views, kept

    def _add_output(self, index: int, name: str, tensor: torch.Tensor, bucket: int, where: str) -> None:
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"{where}: output names must be identifiers not starting with '_'")
        if name in self._specs:
            raise ValueError(f"{where} has the name of a static input; give it another name")
        axis = self._output_axes.get(name, 0)
        shape = list(tensor.shape)
        if axis is not None:
            axis = integer(axis, f"{where}: output_axes[{name!r}]")
            if not 0 <= axis < len(shape) or shape[axis] != bucket:
                raise ValueError(
                    f"{where} has shape {tuple(shape)} at bucket {bucket}; its batch axis {axis!r} should "
                    f"have size {bucket}. Set output_axes={{{name!r}: <axis>}}, or None for an output "
                    "that does not follow the bucket"
                )
        shapes = {}
        for b in self._all_buckets:
            if axis is not None:
                shape[axis] = b
            shapes[b] = tuple(shape)
        layout = BufferLayout(shapes)
        self._out_layouts[name] = layout
        self._out_meta[name] = (tensor.dtype, tensor.device)
        self._out_axis[name] = axis
        self._out_producer[name] = index
        self._out_names.append(name)
        if self._keep_last and index == len(self._pieces) - 1:
            self._out_kept.add(name)  # no static buffer; see Note [Outputs kept in the pool]
            return
        self._out_flat[name] = torch.zeros((layout.numel,), dtype=tensor.dtype, device=tensor.device)
        self._buffer_names.add(name)

    def _result(self, bucket: int, n: int, kept: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name in self._out_names:
            if name in self._out_kept:
                tensor = kept[name]
            else:
                tensor = self._out_layouts[name].view(self._out_flat[name], bucket)
            axis = self._out_axis[name]
            out[name] = tensor if axis is None else tensor.narrow(axis, 0, n)
        return out

    # -- eager, warm-up, capture, replay ------------------------------------------------

    def _run_pieces_eagerly(self, bucket: int, slot: int) -> dict[str, torch.Tensor]:
        self._copy_inputs(bucket, slot)
        self._release_slot(slot)
        visible = dict(self._in_views[bucket])
        kept: dict[str, torch.Tensor] = {}
        for index, piece in enumerate(self._pieces):
            buffers = StaticBuffers(self._label, dict(visible), bucket)
            if isinstance(piece, EagerPiece):
                self._call_eager(piece, buffers)
            else:
                views, piece_kept = self._store_outputs(index, bucket, piece(buffers), capturing=False)
                visible.update(views)
                kept.update(piece_kept)
        return kept

    def _call_eager(self, piece: EagerPiece, buffers: StaticBuffers) -> None:
        if piece.fn(buffers) is not None:
            raise TypeError(
                f"{self._label}: eager piece {piece.name!r} returned a value; it must write its "
                "results in place into static buffers and return None"
            )

    def run_eager(self, n: int, *, bucket: int | None = None, **data: object) -> dict[str, torch.Tensor]:
        """The step's computation without graphs, through the same static buffers and padding.

        The reference for a replay, and the way to run a runner on a CPU device.
        """
        self._require_open()
        n = self._rows(n)
        chosen = self._choose_bucket(n, bucket)
        slot = self._stage(chosen, n, data)
        kept = self._run_pieces_eagerly(chosen, slot)
        return self._result(chosen, n, kept)

    def capture(self) -> None:
        """Warm up and capture every bucket not yet captured, largest first.

        Largest first: a smaller bucket's graph can then reuse blocks the larger one freed
        in the shared pool (see Note [Static outputs make pool sharing safe]). The first
        piece is captured once per shadow slot (see Note [Shadow ring]).
        """
        self._require_open()
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"{self._label} lives on {self.device}; CUDA graph capture needs a CUDA device")
        pending = [b for b in reversed(self._all_buckets) if b not in self._captured_buckets]
        if not pending:
            return
        pool = self._pool = self._manager.capture_pool(self)
        stream = self._manager.capture_stream()
        try:
            for bucket in pending:
                self._warm_up(bucket, stream)
                self._capture_bucket(bucket, pool, stream)
        finally:
            self._available = sorted(set(self._available) | set(self._captured_buckets))
            self._result_cache.clear()

    def _warm_up(self, bucket: int, stream: Any) -> None:
        """Eager runs on the capture stream first, as torch recommends: lazy inits (cuBLAS
        workspaces, autotuning) happen outside capture, and outputs get their static buffers."""
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(self._warmup_iters):
                self._run_pieces_eagerly(bucket, self._ring.acquire())
        current.wait_stream(stream)

    def _capture_graph(self, index: int, bucket: int, buffers: StaticBuffers, pool: PoolHandle,
                       stream: Any, graphs: list, slot: int | None = None) -> tuple[dict, dict]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            if slot is not None:
                self._copy_inputs(bucket, slot)
            stored = self._store_outputs(index, bucket, self._pieces[index](buffers), capturing=True)
        # The piece's own result tensors are gone now (unless kept); their pool blocks are
        # free for the next capture.
        graphs.append(graph)
        return stored

    def _capture_bucket(self, bucket: int, pool: PoolHandle, stream: Any) -> None:
        ledger = self._manager.ledger
        graphs: list = []
        holders: list = []
        try:
            visible = dict(self._in_views[bucket])
            buffers = StaticBuffers(self._label, dict(visible), bucket)
            firsts = []
            for slot in range(self._slots):
                views, kept = self._capture_graph(0, bucket, buffers, pool, stream, graphs, slot)
                firsts.append((graphs[-1], kept))
            # One holder stands for the graphs of (runner, bucket, piece), all slots.
            ledger.acquire(pool, (self.name, bucket, 0))
            holders.append((self.name, bucket, 0))
            visible.update(views)
            rest: list = []
            kept_rest: dict[str, torch.Tensor] = {}
            for index in range(1, len(self._pieces)):
                piece = self._pieces[index]
                buffers = StaticBuffers(self._label, dict(visible), bucket)
                if isinstance(piece, EagerPiece):
                    rest.append(functools.partial(self._call_eager, piece, buffers))
                    continue
                views, kept = self._capture_graph(index, bucket, buffers, pool, stream, graphs)
                ledger.acquire(pool, (self.name, bucket, index))
                holders.append((self.name, bucket, index))
                rest.append(graphs[-1].replay)
                visible.update(views)
                kept_rest.update(kept)
        except BaseException:
            # Undo this bucket's partial capture, then let the error through.
            for graph in graphs:
                graph.reset()
            for holder in holders:
                ledger.drop(pool, holder)
            raise
        plans = tuple(_Plan(first, tuple(rest), {**kept, **kept_rest}) for first, kept in firsts)
        self._captured_buckets[bucket] = _Captured(plans, graphs, holders)

    def step(self, n: int, *, bucket: int | None = None, **data: object) -> dict[str, torch.Tensor]:
        """Stage `data` (host inputs into the next shadow slot, device inputs into their
        buffers), then replay the bucket's graphs in order with eager pieces in between.

        `bucket` overrides the padded size (e.g. the one agree() returned). Returns the
        outputs as views narrowed to n rows, valid until the next step; the same view
        objects come back for the same (bucket, n), so do not change their shape in place.
        """
        if self._closed:
            raise RuntimeError(f"{self._label} is closed")
        n = self._rows(n)
        chosen = self._choose_bucket(n, bucket)
        captured = self._captured_buckets.get(chosen)
        if captured is None:
            raise RuntimeError(f"{self._label}: bucket {chosen} is not captured; call capture() first")
        slot = self._stage(chosen, n, data)
        plan = captured.plans[slot]
        plan.first.replay()
        if self._ring.fenced:
            self._ring.release(slot, torch.cuda.current_stream(self.device))
        for run in plan.rest:
            run()
        key = (chosen, n, slot)
        result = self._result_cache.get(key)
        if result is None:
            result = self._result_cache[key] = self._result(chosen, n, plan.kept)
        return dict(result)

    # -- teardown -----------------------------------------------------------------------

    def _synchronize(self) -> None:
        # A graph or buffer must not be freed while queued work may still use it.
        if self._cuda and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)

    def _drop_plan(self, bucket: int) -> None:
        captured = self._captured_buckets.pop(bucket)
        for graph in captured.graphs:
            graph.reset()
        for holder in captured.holders:
            self._manager.ledger.drop(self._pool, holder)
        self._result_cache = {k: v for k, v in self._result_cache.items() if k[0] != bucket}

    def release(self, bucket: int) -> None:
        """Destroy the graphs of one bucket; steps of that size then pad to the next bucket.

        Static buffers stay (the remaining graphs read them). Pool memory comes back once
        no graph holds the pool and empty_cache runs.
        """
        self._require_open()
        if bucket not in self._captured_buckets:
            raise ValueError(f"{self._label}: bucket {bucket!r} is not captured (captured: {self.captured})")
        self._synchronize()
        self._drop_plan(bucket)
        self._available.remove(bucket)

    def close(self) -> None:
        """Destroy every graph and drop every static buffer and shadow; idempotent.

        The device memory returns to the allocator; torch.cuda.empty_cache() hands it
        back to the driver.
        """
        if self._closed:
            return
        self._synchronize()
        for bucket in list(self._captured_buckets):
            self._drop_plan(bucket)
        if self._pool_mode == "own" and self._pool is not None and not self._manager.ledger.is_released(self._pool):
            self._manager.ledger.release(self._pool)
        for store in (self._in_flat, self._shadow_flat, self._out_flat, self._in_views,
                      self._staging_cache, self._result_cache):
            store.clear()
        self._slot_flat, self._shadow_views, self._copy_pairs = [], [], []
        self._available = []
        self._ring = ShadowRing(self._slots, None)
        self._closed = True
        self._manager.runner_closed(self)
