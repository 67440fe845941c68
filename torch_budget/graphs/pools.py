"""Which graphs hold which private graph pool, so that a handle is never used after it was let go."""

from __future__ import annotations

from .._validate import pool_handle as pool_key  # the key of a pool: its checked handle
from ..errors import InvalidArgumentError, PoolInUseError, PoolReleasedError

__all__ = ["PoolHandle", "PoolInUseError", "PoolLedger", "PoolReleasedError", "capture_guard", "pool_key"]

PoolHandle = tuple  # what torch.cuda.graph_pool_handle() and CUDAGraph.pool() return


# Note [Pool ownership]
# torch frees a private graph pool once every graph captured into it has been destroyed
# (and empty_cache runs). Capturing into a pool id after that point is the crash other
# engines hit when one component releases a pool another still hands out. So the ledger
# records, per pool handle, which graphs hold it (holder = (runner, bucket, piece)):
# - a graph is added after its capture succeeded and removed after g.reset();
# - release(pool) with holders left raises PoolInUseError naming them;
# - a pool the manager created ("shared" or a runner's "own") is released automatically
#   when its last holder goes: nobody else can hold it, so it is dead, and the manager
#   hands out a fresh handle for the next capture;
# - a pool handed in from outside (pool=other.pool()) may still be held by graphs the
#   ledger does not know, so only an explicit release() ends it;
# - capturing into a released handle raises PoolReleasedError;
# - a runner's capture() holds the pool while it runs (capture_guard: piece -1, no graph), so
#   that a bucket whose capture failed and was undone cannot release the pool under the
#   buckets still to capture; dropped at the end, it releases the pool only when no bucket
#   was captured.

def capture_guard(runner: str) -> tuple:
    """The holder that stands for `runner`'s capture in progress (see Note [Pool ownership])."""
    return (runner, 0, -1)


def _holder_text(holder: tuple) -> str:
    runner, bucket, piece = holder
    if piece < 0:
        return f"runner {runner!r} (capturing now)"
    return f"runner {runner!r} bucket {bucket} piece {piece}"


class PoolLedger:
    """Which graphs hold which private pool. See Note [Pool ownership]."""

    def __init__(self) -> None:
        # Invariant: a key of _holders is registered and not released; _released never
        # has an entry with holders.
        self._holders: dict[tuple[int, int], set[tuple]] = {}
        self._owner: dict[tuple[int, int], str] = {}
        self._auto: dict[tuple[int, int], bool] = {}
        self._released: set[tuple[int, int]] = set()

    def register(self, pool: PoolHandle, owner: str, auto_release: bool) -> None:
        """Start tracking `pool`; `auto_release` when nothing outside the ledger can hold it."""
        key = pool_key(pool)
        self.check_usable(key)
        if key not in self._holders:
            self._holders[key] = set()
            self._owner[key] = owner
            self._auto[key] = auto_release

    def check_usable(self, pool: PoolHandle) -> None:
        key = pool_key(pool)
        if key in self._released:
            raise PoolReleasedError(
                f"graph pool {key} was released (owner: {self._owner.get(key, 'unknown')}); "
                "capturing into it again could reuse memory torch already freed. Use a new "
                "handle (torch.cuda.graph_pool_handle()) or the manager's shared pool"
            )

    def acquire(self, pool: PoolHandle, holder: tuple) -> None:
        key = pool_key(pool)
        self.check_usable(key)
        if key not in self._holders:
            raise InvalidArgumentError(f"graph pool {key} is not registered with this ledger")
        self._holders[key].add(holder)

    def drop(self, pool: PoolHandle, holder: tuple) -> None:
        key = pool_key(pool)
        holders = self._holders.get(key)
        if holders is None or holder not in holders:
            raise InvalidArgumentError(f"graph {holder} does not hold graph pool {key}")
        holders.discard(holder)
        if not holders and self._auto[key]:
            self._retire(key)

    def release(self, pool: PoolHandle) -> None:
        """End `pool`; raises PoolInUseError while any graph holds it."""
        key = pool_key(pool)
        if key in self._released:
            return
        holders = self._holders.get(key, set())
        if holders:
            listed = ", ".join(_holder_text(h) for h in sorted(holders))
            raise PoolInUseError(
                f"graph pool {key} (owner: {self._owner.get(key, 'unknown')}) is still held by "
                f"{len(holders)} graph(s): {listed}; close or release those runners first"
            )
        self._retire(key)

    def _retire(self, key: tuple[int, int]) -> None:
        self._holders.pop(key, None)
        self._auto.pop(key, None)
        self._released.add(key)

    def holders(self, pool: PoolHandle) -> tuple:
        return tuple(sorted(self._holders.get(pool_key(pool), ())))

    def is_released(self, pool: PoolHandle) -> bool:
        return pool_key(pool) in self._released

    def pools(self) -> dict[tuple[int, int], tuple]:
        """Pools that graphs hold now -> those graphs."""
        return {key: tuple(sorted(h)) for key, h in self._holders.items() if h}
