"""Eager workspace manager: one grow-only scratch buffer per forward, shrunk lazily.

Attention-style kernels share one scratch buffer per forward and each layer grows it to its
own need, so its size is the largest layer's need, not the sum. Grow-only keeps it large
after one long request; `WorkspaceShrinkPolicy` (workspace_policy.py) decides when to give
the excess back (after three underfilled forwards with no growth between them, down to the
largest of their needs and never below the floor) and `workspace(metadata)` applies it
around each forward.

Metadata protocol
-----------------
Any object can serve as workspace metadata if it has these attributes (`WorkspaceMetadata`
is a ready implementation for code without its own metadata class):

- ``workspace``: the eager workspace, a 1-D contiguous ``torch.uint8`` tensor on the device,
  or None before warm-up. Grow it only through `get` or, for a backend with its own sizing,
  `reserve` (in place, where it would call ``workspace.resize_(n)``); never rebind it to
  another tensor. A backend's own ``resize_`` of this tensor is still measured, but its
  allocation is charged to whatever tag is current rather than "workspace" (so it escapes
  the workspace's budget and the shrink's empty_cache), and it skips `get`'s checks.
- ``is_graph_metadata`` (bool): metadata used by CUDA graphs; `workspace` does nothing for it.
- ``workspace_state``: where `warm_up` stores the manager's per-workspace state (a
  `WorkspaceState`); None or absent before warm-up. The object must allow setting it and
  must support weak references (any ordinary class does).

Optional attributes, read when present:

- ``reclaimable`` (bool, read every forward, default False): the workspace is pure scratch
  and may be released and reallocated. Off unless the backend declares it: a backend that
  keeps staged state in its workspace would lose that state.
- ``multi_stream`` (bool, read every forward): the workspace is used from several streams;
  reclamation is disabled at the next forward, with one warning.
- ``stream_fn`` (callable, read at warm-up): returns a comparable identity of the stream the
  caller runs on. Needed only for devices whose streams torch_budget cannot see; on CUDA the
  current raw stream is used.
- ``graph_workspace``: a separate workspace whose addresses are baked into captured graphs.
  The manager never writes it; `warm_up` refuses one that shares the eager one's storage.
- ``return_to_device`` (bool, read at each shrink, default True): under `torch_budget.install()`
  a shrink hands the freed memory back to the device at once (the workspace tag's own pool is
  trimmed after the stream it was used on finished), so other processes and `mem_get_info`
  see it. False keeps it cached in the allocator for the next growth, as does a trim the core
  refuses (a CUDA graph capture open on the device), with a warning.

One metadata object stands for one workspace: its state (floor, policy, stream, the
in-forward flag) lives in it, so keep it for the workspace's life rather than rebuilding it
per step. One storage backs one metadata's workspace: `warm_up` refuses a tensor whose
storage another live metadata manages (as its workspace or its graph workspace), and a
graph workspace that shares the eager workspace's storage (workspace_registry.py).

Note [Eager workspace reclamation]
----------------------------------
Grow-only sizing makes the tensor's logical size the largest request seen since it was last
set to 0. So at the start of a forward, when the capacity exceeds the floor, the manager sets
the logical size to 0 while keeping the storage (`Tensor.resize_(0)`); each layer's grow-only
request then reuses the storage, and at the end of the forward the logical size is that
forward's true demand and the storage size is the capacity. At the floor nothing can be
reclaimed, so the resize is skipped (it is the only per-forward torch call).

To shrink, the old tensor is dropped before the smaller one is allocated: releasing first
means the new allocation can reuse the released memory instead of raising the peak, and
shrinking in place (`resize_` to fewer bytes) would keep the whole storage and return nothing.
Memory is handed back to the allocator on the stream the workspace was used on, which is
only safe while that is the one stream using it; so the first forward on another stream (or
a metadata that declares `multi_stream`) disables reclamation for good. Growth cannot be
disabled, and it frees the old storage too: when the metadata declares `multi_stream`, or
the stream growing it is not the warm-up stream, growth first waits for the whole device
(`_synchronize`), since another stream may still read the old storage and the allocator
would hand it out at once.

Graph metadata is left alone, and the graph workspace is a separate tensor that eager
forwards never touch. For an eager workspace used under capture see Note [Eager workspace
under graph capture].

Note [Eager workspace under graph capture]
------------------------------------------
A capture that uses the eager workspace bakes its address into the graph, and every replay
writes there; an eager forward must never move that address (SPEC 5). So the first forward
entered under capture, or `get` or `reserve` under capture, pins the workspace for good: it keeps its
storage, never shrinks (one warning says so), and growth, inside the capture or after it,
raises a StateError naming the capture (inside, it would also take its storage from the
graph's private pool). Growing into a new tensor while the graph keeps the old one would
hold both for the graph's life and hand a stateful backend two copies of its state. Captured
forwards belong on graph metadata with its own graph workspace; a new metadata, warmed up
to the size needed, serves the eager forwards.
"""

