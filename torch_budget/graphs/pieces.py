"""The pieces of a forward: captured callables and EagerPiece, which runs between graphs."""

from __future__ import annotations

from collections.abc import Callable

from .static import StaticBuffers
from ..errors import InvalidArgumentError

__all__ = ["EagerPiece", "call_eager", "piece_name"]


class EagerPiece:
    """A part of the forward that cannot be captured; it runs eagerly between graphs.

    `fn(buffers)` receives the bucket's StaticBuffers and must write its results in place
    (into a device input or an earlier piece's output) and return None: a tensor it
    returned would be new memory that the next graph cannot see.
    """

    def __init__(self, fn: Callable[[StaticBuffers], None]):
        if not callable(fn):
            raise InvalidArgumentError(f"EagerPiece needs a callable, got {fn!r}")
        self.fn = fn

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


def piece_name(piece: object) -> str:
    """The name error messages give a piece."""
    if isinstance(piece, EagerPiece):
        return piece.name
    return getattr(piece, "__name__", repr(piece))


def call_eager(label: str, piece: EagerPiece, buffers: StaticBuffers) -> None:
    """Run an eager piece of runner `label`; it must return None."""
    if piece.fn(buffers) is not None:
        raise TypeError(
            f"{label}: eager piece {piece.name!r} returned a value; it must write its "
            "results in place into static buffers and return None"
        )
