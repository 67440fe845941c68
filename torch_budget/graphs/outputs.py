"""A runner's outputs: static output buffers that each piece's results are copied into,
or, for the last piece, the tensors its graph writes in the pool."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .._validate import integer
from .pieces import piece_name
from .static import BufferLayout
from ..errors import InvalidArgumentError

__all__ = ["StaticOutputs"]


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


class StaticOutputs:
    """The outputs of a runner's pieces, declared by what the pieces return in the first
    eager run (warm-up or run_eager) and fixed from then on.

    store() checks one piece's results against that and copies them into static buffers of
    the largest bucket (Note [Static outputs make pool sharing safe]), except the last
    piece's when `keep_last` (Note [Outputs kept in the pool]); result() gives a step's
    outputs narrowed to its rows.
    """

    def __init__(self, owner: str, pieces: Sequence, input_names: frozenset[str],
                 output_axes: Mapping[str, int | None], buckets: Sequence[int], keep_last: bool):
        self._label = owner
        self._pieces = pieces
        self._input_names = input_names
        self._output_axes = dict(output_axes)
        self._buckets = tuple(buckets)
        self._keep_last = keep_last
        self._layouts: dict[str, BufferLayout] = {}
        self._flat: dict[str, torch.Tensor] = {}
        self._meta: dict[str, tuple[torch.dtype, torch.device]] = {}
        self._axis: dict[str, int | None] = {}
        self._producer: dict[str, int] = {}
        self._names: list[str] = []
        self._kept: set[str] = set()  # see Note [Outputs kept in the pool]
        self._static: list[str] = []  # outputs with a static buffer; kept after close()

    @property
    def static_names(self) -> tuple[str, ...]:
        """Outputs with a static buffer (not those kept in the pool)."""
        return tuple(self._static)

    def full(self, name: str) -> torch.Tensor:
        """The full (largest) view of the static buffer of output `name`."""
        return self._layouts[name].full(self._flat[name])

    def full_views(self) -> dict[str, torch.Tensor]:
        return {n: self._layouts[n].full(f) for n, f in self._flat.items()}

    def view(self, name: str, bucket: int) -> torch.Tensor | None:
        """The static view of output `name` at `bucket`; None for no output of that name."""
        if name in self._flat:
            return self._layouts[name].view(self._flat[name], bucket)
        if name in self._kept:
            raise InvalidArgumentError(
                f"{self._label}: output {name!r} is kept in the graph pool (last_outputs='in_pool'), "
                "at an address per bucket and slot; take it from step()'s result"
            )
        return None

    def device_buffers(self) -> list[torch.Tensor]:
        """The buffer of every static output."""
        return list(self._flat.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flat.values())

    def close(self) -> None:
        self._flat.clear()

    def store(self, index: int, bucket: int, result: object,
              capturing: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Copy a piece's results into static outputs; returns (static views, outputs kept
        as they are), all untracked by autograd. See Note [Static outputs make pool sharing safe]."""
        pname = piece_name(self._pieces[index])
        if result is not None and not isinstance(result, Mapping):
            raise TypeError(
                f"{self._label}: piece {pname!r} returned {type(result).__name__}; a piece returns "
                "a dict of named output tensors, or None"
            )
        # A step's result lists every output: one a piece no longer returns would come back stale.
        missing = [name for name in self._names if self._producer[name] == index and (result is None or name not in result)]
        if missing:
            raise InvalidArgumentError(f"{self._label}: piece {pname!r} did not return {missing}, which it returned "
                                       "before; a piece returns the same outputs at every step")
        if result is None:
            return {}, {}
        views, kept = {}, {}
        for name, tensor in result.items():
            where = f"{self._label}: output {name!r} of piece {pname!r}"
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{where} is a {type(tensor).__name__}, not a tensor")
            if name not in self._layouts:
                if capturing:
                    raise RuntimeError(f"{where} appeared during capture but not during warm-up; pieces must be deterministic")
                self._add(index, name, tensor, bucket, where)
            elif self._producer[name] != index:
                other = piece_name(self._pieces[self._producer[name]])
                raise InvalidArgumentError(f"{where}: piece {other!r} already produces an output of that name")
            expected = self._layouts[name].shapes[bucket]
            dtype, device = self._meta[name]
            if tuple(tensor.shape) != expected or tensor.dtype != dtype or tensor.device != device:
                raise InvalidArgumentError(
                    f"{where} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} at bucket {bucket}; "
                    f"expected {expected} {dtype} on {device} (only its batch axis "
                    f"{self._axis[name]} may follow the bucket)"
                )
            # Detached: gradients cannot flow through a replay, and an in-place copy of a tracked
            # tensor would make the static buffer tracked, each run chaining its graph onto the last.
            tensor = tensor.detach()
            if name in self._kept:
                kept[name] = tensor
                continue
            view = self._layouts[name].view(self._flat[name], bucket)
            view.copy_(tensor)
            views[name] = view
        return views, kept

    def _add(self, index: int, name: str, tensor: torch.Tensor, bucket: int, where: str) -> None:
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise InvalidArgumentError(f"{where}: output names must be identifiers not starting with '_'")
        if name in self._input_names:
            raise InvalidArgumentError(f"{where} has the name of a static input; give it another name")
        axis = self._output_axes.get(name, 0)
        shape = list(tensor.shape)
        if axis is not None:
            axis = integer(axis, f"{where}: output_axes[{name!r}]")
            if not 0 <= axis < len(shape) or shape[axis] != bucket:
                raise InvalidArgumentError(
                    f"{where} has shape {tuple(shape)} at bucket {bucket}; its batch axis {axis!r} should "
                    f"have size {bucket}. Set output_axes={{{name!r}: <axis>}}, or None for an output "
                    "that does not follow the bucket"
                )
        shapes = {}
        for b in self._buckets:
            if axis is not None:
                shape[axis] = b
            shapes[b] = tuple(shape)
        layout = BufferLayout(shapes)
        kept = self._keep_last and index == len(self._pieces) - 1  # no static buffer: Note [Outputs kept in the pool]
        # Allocated before anything is recorded: an out-of-memory error leaves the output unknown,
        # so that the next step allocates it again.
        flat = None if kept else torch.zeros((layout.numel,), dtype=tensor.dtype, device=tensor.device)
        self._layouts[name] = layout
        self._meta[name] = (tensor.dtype, tensor.device)
        self._axis[name] = axis
        self._producer[name] = index
        self._names.append(name)
        if kept:
            self._kept.add(name)
            return
        self._flat[name] = flat
        self._static.append(name)

    def result(self, bucket: int, n: int, kept: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every output of a step of n rows at `bucket`; `kept` holds the outputs kept in the pool."""
        out = {}
        for name in self._names:
            if name in self._kept:
                tensor = kept[name]
            else:
                tensor = self._layouts[name].view(self._flat[name], bucket)
            axis = self._axis[name]
            out[name] = tensor if axis is None else tensor.narrow(axis, 0, n)
        return out