import functools
import logging
import threading
import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from torch_budget import _runtime, allocator
from torch_budget._validate import boolean
from torch_budget.errors import InvalidArgumentError, NotWarmedUpError, StateError
from torch_budget.workspace_policy import WorkspaceShrinkPolicy, as_bytes
from torch_budget.workspace_registry import claim

if TYPE_CHECKING:
    import torch

__all__ = [
    "WORKSPACE_TAG",
    "WorkspaceMetadata",
    "WorkspaceShrinkPolicy",
    "WorkspaceState",
    "get",
    "reserve",
    "warm_up",
    "workspace",
]

# The allocator ledger charges workspace allocations to this tag when the shim is installed.
WORKSPACE_TAG = "workspace"

_log = logging.getLogger(__name__)
_NO_SCOPE = nullcontext()


def _allocation_scope():
    """The scope to allocate workspace memory in: a region charging tag "workspace" when
    torch_budget is installed, else a no-op (installed() loads nothing before install())."""
    return allocator.region(WORKSPACE_TAG) if _runtime.installed() else _NO_SCOPE


def _return_to_device(device):
    """Hands the workspace tag's freed memory back to the driver (installed allocator only)."""
    if device.type == "cuda" and _runtime.installed():
        allocator.empty_cache(device, tags=WORKSPACE_TAG)


