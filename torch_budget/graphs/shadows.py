"""The ring of pinned host shadow slots that host-sourced inputs go through, and the
event guarding each slot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Note [Shadow ring]
# A host-sourced input reaches the device through a copy captured in the graph: the copy
# node reads the pinned shadow when it runs on the device, which can be long after replay()
# returned on the host. Writing the next step's data into that shadow before then would
# feed the earlier replay the new data.
#
# So a runner keeps a ring of N shadow slots (shadow_slots=, default 2). Slot s has its own
# pinned shadow per host input and, per bucket, its own exec of the first graph, whose
# captured copy reads slot s; later pieces read only device buffers and are captured once.
# Step k writes slot k % N. Before writing, the host waits on slot s's event, recorded right
# after the replay that last read slot s (N steps ago); the steps in between read other
# slots. Every earlier read of slot s had finished before that replay was staged (the same
# wait, one round earlier), so once the wait returns nothing queued reads slot s. The host
# can therefore stage up to N - 1 steps ahead of the device, and the wait is normally
# already satisfied; N = 1 is a plain fence (step k+1 waits for step k's first graph).
# run_eager() and warm-up read a shadow with eager non-blocking copies and take a slot the
# same way.
#
# The device-side static inputs are shared by all slots: step k's captured copies overwrite
# what step k-1's graphs read, which is safe because replays go to one stream, in order.
# The event is recorded by the host after replay(), on the stream the graph was launched on
# (the current stream of the runner's device). It is not captured into the graph: a host
# wait on a stream record is plainly documented, one on an event-record node less so, and
# the host call comes after replay() has returned.
#
# Cost: N execs of the first graph per bucket (N times its capture time and exec memory;
# they are captured one after another into the same pool and reuse each other's blocks, so
# the pool does not grow, unless outputs are kept in it, see Note [Outputs kept in the
# pool]), N pinned shadows (shadow_nbytes counts them all) and one event per slot. A runner
# without host-sourced inputs has nothing to guard and uses one slot.


class ShadowRing:
    """Which shadow slot the next step writes, and the event guarding each slot.

    See Note [Shadow ring]. `make_fence()` builds an event with record(stream) and
    synchronize() (torch.cuda.Event); None where nothing reads a shadow asynchronously.
    """

    __slots__ = ("size", "fenced", "last", "_next", "_fences", "_armed", "_make_fence")

    def __init__(self, size: int, make_fence: Callable[[], Any] | None):
        self.size = size
        self.fenced = make_fence is not None
        self.last = 0  # the slot the latest step wrote
        self._next = 0
        # Invariant: _armed[s] iff _fences[s] was recorded after the latest read of slot s
        # was queued and no wait on it has returned since.
        self._fences: list = [None] * size
        self._armed = [False] * size
        self._make_fence = make_fence

    def acquire(self) -> int:
        """The slot to write next, once the work that last read it has finished."""
        slot = self._next
        if self._armed[slot]:
            self._fences[slot].synchronize()
            self._armed[slot] = False
        self._next = 0 if slot + 1 == self.size else slot + 1
        self.last = slot
        return slot

    def release(self, slot: int, stream: Any) -> None:
        """Slot `slot` is read by the work queued on `stream` so far."""
        if not self.fenced:
            return
        fence = self._fences[slot]
        if fence is None:
            fence = self._fences[slot] = self._make_fence()
        fence.record(stream)
        self._armed[slot] = True
