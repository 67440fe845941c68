"""The eager workspace's shrink rule (SPEC 5): after three underfilled forwards with no growth
between them, down to the largest of their needs and never below the floor. Pure bookkeeping;
eager_workspace.py applies it around each forward."""

from torch_budget._validate import non_negative_int
from torch_budget.errors import InvalidArgumentError

__all__ = ["WorkspaceShrinkPolicy"]


def as_bytes(name, value):
    """Return `value` as a non-negative int byte count, or raise naming `name`."""
    return non_negative_int(value, f"{name} (bytes)")


class WorkspaceShrinkPolicy:
    """Decides when a grow-only workspace should shrink, and to what size.

    A workspace shrinks only after `WINDOW` consecutive forwards that needed less than its
    capacity, without growth in between, so a single short forward between long ones never
    costs a reallocation. The target is the largest demand of that window (never below the
    floor), so none of the forwards that motivated the shrink would have had to grow again.
    Forwards that needed nothing (required == 0) neither count nor break the window.
    """

    WINDOW = 3

    __slots__ = ("_floor", "_remaining", "_window_max")

    def __init__(self, floor_bytes):
        # _floor: the capacity never shrinks below this; fixed for the policy's life.
        # _remaining: underfilled forwards still needed before a shrink; 1 <= _remaining <= WINDOW.
        # _window_max: largest demand of the current window; 0 exactly when _remaining == WINDOW.
        self._floor = as_bytes("floor_bytes", floor_bytes)
        self._remaining = self.WINDOW
        self._window_max = 0

    @property
    def floor(self):
        return self._floor

    @property
    def remaining(self):
        """Underfilled forwards still needed before the next shrink."""
        return self._remaining

    @property
    def window_max(self):
        """Largest demand seen in the current window (0 when the window is empty)."""
        return self._window_max

    def reset(self):
        """Start a fresh window."""
        self._remaining = self.WINDOW
        self._window_max = 0

    def finish_forward(self, required, capacity, grew):
        """Record one forward and return the size to shrink to, or None to keep the workspace.

        required: bytes the forward needed (its largest single request).
        capacity: bytes the workspace holds at the end of the forward.
        grew: whether the workspace grew during the forward.
        """
        if type(required) is not int:
            required = as_bytes("required", required)
        if type(capacity) is not int:
            capacity = as_bytes("capacity", capacity)
        floor = self._floor
        if required < 0:
            as_bytes("required", required)  # raises, with the package's message
        if capacity < required or capacity < floor:
            raise InvalidArgumentError(
                f"capacity {capacity} is below max(required={required}, floor={floor}) bytes: "
                "a workspace holds at least what its forward used and at least its floor"
            )
        if required == 0:
            return None
        if grew or capacity == floor or required == capacity:
            self._remaining = self.WINDOW
            self._window_max = 0
            return None
        if required > self._window_max:
            self._window_max = required
        self._remaining -= 1
        if self._remaining:
            return None
        target = self._window_max if self._window_max > floor else floor
        self._remaining = self.WINDOW
        self._window_max = 0
        return target

    def __repr__(self):
        return (
            f"WorkspaceShrinkPolicy(floor_bytes={self._floor}, remaining={self._remaining}, "
            f"window_max={self._window_max})"
        )