def _synchronize(device):
    """Waits for every stream of `device` (CUDA; torch_budget sees no other device's streams)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


class _Growths:
    """Growths of one workspace between forwards under way, which a forward entered meanwhile waits
    for: `count` changes with `cond` held, together with taking or releasing the forward lock."""

    __slots__ = ("cond", "count")

    def __init__(self):
        self.cond = threading.Condition()
        self.count = 0

    def wait_for(self, lock) -> bool:
        """Takes `lock` once the growths under way are done; False when it is held by no growth
        (a forward)."""
        with self.cond:
            while not lock.acquire(False):
                if self.count == 0:
                    return False
                self.cond.wait()
            return True


def _describe(meta):
    return f"{type(meta).__name__} at {id(meta):#x}"


def _missing_warm_up(meta):
    return NotWarmedUpError(
        f"{_describe(meta)} has no eager workspace: warm-up must create it before forwards "
        "use it (call warm_up(meta, nbytes) or meta.warm_up(nbytes)); its capacity becomes the floor"
    )


def _replaced(meta):
    return StateError(
        f"the workspace tensor of {_describe(meta)} was replaced outside the manager: grow it "
        "with get() or reserve(), or use a new metadata object for a new workspace"
    )


class WorkspaceState:
    """Per-workspace state of the manager, and the context manager `workspace()` returns.

    Created by `warm_up` and stored in ``meta.workspace_state``; read it through its properties
    (`get` and `reserve` grow the workspace through `grow`). One object
    is reused for every forward of its workspace, so entering a forward allocates nothing.

    Lock rule: `_lock` is held from `__enter__` to `__exit__` of a forward and is the
    in-forward flag (`_owner` names its thread), and by `grow` between forwards (`_growths`,
    which a forward entered meanwhile waits for instead of refusing as an overlap); it is taken
    without blocking, so an overlapping forward (nested, or from another thread) or a growth
    from another thread fails at once instead of sharing the buffer. Every field below except
    the configuration ones is written only by the thread holding `_lock`.
    """

    __slots__ = (
        "_meta", "_lock", "_policy", "_floor", "_device", "_stream_fn", "_stream", "_capturing",
        "_tensor", "_capacity", "_entry_capacity", "_measuring", "_disabled", "_active", "_owner", "_growths", "_pinned",
        "__weakref__",
    )

    def __init__(self, meta, tensor, stream_fn, capturing):
        capacity = tensor.untyped_storage().nbytes()
        self._meta = weakref.ref(meta)  # weak: the metadata owns the state, not the reverse
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread whose forward holds _lock
        # Growths between forwards under way (marked before they take _lock, cleared after they
        # release it), which a forward entered meanwhile waits for; `_growths.count` under its condition.
        self._growths = _Growths()
        self._policy = WorkspaceShrinkPolicy(capacity)
        self._floor = capacity  # fixed at warm-up; the capacity is never reclaimed below it
        self._device = tensor.device
        self._stream_fn = stream_fn  # None: the device has no streams to tell apart
        self._stream = stream_fn() if stream_fn is not None else None  # stream it was used on
        self._capturing = capturing  # None: the device cannot capture graphs
        self._tensor = tensor  # always `meta.workspace`, except while a shrink swaps them
        self._capacity = capacity  # storage bytes of _tensor; >= _floor except after a failed shrink
        self._entry_capacity = capacity  # _capacity when the current forward began
        self._measuring = False  # this forward's demand feeds the policy
        self._disabled = False  # reclamation disabled for good (stream change or multi-stream)
        self._pinned = False  # a capture used it: never moves again; any get() may set it (Note [... capture])
        self._active = None  # the metadata, held strongly only during a forward

    @property
    def metadata(self):
        """The metadata this state belongs to (None once it is gone)."""
        return self._meta()

    @property
    def floor(self):
        return self._floor

    @property
    def capacity(self):
        """Bytes the eager workspace holds now."""
        return self._capacity

    @property
    def policy(self):
        return self._policy

    @property
    def reclaim_disabled(self):
        return self._disabled

    @property
    def in_forward(self):
        return self._lock.locked()

    def __enter__(self):
        acquired = self._lock.acquire(False)
        if not acquired and self._owner != threading.get_ident():  # never wait for this thread's own growth
            acquired = self._growths.wait_for(self._lock)  # a growth between forwards prepares this forward
        if not acquired:
            meta = self._meta()
            raise StateError(
                f"overlapping forwards share the workspace of {_describe(meta)}: a forward is already "
                "running on it (nested, or in another thread); give each concurrent forward its own metadata"
            )
        self._owner = threading.get_ident()
        try:
            meta = self._meta()
            self._active = meta
            if meta.workspace is not self._tensor:
                raise _replaced(meta)
            capturing = self._capturing
            if capturing is not None and capturing():
                self._pin(meta)
                return None
            if self._pinned or self._disabled or not getattr(meta, "reclaimable", False):
                return None
            stream_fn = self._stream_fn
            if stream_fn is not None:
                stream = stream_fn()
                if stream != self._stream:
                    self._disable(meta, f"it is used on stream {stream!r} but was used on stream {self._stream!r}")
                    return None
            if getattr(meta, "multi_stream", False):
                self._disable(meta, "its metadata declares multi_stream")
                return None
            capacity = self._capacity
            if capacity >= self._floor:  # below the floor only after a failed shrink; see _shrink
                if capacity > self._floor:
                    self._tensor.resize_(0)  # keeps the storage; see Note [Eager workspace reclamation]
                self._entry_capacity = capacity
                self._measuring = True
            return None
        except BaseException:
            self._active = None
            self._owner = None
            self._lock.release()
            raise

    def __exit__(self, exc_type, exc, tb):
        if not self._lock.locked():
            raise StateError("the workspace is exited with no forward running in it: enter it first "
                             "(with torch_budget.workspace(metadata): ...)")
        if self._owner != threading.get_ident():
            # The lock says a forward runs, not whose: another thread's exit would end it mid-way.
            raise StateError("the workspace is exited on a thread other than the one whose forward is running "
                             "in it: each thread enters and exits its own forward")
        try:
            # A forward that raised did not finish its demand; it must not count. Growth in it
            # still restarts the window (three underfilled forwards with no growth between them).
            # A pinned one began a capture inside; see Note [Eager workspace under graph capture].
            if self._measuring and exc_type is None and not self._pinned:
                target = self._measure()
                if target is not None:
                    self._shrink(self._active, target)
            else:
                tensor = self._tensor
                if tensor.numel() > self._capacity:  # unmeasured growth by a backend's own resize_
                    self._capacity = tensor.untyped_storage().nbytes()
                if self._measuring and not self._pinned and self._capacity > self._entry_capacity:
                    self._policy.reset()
        finally:
            self._measuring = False
            self._active = None
            self._owner = None  # before the lock goes: a stray exit of this thread then finds no forward of its own
            self._lock.release()
        return False

    def _measure(self):
        """Feed this forward's demand to the policy; return its shrink target or None."""
        tensor = self._tensor
        if self._active.workspace is not tensor:
            return None  # replaced mid-forward; the next forward reports it
        required = tensor.numel()
        capacity = self._capacity
        if required > capacity:
            # Grown by the backend's own resize_ rather than get(): read the storage.
            capacity = self._capacity = tensor.untyped_storage().nbytes()
        elif capacity == self._floor:
            # At the floor without growth the policy would only reset a window that is
            # already empty (every capacity change resets it), so skip the call.
            return None
        if capacity < self._floor:
            # Below the floor only after a refused growth gave the storage up (grow()): nothing to
            # shrink, and the policy takes no capacity under its floor; the window starts again.
            self._policy.reset()
            return None
        return self._policy.finish_forward(required, capacity, capacity > self._entry_capacity)

    def _shrink(self, meta, target):
        """Replace the workspace by one of `target` bytes, releasing the old one first.

        See Note [Eager workspace reclamation]. Views a caller kept from an earlier forward
        keep the old storage alive; layers must not hold workspace views across forwards.
        """
        import torch

        device = self._device
        # Drop every reference the manager holds before allocating, so the old storage is
        # back in the allocator when the new tensor is carved.
        meta.workspace = None
        self._tensor = None
        try:
            with _allocation_scope():
                fresh = torch.empty(target, dtype=torch.uint8, device=device)
        except BaseException:
            # Leave a valid, empty workspace: the next forward's requests regrow it, and it is
            # measured again once it is back at its floor.
            empty = torch.empty(0, dtype=torch.uint8, device=device)
            meta.workspace = self._tensor = empty
            self._capacity = 0
            self._policy.reset()
            raise
        meta.workspace = self._tensor = fresh
        self._capacity = target
        if getattr(meta, "return_to_device", True):
            try:
                _return_to_device(device)
            except StateError as e:  # the core trims no tag while a capture is open on the device
                _log.warning("torch_budget: the eager workspace of %s shrank to %d bytes, but its freed memory "
                             "stays cached for the next growth: %s", _describe(meta), target, e)

    def grow(self, tensor, nbytes):
        """Raise the logical size of the workspace `tensor` to `nbytes`, growing its storage
        when it is short (what `get` does past the current size).

        During a forward only its own thread may grow it (StateError otherwise). Between
        forwards any thread may, holding `_lock` meanwhile, and that growth starts the shrink
        window again: the forwards before it did not need it, the one it prepares for will.
        """
        me = threading.get_ident()
        if self._owner == me:  # in this thread's forward
            self._grow(tensor, nbytes)
            return
        with self._growths.cond:  # taken with the mark, atomically for a forward that would wait for it
            if not self._lock.acquire(False):
                raise StateError(
                    f"the eager workspace of {_describe(self._meta())} was asked for {nbytes} bytes while a forward "
                    "runs on it in another thread: growing it would resize or move the storage under that forward; "
                    "only the forward's own thread may grow it (grow it for the next step before the forward starts)"
                )
            self._growths.count += 1
        self._owner = me
        try:
            if self._grow(tensor, nbytes):
                self._policy.reset()
        finally:
            self._owner = None
            with self._growths.cond:  # released with the mark, so a waiting forward finds the lock free
                self._lock.release()
                self._growths.count -= 1
                self._growths.cond.notify_all()

    def _grow(self, tensor, nbytes):
        """grow() with `_lock` held by this thread; returns whether the storage grew."""
        meta = self._meta()
        if tensor is not self._tensor:
            raise _replaced(meta)
        if nbytes > self._capacity:  # read the storage: a backend's own resize_ may have grown it
            self._capacity = tensor.untyped_storage().nbytes()
        capturing = self._capturing
        if capturing is not None and capturing():
            self._pin(meta)
            if nbytes > self._capacity:
                raise StateError(
                    f"the eager workspace of {_describe(meta)} holds {self._capacity} bytes and a CUDA graph capture "
                    f"asked it for {nbytes}: growing it there would take its new storage from the graph's private "
                    "pool; give captured forwards a graph workspace, or warm up a new metadata object with at least "
                    f"{nbytes} bytes (its floor, which it never shrinks below)"
                )
        elif nbytes > self._capacity and self._pinned:
            raise StateError(
                f"the eager workspace of {_describe(meta)} holds {self._capacity} bytes and cannot grow to {nbytes}: "
                "a CUDA graph capture used it and baked its address in, which growth would free under the graph's "
                "replays; give captured forwards a graph workspace, or warm up a new metadata object with at least "
                f"{nbytes} bytes for the eager forwards"
            )
        if nbytes > self._capacity:
            before = tensor.numel()
            if self._other_streams(meta):
                _synchronize(self._device)  # see Note [Eager workspace reclamation]
            try:
                with _allocation_scope():
                    if getattr(meta, "reclaimable", False):
                        # Pure scratch: release the old storage before allocating the new one, so growth
                        # never holds both (and copies nothing); every view shares this storage object.
                        storage = tensor.untyped_storage()
                        storage.resize_(0)
                        storage.resize_(nbytes)
                    else:
                        tensor.resize_(nbytes)  # a stateful backend's staged contents are copied over
            except BaseException:
                # A refused growth leaves the tensor backed by what its storage holds: torch sets the
                # new size before allocating, and a reclaimable workspace gave its storage up first
                # (then it is empty, as _shrink leaves one, and the next request regrows it).
                self._capacity = tensor.untyped_storage().nbytes()
                tensor.resize_(min(before, self._capacity))
                if self._capacity == 0:
                    self._policy.reset()
                raise
            self._capacity = tensor.untyped_storage().nbytes()
            tensor.resize_(nbytes)
            return True
        tensor.resize_(nbytes)
        return False

    def _other_streams(self, meta):
        """Whether a stream other than this one may still use the workspace."""
        if self._disabled or getattr(meta, "multi_stream", False):
            return True
        stream_fn = self._stream_fn
        return stream_fn is not None and stream_fn() != self._stream

    def note_use(self):
        """`get` or `reserve` served without growing: under capture that pins the workspace."""
        capturing = self._capturing
        if capturing is not None and not self._pinned and capturing():
            self._pin(self._meta())

    def _pin(self, meta):
        """A capture uses the workspace; see Note [Eager workspace under graph capture]."""
        if self._pinned:
            return
        self._pinned = True
        if not meta.is_graph_metadata:
            _log.warning(
                "torch_budget: the eager workspace of %s was used in a CUDA graph capture, which baked its address "
                "in: it keeps its %d bytes for good, neither shrinking nor growing. Give captured forwards graph "
                "metadata with a graph workspace of their own.", _describe(meta), self._capacity,
            )

    def _disable(self, meta, why):
        self._disabled = True
        _log.warning(
            "torch_budget: eager workspace reclamation disabled for good for %s: %s. Releasing a "
            "workspace used from several streams could free memory another stream still uses; "
            "it now stays at its largest size (%d bytes, floor %d).",
            _describe(meta), why, self._capacity, self._floor,
        )

    def __repr__(self):
        return (
            f"WorkspaceState(device={self._device}, capacity={self._capacity}, floor={self._floor}, "
            f"reclaim_disabled={self._disabled}, in_forward={self._lock.locked()})"
        )


