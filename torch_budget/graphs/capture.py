"""Capturing one bucket of a runner into CUDA graphs, and destroying those graphs again.

The first piece is captured once per shadow slot (its graph holds the shadow -> device
copies, see Note [Shadow ring]); later pieces once, eager pieces between them become
plain calls. Each captured (runner, bucket, piece) is recorded in the pool ledger (see
Note [Pool ownership]).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .outputs import StaticOutputs
from .pieces import EagerPiece, call_eager
from .pools import PoolHandle, PoolLedger
from .staging import StaticInputs
from .static import StaticBuffers

__all__ = ["CapturedBucket", "Plan", "capture_bucket"]


class Plan:
    """What a step of one (bucket, slot) replays: the slot's first graph (it holds the
    shadow -> device copies), then the shared later pieces; `kept` are the outputs kept in
    the pool (Note [Outputs kept in the pool])."""

    __slots__ = ("first", "rest", "kept")

    def __init__(self, first: Any, rest: tuple, kept: dict[str, torch.Tensor]):
        self.first = first
        self.rest = rest
        self.kept = kept


class CapturedBucket:
    """One bucket's graphs: a plan per slot, every graph (for reset) and the ledger holders."""

    __slots__ = ("plans", "graphs", "holders")

    def __init__(self, plans: tuple, graphs: list, holders: list):
        self.plans = plans
        self.graphs = graphs
        self.holders = holders

    def destroy(self, ledger: PoolLedger, pool: PoolHandle) -> None:
        """Reset every graph, then drop its holders from the ledger (queued work must be done)."""
        for graph in self.graphs:
            graph.reset()
        for holder in self.holders:
            ledger.drop(pool, holder)


def _capture_graph(graphs: list, pool: PoolHandle, stream: Any, outputs: StaticOutputs, index: int,
                   piece: Any, bucket: int, buffers: StaticBuffers,
                   copy_in: Any = None) -> tuple[dict, dict]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        if copy_in is not None:
            copy_in()
        stored = outputs.store(index, bucket, piece(buffers), capturing=True)
    # The piece's own result tensors are gone now (unless kept); their pool blocks are
    # free for the next capture.
    graphs.append(graph)
    return stored


def capture_bucket(bucket: int, pieces: Sequence, inputs: StaticInputs, outputs: StaticOutputs, *,
                   owner: str, runner: str, ledger: PoolLedger, pool: PoolHandle,
                   stream: Any) -> CapturedBucket:
    """Capture the pieces of runner `runner` (`owner` names it in messages) at `bucket` into
    `pool` on `stream`, after warm-up. On any error the bucket's partial capture is undone."""
    graphs: list = []
    holders: list = []
    try:
        visible = inputs.bucket_views(bucket)
        buffers = StaticBuffers(owner, dict(visible), bucket)
        firsts = []
        for slot in range(inputs.slots):
            copy_in = functools.partial(inputs.copy_to_device, bucket, slot)
            views, kept = _capture_graph(graphs, pool, stream, outputs, 0, pieces[0], bucket, buffers, copy_in)
            firsts.append((graphs[-1], kept))
        # One holder stands for the graphs of (runner, bucket, piece), all slots.
        ledger.acquire(pool, (runner, bucket, 0))
        holders.append((runner, bucket, 0))
        visible.update(views)
        rest: list = []
        kept_rest: dict[str, torch.Tensor] = {}
        for index in range(1, len(pieces)):
            piece = pieces[index]
            buffers = StaticBuffers(owner, dict(visible), bucket)
            if isinstance(piece, EagerPiece):
                rest.append(functools.partial(call_eager, owner, piece, buffers))
                continue
            views, kept = _capture_graph(graphs, pool, stream, outputs, index, piece, bucket, buffers)
            ledger.acquire(pool, (runner, bucket, index))
            holders.append((runner, bucket, index))
            rest.append(graphs[-1].replay)
            visible.update(views)
            kept_rest.update(kept)
    except BaseException:
        # Undo this bucket's partial capture, then let the error through.
        CapturedBucket((), graphs, holders).destroy(ledger, pool)
        raise
    plans = tuple(Plan(first, tuple(rest), {**kept, **kept_rest}) for first, kept in firsts)
    return CapturedBucket(plans, graphs, holders)
