"""Checks of GraphRunner's arguments (pieces, inputs, pool, last_outputs), each returning
the checked value. `owner` is the runner's label for messages."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .pieces import EagerPiece, piece_name
from .pools import PoolHandle, PoolLedger, pool_key
from .static import AxisSize, StaticInput
from ..errors import InvalidArgumentError

__all__ = ["check_inputs", "check_last_outputs", "check_pieces", "check_pool"]


def check_pieces(owner: str, pieces: Any) -> list:
    """The pieces as a list; the first one must be captured."""
    if callable(pieces) or isinstance(pieces, EagerPiece):
        pieces = [pieces]
    pieces = list(pieces)
    for piece in pieces:
        if not (callable(piece) or isinstance(piece, EagerPiece)):
            raise InvalidArgumentError(f"{owner}: a piece must be callable or an EagerPiece, got {piece!r}")
    if not pieces or isinstance(pieces[0], EagerPiece):
        first = piece_name(pieces[0]) if pieces else None
        raise InvalidArgumentError(
            f"{owner}: the first piece must be captured (got {first!r}): host inputs are "
            "copied to the device inside the first graph, so an eager piece before it would read stale inputs"
        )
    return pieces


def check_inputs(owner: str, inputs: Sequence[StaticInput], axes: Mapping[str, AxisSize]) -> dict[str, StaticInput]:
    """name -> declaration; names are unique and every symbolic axis is sized by `axes`."""
    specs: dict[str, StaticInput] = {}
    if isinstance(inputs, StaticInput) or not isinstance(inputs, Sequence):
        raise InvalidArgumentError(f"{owner}: inputs must be a list of StaticInput declarations, got {inputs!r}")
    for spec in inputs:
        if not isinstance(spec, StaticInput):
            raise InvalidArgumentError(f"{owner}: inputs must be StaticInput declarations, got {spec!r}")
        if spec.name in specs:
            raise InvalidArgumentError(f"{owner}: static input {spec.name!r} is declared twice")
        specs[spec.name] = spec
    for spec in specs.values():
        for dim in spec.shape:
            if isinstance(dim, str) and dim not in axes:
                raise InvalidArgumentError(
                    f"{owner}: static input {spec.name!r} uses symbolic axis {dim!r}, "
                    f"which axes= does not size (declared: {sorted(axes)})"
                )
    return specs


def check_pool(owner: str, pool: object, ledger: PoolLedger,
               keeper_of: Callable[[PoolHandle], Any]) -> tuple[str, PoolHandle | None]:
    """(mode, handle): ("shared", None), ("own", None) or ("external", the handle handed in).

    A handed-in handle must not be released in `ledger`, nor be the pool of a runner that
    keeps it from others (`keeper_of(pool)`, the manager's runner_keeping_pool).
    """
    if pool in ("shared", "own"):
        return pool, None
    if not isinstance(pool, tuple):
        problem = ValueError if isinstance(pool, str) else TypeError
        raise problem(
            f"{owner}: pool must be 'shared', 'own' or a handle from "
            f"torch.cuda.graph_pool_handle() / CUDAGraph.pool(), got {pool!r}"
        )
    key = pool_key(pool)
    ledger.check_usable(key)
    other = keeper_of(key)
    if other is not None and other.last_outputs == "in_pool":
        raise InvalidArgumentError(
            f"{owner}: graph pool {tuple(key)} belongs to graph runner {other.name!r}, which keeps its "
            "outputs in it (last_outputs='in_pool'); graphs captured into it could overwrite them. "
            "See Note [Outputs kept in the pool]"
        )
    if other is not None:
        raise InvalidArgumentError(
            f"{owner}: graph pool {tuple(key)} is graph runner {other.name!r}'s own (pool='own'): its graphs may "
            "replay beside others', and its close ends the pool. Capture into pool='shared', a pool of this "
            "runner's own, or a handle no runner keeps for itself")
    return "external", pool


def check_last_outputs(owner: str, last_outputs: object, pool_mode: str, pieces: Sequence) -> bool:
    """Whether the last piece's outputs stay in the pool (Note [Outputs kept in the pool])."""
    if last_outputs not in ("copy", "in_pool"):
        raise InvalidArgumentError(f"{owner}: last_outputs must be 'copy' or 'in_pool', got {last_outputs!r}")
    if last_outputs == "copy":
        return False
    if pool_mode != "own":
        given = "a handed-in pool" if pool_mode == "external" else "pool='shared'"
        raise InvalidArgumentError(
            f"{owner}: last_outputs='in_pool' needs pool='own', got {given}: another "
            "runner's replays in a shared pool could overwrite outputs kept there"
        )
    if isinstance(pieces[-1], EagerPiece):
        raise InvalidArgumentError(
            f"{owner}: last_outputs='in_pool' needs a captured last piece, got eager piece "
            f"{pieces[-1].name!r}"
        )
    return True