class _NoWorkspace:
    """What `workspace()` returns for graph metadata: a context that does nothing."""

    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, exc_type, exc, tb):
        return False


_GRAPH_NOOP = _NoWorkspace()


def workspace(metadata) -> "AbstractContextManager[None]":
    """Context manager around one eager forward: ``with torch_budget.workspace(meta): ...``.

    Raises NotWarmedUpError (a ValueError) if warm-up has not created the eager workspace,
    StateError (a RuntimeError) when a forward is already running on the same workspace.
    Does nothing for graph metadata; under graph capture it only pins the workspace (Note
    [Eager workspace under graph capture]). See Note [Eager workspace reclamation].
    """
    if not hasattr(metadata, "is_graph_metadata"):
        raise TypeError(f"workspace() takes the forward's attention metadata (an object with is_graph_metadata, "
                        f"warmed up with torch_budget.warm_up), got {type(metadata).__name__} ({metadata!r})")
    if metadata.is_graph_metadata:
        return _GRAPH_NOOP
    state = getattr(metadata, "workspace_state", None)
    if state is None:
        raise _missing_warm_up(metadata)
    return state


def _check_workspace_tensor(tensor, meta):
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{_describe(meta)}.workspace must be a torch.Tensor, got {type(tensor).__name__}")
    problems = []
    if tensor.dtype != torch.uint8:
        problems.append(f"dtype {tensor.dtype} (must be torch.uint8)")
    if tensor.dim() != 1:
        problems.append(f"{tensor.dim()} dimensions (must be 1)")
    if tensor._base is not None or tensor.storage_offset() != 0 or not tensor.is_contiguous():
        problems.append("a view (must own its storage from offset 0)")
    if tensor.requires_grad:
        problems.append("requires_grad=True")
    if problems:
        raise InvalidArgumentError(f"{_describe(meta)}.workspace cannot be managed: it has " + ", ".join(problems))


