"""Which storages the eager workspace manager holds, so that one storage backs one managed
workspace: over a shared storage the per-metadata forward locks miss overlapping forwards, and
growth or a shrink through one metadata moves the other's memory, a captured graph's baked
address included. eager_workspace.warm_up claims each workspace here."""

import threading
import weakref

from torch_budget.errors import InvalidArgumentError

__all__ = ["claim"]

# Every live WorkspaceState. Weak, so a dropped metadata's storage may be adopted again; read
# through each metadata's current tensors, so growth and shrinks need not update it.
_managed = weakref.WeakSet()
_lock = threading.Lock()  # held from a claim's check to its registration


def _shares_storage(a, b):
    """Whether tensors `a` and `b` share a storage, or any byte of device memory."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa._cdata == sb._cdata:
        return True
    if a.device != b.device:
        return False
    pa, pb = sa.data_ptr(), sb.data_ptr()  # 0: no memory (empty, or the meta device)
    return pa != 0 and pb != 0 and pa < pb + sb.nbytes() and pb < pa + sa.nbytes()


def _check_unshared(meta, tensor):
    """Raise unless `tensor` and meta's graph workspace have storages no other live metadata
    manages, and do not share one with each other. Caller holds _lock."""
    import torch

    graph_ws = getattr(meta, "graph_workspace", None)
    if not isinstance(graph_ws, torch.Tensor):
        graph_ws = None
    moves = "an eager forward's growth or shrink would move the address captured graphs baked in"
    if graph_ws is not None and _shares_storage(tensor, graph_ws):
        raise InvalidArgumentError(f"{_name(meta)}.graph_workspace shares its storage with the eager workspace: "
                                   f"{moves}; give the graph workspace a tensor of its own")
    for state in list(_managed):
        other = state.metadata
        if other is None or other is meta:
            continue
        other_ws, other_graph = other.workspace, getattr(other, "graph_workspace", None)
        if other_ws is not None and _shares_storage(tensor, other_ws):
            raise InvalidArgumentError(
                f"{_name(meta)}.workspace is already the workspace of {_name(other)}: over one storage the "
                "two would run forwards at once unguarded, and one's growth or shrink would move the other's "
                "memory; give each metadata a workspace of its own (warm_up(meta, nbytes) allocates one)")
        if graph_ws is not None and other_ws is not None and _shares_storage(graph_ws, other_ws):
            raise InvalidArgumentError(f"{_name(meta)}.graph_workspace shares its storage with the workspace of "
                                       f"{_name(other)}: {moves}; give the graph workspace a tensor of its own")
        if isinstance(other_graph, torch.Tensor) and _shares_storage(tensor, other_graph):
            raise InvalidArgumentError(f"{_name(meta)}.workspace is already the graph_workspace of "
                                       f"{_name(other)}: {moves}; give each a tensor of its own")


def claim(meta, tensor, install):
    """Refuse (InvalidArgumentError) a `tensor` or a ``meta.graph_workspace`` whose storage
    another live metadata manages, or that share one; else register the state `install()`
    returns. One lock spans both, so two warm-ups cannot claim one storage at once."""
    with _lock:
        _check_unshared(meta, tensor)
        _managed.add(install())


def _name(meta):
    return f"{type(meta).__name__} at {id(meta):#x}"
