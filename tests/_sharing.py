"""Sharing CUDA tensors with a consumer process: the producer's half runs in a test body (in
its fresh process), the consumer is spawned by torch.multiprocessing and finds this module by
name, as the body's process does."""
import torch  # importing touches no device: the consumer installs, where it does, before it allocates


def consumer(install, q_in, q_out):
    """Checks each (name, tensor, fill) it is sent, adds 1 to the tensor through the shared
    mapping and answers (name, ok, numel); ends on None."""
    if install:
        import torch_budget
        torch_budget.install()
    while True:
        item = q_in.get(timeout=120)
        if item is None:
            break
        name, t, fill = item
        ok = bool((t == fill).all().item())
        t.add_(1)                       # written back through the shared mapping
        torch.cuda.synchronize(t.device)  # the tensor's device: the current one is 0 for a cuda:1 tensor
        q_out.put((name, ok, t.numel()))
        del t, item
    q_out.put(("done", True, 0))


def share_with_consumer(device: int, consumer_installed: bool, make, extra=lambda: None):
    """The producer's half of a sharing test (its body has installed torch_budget, or runs on
    torch's own allocator): `make()`
    returns `tensors` {name: tensor on `device`} and `fills` {name: value}; each goes to a
    consumer process (installed or not) through a torch.multiprocessing queue, which checks it
    and adds 1 through the shared mapping. The producer checks the answers and the writes, runs
    `extra()` (what it returns stays alive until the consumer stops, as the tensors do), stops the
    consumer, and checks that `device`'s allocated memory is back and, after empty_cache, its
    reserved memory too (the consumer's mappings no longer hold any). Prints "ipc ok"."""
    import gc
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(consumer_installed, q_in, q_out))
    p.start()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    tensors, fills = make()
    for name, t in tensors.items():
        q_in.put((name, t, fills[name]))
    got = dict(q_out.get(timeout=120)[:2] for _ in tensors)
    assert got == dict.fromkeys(tensors, True), got
    for name, t in tensors.items():
        assert bool((t == fills[name] + 1).all().item()), name    # the consumer's write arrived
        assert t.device.index == device, (name, t.device)
    kept = extra()  # noqa: F841
    q_in.put(None)
    assert q_out.get(timeout=120)[0] == "done"
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    del tensors, t, kept
    torch.cuda.ipc_collect()
    gc.collect()
    torch.cuda.synchronize(device)
    assert torch.cuda.memory_allocated(device) <= base + 4096, (torch.cuda.memory_allocated(device), base)
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(device) <= reserved, (torch.cuda.memory_reserved(device), reserved)
    print("ipc ok", sorted(got))


def holder(install, q_in, q_out):
    """Holds the tensor it is sent until told to drop it: answers "held", then "dropped"."""
    if install:
        import torch_budget
        torch_budget.install()
    t = q_in.get(timeout=120)
    device = t.device
    q_out.put("held")
    assert q_in.get(timeout=120) == "drop"
    del t
    torch.cuda.synchronize(device)
    q_out.put("dropped")