def _device_hooks(device, meta):
    """Stream-identity and capture-check callables for `device`, resolved once at warm-up so
    that forwards pay for neither a lookup nor a Stream object."""
    import torch

    stream_fn = getattr(meta, "stream_fn", None)
    if device.type != "cuda":
        return stream_fn, None
    capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
    if stream_fn is None:
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            stream_fn = functools.partial(raw, device.index)
        else:
            stream_fn = functools.partial(lambda index: torch.cuda.current_stream(index).cuda_stream, device.index)
    return stream_fn, capturing


def warm_up(meta, nbytes=None, device=None) -> "torch.Tensor":
    """Create the eager workspace of `meta`; its capacity becomes the floor. Returns it.

    With `nbytes`, allocates a workspace of that many bytes on `device` (default
    ``meta.device``). Without, adopts the tensor already in ``meta.workspace``. Warm up on the
    stream the forwards will run on: the first forward on another stream disables reclamation.
    A metadata object is warmed up once, and its workspace's storage may back no other live
    metadata's workspace or graph workspace, nor its own graph workspace (InvalidArgumentError).
    """
    import torch

    if not hasattr(meta, "is_graph_metadata"):
        raise TypeError(f"{_describe(meta)} has no is_graph_metadata, which workspace metadata must have (see the "
                        "protocol in torch_budget.eager_workspace; reclaimable and the others are optional)")
    if getattr(meta, "workspace_state", None) is not None:
        raise StateError(
            f"{_describe(meta)} is already warmed up (floor {meta.workspace_state.floor} bytes); "
            "use a new metadata object for a new workspace"
        )
    if nbytes is None:
        tensor = getattr(meta, "workspace", None)
        if tensor is None:
            raise InvalidArgumentError(f"{_describe(meta)} has no workspace to adopt: pass nbytes to allocate one")
    else:
        nbytes = as_bytes("nbytes", nbytes)
        if device is None:
            device = getattr(meta, "device", None)
        if device is None:
            raise InvalidArgumentError(f"{_describe(meta)} has no device: pass device= to warm_up")
        with _allocation_scope():
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _check_workspace_tensor(tensor, meta)
    stream_fn, capturing = _device_hooks(tensor.device, meta)

    def install():
        state = WorkspaceState(meta, tensor, stream_fn, capturing)
        meta.workspace = tensor
        meta.workspace_state = state
        return state

    claim(meta, tensor, install)
    return tensor


