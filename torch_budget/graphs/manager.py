"""GraphPoolManager: the runners and graph pools of one device, the capture stream, and
the agreement of ranks on the graph to replay."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._validate import integer, positive_int
from .buckets import BucketRule
from .pieces import EagerPiece
from .pools import PoolHandle, PoolLedger, pool_key
from .runner import GraphRunner
from .static import AxisSize, StaticInput
from ..errors import InvalidArgumentError

__all__ = ["GraphPoolManager"]


# Note [Rank agreement]
# With data-parallel attention each rank sees its own batch and would pick its own bucket
# (and tier, e.g. full graph vs piecewise vs eager). Graphs contain collectives, so ranks
# replaying different graphs deadlock or exchange mismatched sizes. agree() all-gathers the
# key; if all ranks picked the same it is kept, otherwise every rank takes the most
# conservative one: the largest bucket (each rank's rows fit, the extra is padding) and the
# most conservative tier. A rank that must run eagerly (bucket None) makes all run eagerly.
# The largest bucket may be one a rank's runner lacks (capture() goes on past a bucket that
# fails, and release() drops one), and that rank's step would raise while the others replay
# collectives and wait. So with agree(runner=...) each rank first pads its choice to its
# runner's buckets; then, while the ranks disagree, each pads the largest choice up to its own
# next bucket and the ranks take the largest again (all-reduce max), until no rank moved it.
# Every rank sees the same maxima, so every rank runs the same rounds; a rank past its largest
# bucket answers "eager", which ends the rounds with every rank running eagerly.
_EAGER_BUCKET = 1 << 62  # encodes "above every bucket" in the gathered tensor


# Per device index, guarded by _CAPTURE_STREAMS_LOCK: the capture stream, and the lock a
# runner's capture() holds across its warm-ups and captures on it, since work two threads
# queued on the one stream at once would run in each other's warm-up or land in each
# other's graph.
_CAPTURE_STREAMS: dict[int, Any] = {}
_CAPTURE_LOCKS: dict[int, threading.Lock] = {}
_CAPTURE_STREAMS_LOCK = threading.Lock()


def _device_index(device: Any) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _capture_stream(device: Any) -> Any:
    """The one stream every capture on `device` uses, for the whole process.

    torch asks that captures sharing a pool use the same stream, and warm-up runs on it
    so its lazy state exists before capture. It is shared by every manager because torch
    keeps a cuBLAS workspace per stream for good (about 32 MiB on Hopper): a stream per
    manager would grow reserved memory with every manager created. So captures on it take
    turns (_capture_lock).
    """
    index = _device_index(device)
    with _CAPTURE_STREAMS_LOCK:  # managers on two threads get the one stream
        stream = _CAPTURE_STREAMS.get(index)
        if stream is None:
            stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def _capture_lock(device: Any) -> threading.Lock:
    """The lock a capture on `device`'s capture stream holds, one per device for the whole process."""
    index = _device_index(device)
    with _CAPTURE_STREAMS_LOCK:
        return _CAPTURE_LOCKS.setdefault(index, threading.Lock())


