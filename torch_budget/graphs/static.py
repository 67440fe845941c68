"""Graph-visible static buffers: input declarations, their per-bucket layout, and the
read-only view that refuses rebinding."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Union

import torch

from .._validate import integer, positive_int
from ..errors import InvalidArgumentError, StaticBufferRebindError

AxisSize = Union[int, Callable[[int], int]]


# Note [Static buffer layout]
# Each static buffer (device input, host shadow, output) is one flat allocation of the
# largest element count any captured bucket needs. The view for bucket b is the contiguous
# prefix flat[:numel(b)].view(shape(b)). With the batch axis first this is exactly buf[:b];
# for any other layout (batch axis elsewhere, or a symbolic axis whose size depends on the
# bucket) a prefix still is contiguous, so the captured host-to-device copy moves
# numel(b) elements in one memcpy instead of a strided copy of the maximum shape. Each
# graph always sees the same view of its bucket, so the reinterpretation is invisible
# to it; code that fills a buffer for bucket b uses runner.view(name, b) or step().


@dataclass(frozen=True)
class StaticInput:
    """A graph-visible input.

    `shape` is the shape without the batch axis; `batch_axis` says where the bucketed
    (batch / token) axis is inserted, or None for an input whose shape does not follow
    the bucket. A str entry in `shape` names a symbolic axis whose size the runner's
    `axes` gives (a constant, or a function of the bucket); the buffer is sized at that
    axis's maximum over the captured buckets. `source="host"` inputs get a pinned host
    shadow whose copy to the device is captured in the graph; `source="device"` inputs are
    written on the device (by step(), an eager piece, or in place by the caller).
    `pad_value` fills the rows a step does not provide (e.g. -1 for a KV slot mapping, so
    padded rows write nowhere).
    """

    name: str
    dtype: torch.dtype
    shape: tuple = ()
    batch_axis: int | None = 0
    source: str = "host"
    pad_value: int | float | bool = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name.startswith("_"):
            raise InvalidArgumentError(f"static input name must be an identifier not starting with '_', got {self.name!r}")
        if self.name in ("n", "bucket"):  # step(n, *, bucket=None, **data) could never be given it
            raise InvalidArgumentError(f"static input name {self.name!r} is a parameter of step() and run_eager(); "
                                       "give the input another name")
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(f"static input {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.shape, (tuple, list)):
            raise InvalidArgumentError(f"static input {self.name!r}: shape must be a tuple of dimensions (ints, or "
                                       f"names of symbolic axes), got {self.shape!r}")
        shape = []
        for dim in self.shape:
            if isinstance(dim, str):
                if not dim:
                    raise InvalidArgumentError(f"static input {self.name!r}: a symbolic axis needs a non-empty name")
                shape.append(dim)
            else:
                shape.append(positive_int(dim, f"static input {self.name!r}: dimension {dim!r}"))
        object.__setattr__(self, "shape", tuple(shape))
        if self.batch_axis is not None:
            axis = integer(self.batch_axis, f"static input {self.name!r}: batch_axis")
            if not 0 <= axis <= len(shape):
                raise InvalidArgumentError(
                    f"static input {self.name!r}: batch_axis must be None or in [0, {len(shape)}], got {axis!r}"
                )
            object.__setattr__(self, "batch_axis", axis)
        if self.source not in ("host", "device"):
            raise InvalidArgumentError(f"static input {self.name!r}: source must be 'host' or 'device', got {self.source!r}")
        if not isinstance(self.pad_value, (int, float)):
            raise InvalidArgumentError(f"static input {self.name!r}: pad_value must be a number, got {self.pad_value!r}")
        floating = self.dtype.is_floating_point or self.dtype.is_complex
        if not floating and self.dtype != torch.bool:
            pad = float(self.pad_value)
            if not math.isfinite(pad) or pad != math.floor(pad):
                raise InvalidArgumentError(
                    f"static input {self.name!r}: pad_value {self.pad_value!r} is not an integer for {self.dtype}")
            limits = torch.iinfo(self.dtype)
            if not limits.min <= self.pad_value <= limits.max:
                raise InvalidArgumentError(f"static input {self.name!r}: pad_value {self.pad_value!r} does not fit "
                                           f"{self.dtype} ([{limits.min}, {limits.max}])")


class BufferLayout:
    """Per-bucket shapes of one static buffer and its flat size. See Note [Static buffer layout]."""

    __slots__ = ("shapes", "max_shape", "numel")

    def __init__(self, shapes: dict[int, tuple[int, ...]]):
        self.shapes = shapes
        ndim = len(next(iter(shapes.values())))
        self.max_shape = tuple(max(s[d] for s in shapes.values()) for d in range(ndim))
        self.numel = math.prod(self.max_shape)

    def view(self, flat: torch.Tensor, bucket: int) -> torch.Tensor:
        shape = self.shapes[bucket]
        return flat[: math.prod(shape)].view(shape)

    def full(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.max_shape)


def input_shape(spec: StaticInput, bucket: int, axes: Mapping[str, AxisSize], owner: str) -> tuple[int, ...]:
    """The shape of `spec`'s buffer at `bucket`: symbolic axes sized by `axes`, the bucket
    inserted at the batch axis."""
    dims = [_axis_size(axes, d, bucket, owner) if isinstance(d, str) else d for d in spec.shape]
    if spec.batch_axis is not None:
        dims.insert(spec.batch_axis, bucket)
    return tuple(dims)


def _axis_size(axes: Mapping[str, AxisSize], axis: str, bucket: int, owner: str) -> int:
    size = axes[axis]
    value = size(bucket) if callable(size) else size
    return positive_int(value, f"{owner}: size of symbolic axis {axis!r} at bucket {bucket}")


def inputs_nbytes(specs: Iterable[StaticInput], axes: Mapping[str, AxisSize], bucket: int, owner: str) -> int:
    """Device bytes of the static inputs if `bucket` were the largest (BucketRule.memory_limit)."""
    return sum(math.prod(input_shape(s, bucket, axes, owner)) * s.dtype.itemsize for s in specs)


def rebind_message(owner: str, name: str) -> str:
    return (
        f"{owner}: static buffer {name!r} is read by captured CUDA graphs at a fixed address; "
        f"rebinding it to a new tensor would leave the graphs reading the old one. Write in "
        f"place instead: buffers[{name!r}].copy_(new) or runner.step(n, {name}=new)"
    )


class StaticBuffers(Mapping):
    """A read-only name -> tensor view of graph-visible buffers.

    Assigning (item or attribute) raises StaticBufferRebindError naming the buffer,
    because the graphs keep reading the old address; write with `.copy_()` instead.
    `bucket` is the bucket the views belong to (None for the full, largest views).
    """

    __slots__ = ("_owner", "_tensors", "_bucket")

    def __init__(self, owner: str, tensors: dict[str, torch.Tensor], bucket: int | None = None):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_tensors", tensors)
        object.__setattr__(self, "_bucket", bucket)

    @property
    def bucket(self) -> int | None:
        return self._bucket

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self._owner} has no static buffer {name!r}; it has {sorted(self._tensors)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __getattr__(self, name: str) -> torch.Tensor:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._tensors[name]
        except KeyError:
            raise AttributeError(f"{self._owner} has no static buffer {name!r}") from None

    def __setitem__(self, name: str, value: object) -> None:
        raise StaticBufferRebindError(rebind_message(self._owner, name))

    def __setattr__(self, name: str, value: object) -> None:
        raise StaticBufferRebindError(rebind_message(self._owner, name))

    def __delitem__(self, name: str) -> None:
        raise StaticBufferRebindError(rebind_message(self._owner, name))

    def __delattr__(self, name: str) -> None:
        raise StaticBufferRebindError(rebind_message(self._owner, name))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self._tensors.items())
        return f"StaticBuffers({self._owner}, bucket={self._bucket}, {{{shapes}}})"