def get(meta, nbytes) -> "torch.Tensor":
    """Return a `nbytes` uint8 view of the shared eager workspace, growing it if needed.

    Every layer of a forward asks for its own need; the one storage grows to the largest
    (grow-only), so the workspace holds the largest layer's need, not the sum. The view is
    valid until the next `get` on the same metadata and must not be kept across forwards.
    """
    return reserve(meta, nbytes)[:nbytes]


def reserve(meta, nbytes) -> "torch.Tensor":
    """Grow the eager workspace of `meta` in place to a logical size of at least `nbytes`, and
    return it (``meta.workspace`` itself, not a view).

    For a backend with its own sizing, in place of ``meta.workspace.resize_(nbytes)``: the
    growth is charged to the workspace tag, counted in its budget and measured for the shrink,
    and refused where `get`'s would be (see `WorkspaceState.grow`).
    """
    tensor = meta.workspace
    if type(nbytes) is not int or not 0 <= nbytes < 1 << 63:
        nbytes = as_bytes("nbytes", nbytes)
    if tensor is None:
        raise _missing_warm_up(meta)
    state = getattr(meta, "workspace_state", None)
    if nbytes > tensor.numel():
        if state is None:
            raise _missing_warm_up(meta)
        state.grow(tensor, nbytes)
    elif state is not None:
        state.note_use()
    return tensor