def _common_bucket(top: int, runner: GraphRunner | None, group: Any, device: Any) -> int:
    """The smallest bucket >= `top` that every rank's runner has, or _EAGER_BUCKET; every rank of
    `group` calls it with the same `top`. See Note [Rank agreement]."""
    import torch.distributed as dist

    while top != _EAGER_BUCKET:
        mine = top if runner is None else runner.bucket_for(top) or _EAGER_BUCKET
        largest = torch.tensor([mine], dtype=torch.int64, device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        agreed = int(largest.item())
        if agreed == top:  # no rank moved it: every rank has it
            break
        top = agreed
    return top


class GraphPoolManager:
    """Owns the graph pools of one device and the runners captured into them.

    `tiers` orders the graph tiers agree() understands from most optimized to most
    conservative. Use as a context manager, or call close().
    """

    def __init__(self, device: str | torch.device | None = "cuda", *,
                 tiers: Sequence[str] = ("full", "piecewise", "eager")):
        device = torch.device(device if device is not None else "cuda")
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        tiers = tuple(tiers)
        if not tiers or len(set(tiers)) != len(tiers) or not all(isinstance(t, str) for t in tiers):
            raise InvalidArgumentError(f"tiers must be distinct strings, least to most conservative; got {tiers!r}")
        self.tiers = tiers
        self.ledger = PoolLedger()
        self._shared: PoolHandle | None = None
        self._runners: dict[str, GraphRunner] = {}

    def runner(self, name: str, pieces: Sequence[Callable | EagerPiece] | Callable, *,
               buckets: BucketRule | int | Sequence[int], inputs: Sequence[StaticInput] = (),
               axes: Mapping[str, AxisSize] | None = None,
               output_axes: Mapping[str, int | None] | None = None,
               pool: str | PoolHandle = "shared", warmup: int = 2, shadow_slots: int = 2,
               last_outputs: str = "copy") -> GraphRunner:
        """Declare a forward to capture. Static buffers are allocated now; call capture().

        `pieces`: callables `piece(buffers) -> dict | None` (captured) and EagerPiece
        entries, in forward order. `axes` sizes symbolic axes of inputs (int, or a function
        of the bucket). `output_axes` gives each output's batch axis (default 0; None: not
        bucketed). `pool`: "shared" (the manager's pool), "own" (a pool for this runner
        alone) or a handle such as other_graph.pool(). `shadow_slots`: pinned shadow slots,
        how many steps the host may stage ahead of the device plus one (Note [Shadow ring]).
        `last_outputs`: "copy" (static output buffers) or "in_pool" (the last piece's outputs
        stay where its graph writes them, one copy kernel fewer per output; needs
        pool="own", see Note [Outputs kept in the pool]).
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"runner name must be a non-empty str, got {name!r}")
        if name in self._runners:
            raise InvalidArgumentError(f"a runner named {name!r} already exists; close it or pick another name")
        runner = GraphRunner(self, name, pieces, buckets=buckets, inputs=inputs, axes=axes,
                             output_axes=output_axes, pool=pool, warmup=warmup,
                             shadow_slots=shadow_slots, last_outputs=last_outputs)
        self._runners[name] = runner
        return runner

    @property
    def runners(self) -> dict[str, GraphRunner]:
        return dict(self._runners)

    def pools(self) -> dict[tuple[int, int], tuple]:
        """Pools that graphs hold now -> the (runner, bucket, piece) graphs holding them."""
        return self.ledger.pools()

    def release_pool(self, pool: PoolHandle) -> None:
        """Let go of a pool handle; raises PoolInUseError while graphs hold it."""
        self.ledger.release(pool)
        if self._shared is not None and pool_key(pool) == self._shared:
            self._shared = None

    # -- what runners ask of their manager (GraphRunner's RunnerOwner) --------------------

    def capture_pool(self, runner: GraphRunner) -> PoolHandle:
        """The pool `runner` captures into now, registered with the ledger; called by
        runner.capture(), which keeps the handle. See Note [Pool ownership].

        A handed-in handle is used as it is (PoolReleasedError once it was let go); a live
        pool the runner already captured into is kept; otherwise the runner gets the
        manager's shared pool ("shared", a fresh one once the last was released) or a
        fresh pool of its own ("own").
        """
        mode, current = runner.pool_mode, runner.pool
        if mode == "external":
            self.ledger.register(current, "handed in", auto_release=False)
            return current
        if current is not None and not self.ledger.is_released(current):
            return current
        if mode == "shared":
            if self._shared is None or self.ledger.is_released(self._shared):
                self._shared = torch.cuda.graph_pool_handle()
                self.ledger.register(self._shared, "manager (shared)", auto_release=True)
            return self._shared
        handle = torch.cuda.graph_pool_handle()
        self.ledger.register(handle, f"runner {runner.name!r} (own)", auto_release=True)
        return handle

    def capture_stream(self) -> Any:
        """The stream every capture on this manager's device uses (see _capture_stream)."""
        return _capture_stream(self.device)

    def capture_lock(self) -> threading.Lock:
        """Held while a capture uses the capture stream: every manager of the device shares it."""
        return _capture_lock(self.device)

    def runner_keeping_pool(self, pool: PoolHandle) -> GraphRunner | None:
        """The open runner that keeps `pool` from every other runner, if any: one whose pool it
        is alone (pool="own": its graphs may replay beside others', and its close releases the
        pool), or one whose last outputs live in it (last_outputs="in_pool", Note [Outputs kept
        in the pool])."""
        key = pool_key(pool)
        for runner in self._runners.values():
            if (runner.last_outputs == "in_pool" or runner.pool_mode == "own") and runner.pool is not None \
                    and pool_key(runner.pool) == key:
                return runner
        return None

    def runner_keeping_outputs_in(self, pool: PoolHandle) -> GraphRunner | None:
        """Deprecated: runner_keeping_pool, which also names a runner whose own pool it is. The
        open runner whose last outputs live in `pool` (last_outputs="in_pool"), if any."""
        from .._deprecation import warn

        warn("torch_budget.graphs.GraphPoolManager.runner_keeping_outputs_in()",
             "use runner_keeping_pool(pool), which also names a runner whose own pool it is")
        runner = self.runner_keeping_pool(pool)
        return runner if runner is not None and runner.last_outputs == "in_pool" else None

    def runner_closed(self, runner: GraphRunner) -> None:
        """Called by runner.close(): the manager no longer lists it (its name is free again)."""
        if self._runners.get(runner.name) is runner:
            del self._runners[runner.name]

    def _encode_tier(self, tier: int | str) -> int:
        if isinstance(tier, str):
            if tier not in self.tiers:
                raise InvalidArgumentError(f"unknown graph tier {tier!r}; known tiers: {self.tiers}")
            return self.tiers.index(tier)
        code = integer(tier, f"a graph tier (one of {self.tiers}, or its position)", minimum=0)
        if code >= len(self.tiers):
            raise InvalidArgumentError(f"graph tier code {code} is past the known tiers {self.tiers}")
        return code

    def agree(self, bucket: int | None, tier: int | str, group: Any = None, *,
              runner: GraphRunner | None = None) -> tuple[int | None, int | str]:
        """The (bucket, tier) every rank of `group` uses. See Note [Rank agreement].

        `bucket` None means this rank runs eagerly. Returns the local choice when all ranks
        agree, with world size 1, or when torch.distributed is not initialized. A bucket or
        tier refused on any rank, or managers whose tiers differ between ranks, raise on every
        rank, after the ranks have exchanged their choices: none is left waiting or replays alone.

        `runner`: the runner (of this manager) the step goes to. The bucket agreed is then one
        that every rank's runner has (runner.buckets), `bucket` (a row count or a bucket) padded
        up to it; None, all ranks running eagerly, when no bucket at or above every choice is on
        every rank's runner. A rank that passes no runner takes any bucket.
        """
        refused: Exception | None = None
        try:
            if bucket is not None:
                bucket = positive_int(bucket, "bucket")
                if bucket >= _EAGER_BUCKET:  # the code that says "eager" in the exchange
                    raise InvalidArgumentError(f"agree(): bucket {bucket} must be below 2**62")
            tier_code = self._encode_tier(tier)
            if runner is not None:
                if not isinstance(runner, GraphRunner) or self._runners.get(runner.name) is not runner:
                    raise InvalidArgumentError(f"agree(): runner must be an open runner of this manager, got {runner!r}")
                if bucket is not None:
                    bucket = runner.bucket_for(bucket)
        except (TypeError, ValueError) as e:
            refused, tier_code = e, -1
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
            if refused is not None:
                raise refused
            return bucket, tier
        world = dist.get_world_size(group)
        device = "cpu"
        if str(dist.get_backend(group)) == "nccl":
            # NCCL takes a tensor of the rank's own device: the one its graphs live on, whatever
            # device is current (a rank that never called set_device would send from cuda:0).
            device = self.device if self.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        bucket_code = -1 if refused is not None else _EAGER_BUCKET if bucket is None else bucket
        mine = torch.tensor([bucket_code, tier_code, zlib.crc32("\0".join(self.tiers).encode()), runner is not None],
                            dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        rows = torch.stack(gathered).cpu().tolist()
        if refused is not None:
            raise refused
        others = [rank for rank, row in enumerate(rows) if row[0] < 0 or row[1] < 0]
        if others:
            raise InvalidArgumentError(f"agree(): rank(s) {others} of the group passed a bucket or tier they refused; "
                                       "every rank raises, so that none replays a graph the others do not")
        if any(row[2] != rows[0][2] for row in rows):
            raise InvalidArgumentError(f"agree(): the ranks' GraphPoolManagers list different tiers (this rank: "
                                       f"{self.tiers}); tiers are exchanged by position, so every rank must list "
                                       "the same ones in the same order")
        if all(row == rows[0] for row in rows):
            return bucket, tier
        top_bucket = max(row[0] for row in rows)
        if any(row[3] for row in rows) and any(row[0] != top_bucket for row in rows):
            top_bucket = _common_bucket(top_bucket, runner, group, device)
        top_tier = max(row[1] for row in rows)
        agreed_bucket = None if top_bucket == _EAGER_BUCKET else top_bucket
        if isinstance(tier, str):
            return agreed_bucket, self.tiers[top_tier]
        return agreed_bucket, top_tier

    def close(self) -> None:
        """Close every runner and let go of the shared pool; idempotent."""
        for runner in list(self._runners.values()):
            runner.close()
        if self._shared is not None and not self.ledger.is_released(self._shared):
            self.ledger.release(self._shared)
        self._shared = None

    def __enter__(self) -> GraphPoolManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GraphPoolManager({self.device}, runners={sorted(self._runners)}, pools={len(self.pools())})"
