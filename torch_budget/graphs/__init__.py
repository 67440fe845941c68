"""CUDA graphs as a second budget: buckets, static buffers, pinned shadows, shared pools.

A captured graph replays fixed addresses and allocates nothing, so everything it touches
is resident from capture until the graph is destroyed. This package makes that memory
explicit and bounded (module in brackets):

- a bucket rule turns the user's max batch / max tokens into the discrete set of sizes
  that are captured (`BucketRule`); a step is padded up to the nearest one [buckets];
- graph-visible inputs and outputs are static buffers sized once by the largest captured
  bucket and written in place (`StaticInput`, `StaticBuffers`) [static; staging for the
  inputs, outputs for the outputs];
- host-sourced inputs go through pinned host shadows whose host-to-device copy is itself
  captured, so a step is one CPU memcpy plus one replay; a ring of shadow slots lets the
  host stage the next steps while earlier replays still read theirs [shadows, staging];
- graphs of one forward (pieces, buckets, runners) share a private pool whose ownership
  is recorded (`PoolLedger`), so a pool handle is never reused after it was let go [pools];
- ranks agree on the graph key before replaying (`GraphPoolManager.agree`) [manager].

The rest: `GraphPoolManager` owns the runners and pools of one device and the capture
stream [manager]; `GraphRunner` captures one forward per bucket and replays it [runner],
checking its arguments [arguments], capturing a bucket [capture], with `EagerPiece` for
the parts that run between graphs [pieces]; `GraphResource` is a runner's rows as a resource
manager for a scheduler (torch_budget.resources) [resource]. A module imports only from lower
ones: buckets, static, pools, shadows < pieces < arguments, staging, outputs < capture < runner
< manager, resource. Runner and manager reach each other only through public methods
(runner.RunnerOwner).

Only public torch APIs are used, so the same code runs on torch's native allocator and
behind `torch_budget.install()`. The package imports on a CPU-only torch build; capture
and replay need a CUDA device, the rest (buckets, buffers, eager runs) also works on CPU.

A manager and its runners are driven from one thread, and replays go to one stream at a
time (see Note [Static outputs make pool sharing safe]).
"""

from .buckets import BucketRule, pad_to_bucket, resolve_buckets
from .manager import GraphPoolManager
from .pieces import EagerPiece
from ..errors import PoolInUseError, PoolReleasedError, StaticBufferRebindError
from .pools import PoolLedger
from .resource import GraphResource
from .runner import GraphRunner
from .shadows import ShadowRing
from .static import StaticBuffers, StaticInput

__all__ = [
    "BucketRule",
    "EagerPiece",
    "GraphPoolManager",
    "GraphResource",
    "GraphRunner",
    "PoolInUseError",
    "PoolLedger",
    "PoolReleasedError",
    "ShadowRing",
    "StaticBufferRebindError",
    "StaticBuffers",
    "StaticInput",
    "pad_to_bucket",
    "resolve_buckets",
]
