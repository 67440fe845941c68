"""Whether device memory a program has deleted stays referenced, and by what: the demo's graph
probe (its step 4: a decode runner captured against a throw-away KV cache, replayed once,
closed and deleted) and a plain eager decode, natively or under install().

    python tools/probe_retention.py [--install]

Prints, for each case, the bytes still allocated after `del` and gc.collect(), and for a KV
tensor that is still alive the chain of referrers that keeps it (frames by function, tracebacks
by the exception that made them). Run under compute-sanitizer to see what the sanitizer changes:
there the demo's estimation and probe caches outlived their `del` (held by frames of calls that had
returned), and so did a Hugging Face StaticCache on torch's native allocator.
"""
import argparse
import gc
import sys
import types
import weakref


def describe(o) -> str:
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_name} ({o.f_code.co_filename.rsplit('/', 1)[-1]}:{o.f_lineno})"
    if isinstance(o, types.TracebackType):
        return f"traceback at {o.tb_frame.f_code.co_name}:{o.tb_lineno}"
    if isinstance(o, BaseException):
        return f"exception {type(o).__name__}: {str(o)[:160]}"
    if isinstance(o, types.FunctionType):
        return f"function {o.__module__}.{o.__qualname__}"
    if isinstance(o, dict):
        return f"dict with keys {list(o)[:6]}"
    if isinstance(o, (list, tuple)):
        items = ", ".join(_short(x) for x in list(o)[:4])
        return f"{type(o).__qualname__} of {len(o)} [{items}{', ...' if len(o) > 4 else ''}]"
    if type(o).__name__ == "cell":
        return f"cell of {', '.join(_closures_of(o)) or 'no function found'}"
    return f"{type(o).__module__}.{type(o).__qualname__}"


def _short(x) -> str:
    if isinstance(x, (str, int, float, bool, type(None))):
        return repr(x)[:40]
    if isinstance(x, types.FunctionType):
        return f"function {x.__module__}.{x.__qualname__}"
    return type(x).__qualname__


def _closures_of(cell) -> list:
    """The functions whose closure holds `cell`."""
    names = []
    for t in gc.get_referrers(cell):
        if isinstance(t, tuple):
            for f in gc.get_referrers(t):
                if isinstance(f, types.FunctionType) and f.__closure__ is t:
                    names.append(f"{f.__module__}.{f.__qualname__}")
    return names


def holder_chains(target, max_depth: int = 12, max_chains: int = 4) -> list:
    """Referrer chains from `target` upwards, each ending where no further Python referrer is
    found (held from C: the last object's reference count says by how many) or at a module's
    dict. This walk's own lists and frames are never taken for referrers."""
    own = set()  # ids of the walk's bookkeeping

    def new_list(items):
        out = list(items)
        own.add(id(out))
        return out

    def referrers(o):
        found = gc.get_referrers(o)
        own.add(id(found))
        return [r for r in found if id(r) not in own
                and not (isinstance(r, types.FrameType) and r.f_code.co_name in ("holder_chains", "referrers",
                                                                                "report"))]

    chains = new_list([])
    stack = new_list([new_list([target])])
    while stack and len(chains) < max_chains:
        path = stack.pop()
        top = path[-1]
        refs = referrers(top)
        own.add(id(refs))
        refs = [r for r in refs if not any(r is p for p in path)]
        if not refs or len(path) >= max_depth or (isinstance(top, dict) and "__name__" in top):
            chains.append((path, sys.getrefcount(top) - 2))
            continue
        for r in refs[:2]:
            stack.append(new_list(path + [r]))
    return chains


def report(label: str, ref, before: int, torch) -> None:
    gc.collect()
    left = torch.cuda.memory_allocated() - before
    print(f"{label}: {left} bytes still allocated after del + gc.collect(); KV tensor "
          f"{'ALIVE' if ref() is not None else 'freed'}")
    if ref() is not None:
        for path, refcount in holder_chains(ref()):
            print("  held by: " + " <- ".join(describe(o) for o in path[1:]) + f" (top refcount {refcount})")


def probe_graphs(torch, device) -> None:
    from torch_budget.demo.model import DemoModel, PagedKVCache
    from torch_budget.demo.serve import decode_runner
    from torch_budget.demo.settings import BLOCK_SIZE, MODEL
    from torch_budget.graphs import GraphPoolManager

    model = DemoModel(MODEL, device=device, seed=0)
    before = torch.cuda.memory_allocated()
    manager = GraphPoolManager(device)
    cache = PagedKVCache(MODEL, num_blocks=2, max_batch=2, block_size=BLOCK_SIZE, device=device)
    ref = weakref.ref(cache.k)
    runner = decode_runner(manager, "probe", model, cache, (1, 2))
    runner.capture()
    zeros = torch.zeros(2, dtype=torch.int64)
    runner.step(2, ids=zeros, pos=zeros)
    torch.cuda.synchronize()
    runner.close()
    del runner, cache, zeros
    report("graph probe", ref, before, torch)

    cache = PagedKVCache(MODEL, num_blocks=2, max_batch=2, block_size=BLOCK_SIZE, device=device)
    ref = weakref.ref(cache.k)
    from torch_budget.demo.model import decode

    ids = torch.zeros(2, dtype=torch.int64, device=device)
    decode(model, ids, ids, cache)
    torch.cuda.synchronize()
    del cache, ids
    report("eager decode", ref, before, torch)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--install", action="store_true")
    args = ap.parse_args()
    if args.install:
        import torch_budget

        torch_budget.install()
    import torch

    if not torch.cuda.is_available():
        print("probe_retention: no CUDA device")
        return 0
    probe_graphs(torch, torch.device("cuda", 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