class WorkspaceMetadata:
    """Workspace metadata for code without its own metadata class (see the protocol above).

    device: where the eager workspace lives.
    reclaimable: the workspace is pure scratch (safe to release and reallocate).
    is_graph_metadata: used by CUDA graphs; the manager leaves it alone.
    multi_stream: used from several streams; disables reclamation at the first forward.
    graph_workspace: the workspace captured graphs use, kept apart from the eager one.
    stream_fn: identity of the current stream, for devices torch_budget cannot query.
    return_to_device: a shrink hands the freed memory back to the device at once (under
    torch_budget.install()); False keeps it cached for the next growth.
    """

    __slots__ = (
        "device", "workspace", "graph_workspace", "is_graph_metadata", "reclaimable",
        "multi_stream", "stream_fn", "workspace_state", "return_to_device", "__weakref__",
    )

    def __init__(
        self,
        device="cuda",
        *,
        reclaimable=False,
        is_graph_metadata=False,
        multi_stream=False,
        graph_workspace=None,
        stream_fn=None,
        return_to_device=True,
    ):
        import torch

        self.device = torch.device(device)
        self.workspace = None
        self.graph_workspace = graph_workspace
        self.is_graph_metadata = boolean(is_graph_metadata, "is_graph_metadata")
        self.reclaimable = boolean(reclaimable, "reclaimable")
        self.multi_stream = boolean(multi_stream, "multi_stream")
        if stream_fn is not None and not callable(stream_fn):
            raise TypeError(f"stream_fn must be callable, got {type(stream_fn).__name__}")
        self.stream_fn = stream_fn
        self.return_to_device = boolean(return_to_device, "return_to_device")
        self.workspace_state = None

    def warm_up(self, nbytes=None):
        """Create the eager workspace (`nbytes` on this metadata's device); see `warm_up`."""
        return warm_up(self, nbytes)

    def get(self, nbytes):
        """A `nbytes` view of the shared eager workspace; see `get`."""
        return get(self, nbytes)

    @property
    def capacity(self):
        """Bytes the eager workspace holds (0 before warm-up)."""
        state = self.workspace_state
        return 0 if state is None else state.capacity

    @property
    def floor(self):
        state = self.workspace_state
        return 0 if state is None else state.floor

    @property
    def reclaim_disabled(self):
        state = self.workspace_state
        return False if state is None else state.reclaim_disabled

    def __repr__(self):
        return (
            f"WorkspaceMetadata(device={self.device}, capacity={self.capacity}, floor={self.floor}, "
            f"reclaimable={self.reclaimable}, is_graph_metadata={self.is_graph_metadata})"
        )
